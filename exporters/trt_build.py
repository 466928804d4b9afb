"""ONNX -> TensorRT engines: optimization profiles (pure, tested everywhere) and the thin build
layer over the `tensorrt` Python API (needs TensorRT and an NVIDIA GPU).

Written against the TensorRT 10 API as documented (Builder, OnnxParser.parse_from_file,
IBuilderConfig with memory pool limits, optimization profiles, timing cache,
build_serialized_network). The tensorrt API is used directly rather than through Polygraphy's
loaders so that every failure maps to one sentence naming the graph and the parser's own error.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from tk.models.spec import contract
from tk.models.spec.contract import BATCH, PAST, SEQ, TOTAL
from tk.models.spec.engine import EngineMeta, Gpu, Limits
from tk.models.spec.manifest import Manifest, sha256_file
from tk.models.spec.dtypes import canonical_dtype
from tk.models.spec.errors import TRT_MISSING, TkError, UsageProblem


class EngineBuildError(TkError, RuntimeError):
    """TensorRT is missing, or could not parse or build a graph."""


def compute_profiles(dims: contract.GraphDims, limits: Limits, max_context: int) -> dict[str, dict[str, list[list[int]]]]:
    """Per graph, per input: [min, opt, max] shapes.

    prefill: batch 1..max_batch, sequence 1..max_input_len. decode: batch 1..max_batch, past
    1..max_seq_len-1 (never 0: the prefill graph covers "no past", and TensorRT rejects empty dims);
    with a static cache the decode shapes are fixed at its capacity and only the batch varies.
    Opt is the midpoint of each range (batch max_batch//2, prompt max_input_len//2, past
    (max_seq_len-1)//2): TensorRT tunes its kernels for opt and they stay valid over the range,
    so the midpoint bounds how far any shape actually run is from the tuned one.
    """
    limits.check(max_context)
    B, L, S = limits.max_batch, limits.max_input_len, limits.max_seq_len
    if dims.kv_capacity is not None and S != dims.kv_capacity:
        raise UsageProblem(f"the graphs have a static cache of {dims.kv_capacity} positions; --max-seq-len must be "
                           f"{dims.kv_capacity} (or left out)")
    ob, ol, op = max(1, B // 2), max(1, L // 2), max(1, (S - 1) // 2)
    # [min, opt, max] of each symbolic dim; a decode step takes one new token a row, and its mask covers
    # the past and that token (a static cache's narrow mask: at least one position)
    sizes = {contract.PREFILL: ({BATCH: 1, SEQ: 1}, {BATCH: ob, SEQ: ol}, {BATCH: B, SEQ: L}),
             contract.DECODE: ({BATCH: 1, SEQ: 1, PAST: 1, TOTAL: 1 if dims.kv_capacity is not None else 2},
                               {BATCH: ob, SEQ: 1, PAST: op, TOTAL: op + 1}, {BATCH: B, SEQ: 1, PAST: S - 1, TOTAL: S})}
    return {graph: {spec.name: [list(contract.shape(spec, s)) for s in sizes[graph]] for spec in dims.inputs(graph)}
            for graph in contract.GRAPHS}


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise EngineBuildError(TRT_MISSING) from None
    return trt


def build_engine(trt, onnx_path: Path, profile: dict[str, list[list[int]]], precision: str, strongly_typed: bool,
                 workspace_gib: float, timing_cache: bytes | None) -> tuple[bytes, bytes]:
    """One engine from one graph. Returns (serialized engine, serialized timing cache)."""
    logger = trt.Logger(trt.Logger.WARNING)
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # TypeError/RuntimeError when no CUDA driver or GPU is present
        raise EngineBuildError(f"TensorRT could not create a builder ({e}); build engines on a machine with an "
                               "NVIDIA GPU and driver") from None
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # by path, so external data resolves
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if not strongly_typed:
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: TF32 would loosen parity
        if precision == "float16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif precision == "bfloat16":
            config.set_flag(trt.BuilderFlag.BF16)
    opt_profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    cache = config.create_timing_cache(timing_cache or b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise EngineBuildError(f"TensorRT failed to build an engine from {onnx_path.name}; rerun with --debug and "
                               "read TensorRT's log above")
    return bytes(engine), bytes(config.get_timing_cache().serialize())


def build_engines(artifact: Path, manifest: Manifest, env: dict, precision: str | None, limits: Limits, *,
                  workspace_gib: float = 4.0, timing_cache: Path | None = None,
                  progress: Callable[[str], None] = lambda m: None) -> tuple[EngineMeta, dict[str, bytes]]:
    """Both engines for an artifact. Returns (engine.json, engine bytes by graph); the caller writes
    them atomically."""
    trt = import_tensorrt()
    dims = manifest.dims
    exported = manifest.dtype
    precision = canonical_dtype(precision) if precision else exported
    if exported != "float32" and precision != exported:
        raise UsageProblem(f"the graphs were exported in {exported}; build {exported} engines from them, or export "
                         f"fp32 graphs to build {precision} engines")
    # fp16/bf16 graphs carry their precision in their types; quantized ones need a strongly typed
    # network for their DequantizeLinear (TensorRT's weight-only quantization guide)
    strongly_typed = exported != "float32" or manifest.precision.quantized
    profiles = compute_profiles(dims, limits, manifest.max_context)
    cache = timing_cache.read_bytes() if timing_cache and timing_cache.is_file() else None
    engines, hashes = {}, {}
    for graph in contract.GRAPHS:
        path = artifact / contract.GRAPH_FILES[graph]
        hashes[graph] = sha256_file(path)
        engines[graph], cache = build_engine(trt, path, profiles[graph], precision, strongly_typed,
                                             workspace_gib, cache)
        progress(f"built {contract.ENGINE_FILES[graph]} ({len(engines[graph]) / 2**20:.1f} MiB)")
    if timing_cache is not None and cache:
        timing_cache.write_bytes(cache)
    meta = EngineMeta(tensorrt_version=env["tensorrt_version"], gpu=Gpu(env["gpu_name"], env["compute_capability"]),
                      precision=precision, strongly_typed=strongly_typed, limits=limits, profiles=profiles,
                      onnx_sha256=hashes, engine_sha256={g: hashlib.sha256(b).hexdigest() for g, b in engines.items()})
    return meta, engines
