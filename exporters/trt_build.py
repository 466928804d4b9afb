"""ONNX -> TensorRT engines: optimization profiles (pure, tested everywhere) and the thin build
layer over the `tensorrt` Python API (needs TensorRT and an NVIDIA GPU).

Written against the TensorRT 10.15+ and 11.x APIs (Builder, OnnxParser.parse_from_file / parse with
a path, IBuilderConfig with memory pool limits, optimization profiles, timing cache,
build_serialized_network). Every network is strongly typed, on both majors: 11.0 removed weak
typing and the FP16/BF16/INT8 builder flags, so an engine's precision is its graphs' (export
fp16/bf16 graphs for fp16/bf16 engines). The tensorrt API is used directly rather than through
Polygraphy's loaders so that every failure maps to one sentence naming the graph and TensorRT's own
error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import onnx

from tk.exporters.onnx_util import is_default_domain
from tk.models.spec import contract
from tk.models.spec.contract import BATCH, KEEP, PAST, SEQ, TOTAL
from tk.models.spec.dtypes import DTYPES, canonical_dtype
from tk.models.spec.engine import EngineMeta, Gpu, Limits
from tk.models.spec.errors import TRT_MISSING, TkError, UsageProblem
from tk.models.spec.manifest import Manifest, sha256_file

# The ONNX parser marks each Attention layer non-decomposable unless its node carries this attribute
# (onnx-tensorrt's Attention importer, 10.14+): one with no fused kernel (fp32, unusual head dims)
# then fails to build instead of falling back to primitive layers.
DECOMPOSABLE = "TRT_decomposable"


class EngineBuildError(TkError, RuntimeError):
    """TensorRT is missing, or could not parse or build a graph."""


class AttentionBuildError(EngineBuildError):
    """A parse or build failure that names an attention layer: retried with decomposable attention."""


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
             contract.DECODE: ({BATCH: 1, SEQ: 1, PAST: 1, TOTAL: 1 if dims.kv_capacity is not None else 2, KEEP: 1},
                               {BATCH: ob, SEQ: 1, PAST: op, TOTAL: op + 1, KEEP: 1},
                               {BATCH: B, SEQ: 1, PAST: S - 1, TOTAL: S, KEEP: 1})}
    return {graph: {spec.name: [list(contract.shape(spec, s)) for s in sizes[graph]] for spec in dims.inputs(graph)}
            for graph in contract.GRAPHS}


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise EngineBuildError(TRT_MISSING) from None
    return trt


def check_precision(manifest: Manifest, precision: str | None) -> str:
    """The engines' precision: the graphs' dtype. Any other --precision is a usage error that says
    which artifact to export instead (a strongly typed network runs in its graphs' own types)."""
    exported = manifest.dtype
    if precision is None or canonical_dtype(precision) == exported:
        return exported
    short = DTYPES[canonical_dtype(precision)].short
    raise UsageProblem(f"--precision {short}: the graphs are {exported}, and TensorRT builds engines in their graphs' "
                       f"own types (strongly typed); export {short} graphs and build those: tk export "
                       f"{manifest.source.path} -o OUT --dtype {short} (with this artifact's other export flags)")


def decomposable_attention(onnx_path: Path) -> bytes:
    """The graph with `TRT_decomposable=1` on every Attention node, serialized in memory: the artifact
    keeps standard nodes for ONNX Runtime and the checker. Weights stay external (parse with the
    graph's path, so the parser finds them beside it)."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "Attention" and is_default_domain(node.domain):
            kept = [a for a in node.attribute if a.name != DECOMPOSABLE]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute(DECOMPOSABLE, 1)])
    return model.SerializeToString()


def _logger(trt, verbose: bool, progress: Callable[[str], None]):
    """A TensorRT logger that shows warnings (everything with `verbose`) and keeps the errors, which
    say whether a failed build names an attention layer."""
    shown = trt.ILogger.Severity.VERBOSE if verbose else trt.ILogger.Severity.WARNING

    class Log(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if int(severity) <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(str(msg))
            if int(severity) <= int(shown):
                progress(f"TensorRT: {msg}")

    return Log()


def _names_attention(texts: list[str]) -> bool:
    return any("attention" in t.lower() for t in texts)


def _set_timing_cache(trt, config, blob: bytes | None, progress: Callable[[str], None]) -> None:
    """Load `blob` into the builder, or a fresh cache when TensorRT refuses it (one note)."""
    if blob:
        try:
            cache = config.create_timing_cache(blob)
        except RuntimeError:  # pybind's translation of a cache TensorRT cannot read
            cache = None
        if cache is not None and config.set_timing_cache(cache, ignore_mismatch=False):
            return
        progress("ignoring the timing cache: this TensorRT did not accept it; a fresh one replaces it")
    cache = config.create_timing_cache(b"")
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
        raise EngineBuildError(f"TensorRT {trt.__version__} could not create a timing cache; build without "
                               "--timing-cache, or check the GPU with tk doctor")


def build_engine(trt, onnx_path: Path, profile: dict[str, list[list[int]]], precision: str, *,
                 workspace_gib: float | None = None, timing_cache: bytes | None = None, decomposable: bool = False,
                 verbose: bool = False, progress: Callable[[str], None] = lambda m: None) -> tuple[bytes, bytes]:
    """One strongly typed engine from one graph. Returns (serialized engine, serialized timing cache).
    `workspace_gib` None leaves the workspace to TensorRT (a fixed cap can exclude the tactics a valid
    build needs)."""
    logger = _logger(trt, verbose, progress)
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # TypeError/RuntimeError when no CUDA driver or GPU is present
        raise EngineBuildError(f"TensorRT could not create a builder ({e}); build engines on a machine with an "
                               "NVIDIA GPU and driver") from None
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    # by path, so external data resolves: the rewritten graph is parsed from memory with the original's path
    parsed = (parser.parse(decomposable_attention(onnx_path), str(onnx_path)) if decomposable
              else parser.parse_from_file(str(onnx_path)))
    if not parsed:
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        texts = [f"{e.node_name() or e.node_operator() or 'graph'} ({e.node_operator()}): {e.desc()}" for e in errors]
        error = AttentionBuildError if _names_attention(texts) else EngineBuildError
        raise error(f"TensorRT's ONNX parser rejected {onnx_path.name}: {'; '.join(texts or logger.errors)}")
    config = builder.create_builder_config()
    if workspace_gib is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if precision == "float32":
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: TF32 matmuls would loosen parity
    opt_profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    _set_timing_cache(trt, config, timing_cache, progress)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        error = AttentionBuildError if _names_attention(logger.errors) else EngineBuildError
        said = "; ".join(logger.errors[-3:]) or "rerun with --verbose and read TensorRT's log"
        raise error(f"TensorRT failed to build an engine from {onnx_path.name}: {said}")
    return bytes(engine), bytes(config.get_timing_cache().serialize())


def _record(cache: Path) -> Path:
    return cache.with_name(cache.name + ".json")


def read_timing_cache(path: Path, version: str, progress: Callable[[str], None]) -> bytes | None:
    """The cache at `path` if this TensorRT wrote it (its record FILE.json says which version and
    which bytes); else None, with one note. A cache is valid only for the exact TensorRT build that
    wrote it, so a stale one never reaches the builder."""
    if not path.is_file():
        return None
    try:
        blob = path.read_bytes()
        record = json.loads(_record(path).read_text())
        wrote, digest = record["tensorrt_version"], record["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        why = f"no readable {_record(path).name} says which TensorRT wrote it"
    else:
        if wrote != version:
            why = f"TensorRT {wrote} wrote it and this is TensorRT {version}"
        elif digest != hashlib.sha256(blob).hexdigest():
            why = f"it changed since {_record(path).name} was written"
        else:
            return blob
    progress(f"ignoring timing cache {path}: {why}; a fresh one replaces it")
    return None


def write_timing_cache(path: Path, blob: bytes, version: str) -> None:
    """The cache, then its record (each lands whole: temp + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = json.dumps({"tensorrt_version": version, "sha256": hashlib.sha256(blob).hexdigest()}).encode()
    for target, data in ((path, blob), (_record(path), record)):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)


def build_engines(artifact: Path, manifest: Manifest, env: dict, precision: str | None, limits: Limits, *,
                  workspace_gib: float | None = None, timing_cache: Path | None = None,
                  decomposable: bool = False, verbose: bool = False,
                  progress: Callable[[str], None] = lambda m: None) -> tuple[EngineMeta, dict[str, bytes]]:
    """Both engines for an artifact. Returns (engine.json, engine bytes by graph); the caller writes
    them atomically. A graph whose parse or build fails naming an attention layer is built again with
    decomposable attention (unless it already was), and so is the graph after it."""
    trt = import_tensorrt()
    precision = check_precision(manifest, precision)
    profiles = compute_profiles(manifest.dims, limits, manifest.max_context)
    cache = read_timing_cache(timing_cache, trt.__version__, progress) if timing_cache else None
    engines, hashes = {}, {}
    for graph in contract.GRAPHS:
        path = artifact / contract.GRAPH_FILES[graph]
        hashes[graph] = sha256_file(path)
        build = functools.partial(build_engine, trt, path, profiles[graph], precision, workspace_gib=workspace_gib,
                                  verbose=verbose, progress=progress)
        try:
            engines[graph], cache = build(timing_cache=cache, decomposable=decomposable)
        except AttentionBuildError as e:
            if decomposable:
                raise
            progress(f"{e}; building it again with {DECOMPOSABLE}=1 on its Attention nodes (in memory: the "
                     "artifact is unchanged; --decomposable-attention does this from the start)")
            decomposable = True  # the other graph has the same attention
            engines[graph], cache = build(timing_cache=cache, decomposable=True)
        progress(f"built {contract.ENGINE_FILES[graph]} ({len(engines[graph]) / 2**20:.1f} MiB)")
    if timing_cache is not None:
        write_timing_cache(timing_cache, cache, trt.__version__)
    meta = EngineMeta(tensorrt_version=env["tensorrt_version"], gpu=Gpu(env["gpu_name"], env["compute_capability"]),
                      precision=precision, limits=limits, profiles=profiles, onnx_sha256=hashes,
                      engine_sha256={g: hashlib.sha256(b).hexdigest() for g, b in engines.items()})
    return meta, engines
