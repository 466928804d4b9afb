"""ONNX -> TensorRT engines: optimization profiles (pure, tested everywhere) and the thin build
layer over the `tensorrt` Python API (needs TensorRT and an NVIDIA GPU).

Written against the TensorRT 10 API as documented (Builder, OnnxParser.parse_from_file,
IBuilderConfig with memory pool limits, optimization profiles, timing cache,
build_serialized_network). The tensorrt API is used directly rather than through Polygraphy's
loaders so that every failure maps to one sentence naming the graph and the parser's own error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tk.models.spec import contract
from tk.models.spec.manifest import Manifest, sha256_file
from tk.models.spec.dtypes import canonical_dtype
from tk.models.spec.errors import TRT_MISSING, TkError, UsageProblem


class EngineBuildError(TkError, RuntimeError):
    """TensorRT is missing, or could not parse or build a graph."""


@dataclass(frozen=True)
class Limits:
    max_batch: int
    max_input_len: int  # longest prompt the prefill engine takes
    max_seq_len: int  # prompt + generated tokens the decode engine takes

    def check(self, max_context: int) -> None:
        if self.max_batch < 1:
            raise UsageProblem(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.max_input_len < 1:
            raise UsageProblem(f"--max-input-len must be at least 1, got {self.max_input_len}")
        if self.max_seq_len < 2:
            raise UsageProblem(f"--max-seq-len must be at least 2 (a prompt token and one new one), got {self.max_seq_len}")
        if self.max_input_len >= self.max_seq_len:
            raise UsageProblem(f"--max-input-len ({self.max_input_len}) must be below --max-seq-len ({self.max_seq_len}) "
                             "so at least one token can be generated")
        if self.max_seq_len > max_context:
            raise UsageProblem(f"--max-seq-len ({self.max_seq_len}) is beyond the model's context of {max_context}")


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
    ob, ol, op = max(1, B // 2), max(1, L // 2), max(1, (S - 1) // 2)
    H, D = dims.num_kv_heads, dims.head_dim
    prefill = {name: [[1, 1], [ob, ol], [B, L]] for name in ("input_ids", "attention_mask", "position_ids")}
    decode = {"input_ids": [[1, 1], [ob, 1], [B, 1]],
              "attention_mask": [[1, 2], [ob, op + 1], [B, S]],
              "position_ids": [[1, 1], [ob, 1], [B, 1]]}
    for name in contract.past_names(dims.num_layers):
        decode[name] = [[1, H, 1, D], [ob, H, op, D], [B, H, S - 1, D]]
    if dims.kv_capacity is not None:  # static cache: only the batch varies; TensorRT updates it in place
        if S != dims.kv_capacity:
            raise UsageProblem(f"the graphs have a static cache of {dims.kv_capacity} positions; --max-seq-len must be "
                             f"{dims.kv_capacity} (or left out)")
        # a narrow mask covers the positions the rows hold (contract.inputs), else the whole cache
        decode["attention_mask"] = [[1, 1], [ob, op + 1], [B, S]] if dims.narrow_mask else [[1, S], [ob, S], [B, S]]
        decode["write_indices"] = [[1], [ob], [B]]
        for name, n in zip(contract.past_names(dims.num_layers), [n for n in dims.capacities() for _ in "kv"]):
            decode[name] = [[1, H, n, D], [ob, H, n, D], [B, H, n, D]]  # a sliding layer's ring holds n < S
    return {contract.PREFILL: prefill, contract.DECODE: decode}


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


def build_engines(artifact: Path, manifest: Manifest, env: dict, precision: str | None, limits: Limits,
                  workspace_gib: float = 4.0, timing_cache: Path | None = None,
                  progress: Callable[[str], None] = lambda m: None) -> tuple[dict, dict[str, bytes]]:
    """Both engines for an artifact. Returns (engine.json contents, engine bytes by graph); the
    caller writes them atomically."""
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
    meta = {"contract_version": contract.CONTRACT_VERSION, "tensorrt_version": env["tensorrt_version"],
            "gpu": {"name": env["gpu_name"], "compute_capability": env["compute_capability"]},
            "precision": precision, "strongly_typed": strongly_typed,
            "limits": {"max_batch": limits.max_batch, "max_input_len": limits.max_input_len,
                       "max_seq_len": limits.max_seq_len},
            "profiles": profiles, "onnx_sha256": hashes,
            "engines": {g: contract.ENGINE_FILES[g] for g in contract.GRAPHS}}
    return meta, engines
