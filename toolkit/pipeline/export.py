"""`tk export` as a library call: plan, export both graphs, check them, validate with the parity
engine, and only then publish the folder.

Every option, and every refusal that depends on the model, is checked from config.json before a
weight is read (`ExportOptions.check`). Everything is written to a temporary folder beside OUT
(OUT's missing parents are created); any failure removes what this export created, so OUT either
does not exist or holds a complete, validated artifact.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import platform
import shutil
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

import onnx

from tk.exporters.contract_check import check_graph_file
from tk.exporters.onnx_export import CONTRIB_OPS, finish_graph, graph_dims, trace_graph
from tk.exporters.trt_lint import lint_graphs
from tk.exporters.weights import WEIGHTS_FILE, export_view, weights_record, write_weights
from tk.models import contract
from tk.models.artifact import ExportOptions, GraphFile, Manifest, Target, sha256_file
from tk.models.errors import CheckFailed, FilesystemProblem
from tk.models.loading import CheckpointReader, read_config, torch_dtype
from tk.toolkit.pipeline.background import Background
from tk.toolkit.backends import reference_runtime, torch_reference
from tk.toolkit.verify.metrics import Comparison, format_table, random_cases, tolerance_for
from tk.toolkit.verify.compare import ReferenceRun, compare_backends, describe_divergence, run_reference

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
VALIDATION_STEPS = 8
REFERENCE_ENV = {"OMP_NUM_THREADS": "1"}  # the child shares the cores with tracing and the writer


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("tk", "torch", "onnx", "onnxscript", "onnxruntime", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _ort_has_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def _prepare_out(out: Path, force: bool) -> tuple[Path, Path | None]:
    """Refuse an existing OUT without force; create OUT's missing parent folders; return a fresh
    temporary folder beside OUT and the top-most folder this created (None when all existed), so
    that a failed export can remove everything it made."""
    if out.exists() and not force:
        raise FilesystemProblem(f"{out} already exists; pass --force to replace it")
    parent = out.absolute().parent
    missing = [p for p in (parent, *parent.parents) if not p.exists()]
    created = missing[-1] if missing else None
    base = created.parent if created else parent
    if not base.is_dir():
        raise FilesystemProblem(f"cannot write {out}: {base} is not a folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent)), created
    except OSError as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise FilesystemProblem(f"cannot write to {base} ({e.strerror}); choose a writable -o") from None


def _move_into_place(tmp: Path, out: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp made it private; the artifact gets the user's usual permissions
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def validate(artifact: Path, manifest: Manifest, steps: int = VALIDATION_STEPS,
             reference: tuple[ReferenceRun, ReferenceRun | None] | None = None) -> tuple[dict, str, str | None]:
    """Export validation: ORT on the artifact vs the float32 PyTorch reference, through the parity
    engine without its probes. A quantized artifact is judged against the quantized reference with
    the same float tolerances, ORT multiplying in float ("float" compute); its fused MatMuls and its
    quantization error (toolkit/verify/quant.py) are checked after. `reference`: the runs of
    `reference_run` when made already (export makes them beside tracing). Returns the manifest
    record, a printable table, and what failed first (None when all passed)."""
    from tk.runtimes.ort_runtime import OrtRuntime

    tol = tolerance_for(manifest.dtype, manifest.config)
    cases = random_cases(manifest.dims.vocab_size)
    if reference is None:
        reference = _reference_runs(lambda quantized: reference_runtime(
            artifact, manifest, debug=manifest.variant.debug_outputs, quantized=quantized), manifest.precision,
            cases, steps, tol)
    graphs_ref, full_ref = reference
    # Where the decode graph also prefills, ORT runs prompts through it; TensorRT and prefill_graph
    # runs take prefill.onnx: both are judged ("ort/pre" in the table).
    runs = {"ort": False, **({"ort/pre": True} if manifest.dims.decode_prefills else {})}
    passed, cases_run, first, where = True, [], None, None
    for name, prefill_graph in runs.items():  # one runtime, so one mapping of the weights, at a time
        with OrtRuntime(artifact, one_graph=True, quant_compute="float", prefill_graph=prefill_graph) as ort:
            ort.name = name
            report = compare_backends(graphs_ref, {name: ort}, cases, tol, steps, probes=False, free_running=False)
        entry = report["backends"][name]
        passed, cases_run = passed and report["passed"], cases_run + entry["cases"]
        if first is None and entry["first_divergence"]:
            first = entry["first_divergence"]
            where = describe_divergence(name, first)
    quantized = manifest.precision.quantized
    record = {"passed": passed, "reference": "torch float32" + (", quantized weights" if quantized else ""),
              "steps": steps, "tolerance": dataclasses.asdict(tol), "comparisons": cases_run,
              "first_divergence": first}
    table = format_table([Comparison.from_dict(c) for c in cases_run])
    if quantized and passed:
        from tk.toolkit.verify.quant import check_fused, quantization_error

        record["fused_matmulnbits"] = check_fused(artifact, manifest)
        record["quantization"], q_table = quantization_error(artifact, manifest, full_ref, cases, steps)
        table += "\n" + q_table
    return record, table, where


def _reference_runs(open_reference, precision, cases, steps, tol) -> tuple[ReferenceRun, ReferenceRun | None]:
    """(the run the graphs must match, the full-precision run when the weights are quantized)."""
    runs = []
    for quantized in ([True, False] if precision.quantized else [False]):
        with open_reference(quantized) as ref:  # unloaded before the next, and before ORT loads
            runs.append(run_reference(ref, cases, steps, tol, probes=False))
    return runs[0], runs[1] if len(runs) > 1 else None


def reference_run(model_dir: Path, config, options: ExportOptions,
                  steps: int = VALIDATION_STEPS) -> tuple[ReferenceRun, ReferenceRun | None]:
    """What validation compares ORT with: the float32 reference decoder of the checkpoint on the
    validation cases (a debug export localizes to the layer outputs; quantized weights: also the
    quantized reference). Needs no artifact, so export runs it in a child process while it writes
    and traces."""
    dims = graph_dims(config, options.precision, options.variant)
    tol = tolerance_for(options.precision.activations, config.to_dict())
    p = options.precision
    return _reference_runs(lambda quantized: torch_reference(
        model_dir, dims, config.max_position_embeddings, debug=options.variant.debug_outputs,
        quantized=p if quantized else None), p, random_cases(dims.vocab_size), steps, tol)


def _export_graphs(model_dir: Path, tmp: Path, config, options: ExportOptions,
                   progress: Callable[[str], None]) -> tuple[dict[str, GraphFile], dict]:
    """Write the artifact's one weights file on a thread while both graphs are traced on the meta
    device (exporters/weights.py: the weights are never in memory whole, and tracing needs none),
    then point the graphs at the file, optimize, grow and contract-check them."""
    p = options.precision
    dtype = torch_dtype(p.activations if p.quantized else p.weights)  # the view's: quantized weights are traced in it
    view = export_view(config, dtype)  # on the meta device
    stop = threading.Event()
    writer = Background.thread(write_weights, CheckpointReader(model_dir, config), view, tmp / WEIGHTS_FILE, dtype,
                               stop=stop, precision=options.precision)
    dims = graph_dims(config, options.precision, options.variant)
    try:
        traced = {g: trace_graph(view, g, dims, options.variant) for g in contract.GRAPHS}
        table = writer.result()
    finally:
        stop.set()  # a failed trace stops the writer at its next tensor
        writer.close()
    data_bytes = (tmp / WEIGHTS_FILE).stat().st_size
    progress(f"write {WEIGHTS_FILE} from {model_dir} ({p.describe()}, {data_bytes / 2**20:,.1f} MiB, "
             f"streamed, beside tracing): {writer.seconds:.1f} s")
    opsets, seconds = {}, {}
    for graph in contract.GRAPHS:
        path = tmp / contract.GRAPH_FILES[graph]
        seconds[graph], how = finish_graph(traced[graph], view, path, table, options.precision.block_size)
        opsets[graph] = onnx_opset(check_graph_file(path, graph, dims, CONTRIB_OPS[options.variant.target]))
        cache = f", static cache of {dims.kv_capacity}" if graph == contract.DECODE and dims.kv_capacity else ""
        fused = ", ONNX Runtime fused kernels" if options.variant.target is Target.ORT else ""
        progress(f"export {graph}{cache}{fused} ({how}): {seconds[graph]:.1f} s, contract ok")
    return {g: GraphFile(contract.GRAPH_FILES[g], sha256_file(tmp / contract.GRAPH_FILES[g]), WEIGHTS_FILE,
                         data_bytes, opsets[g], round(seconds[g], 2)) for g in contract.GRAPHS}, table


def export_artifact(model_dir: str | Path, out: str | Path, options: ExportOptions | None = None,
                    progress: Callable[[str], None] = lambda msg: None, **flags) -> Manifest:
    """Write a complete artifact to `out` and return its manifest. `options`, or the flags of
    `ExportOptions.from_flags` (dtype, opset, kv_cache, max_seq_len, target, prefill_logits,
    debug_outputs, validate, force, weights, block_size, quantize_lm_head)."""
    model_dir, out = Path(model_dir), Path(out)
    options = options or ExportOptions.from_flags(**flags)
    config = read_config(model_dir)  # a bad checkpoint fails before the filesystem is touched
    options.check(config, has_cuda_provider=_ort_has_cuda)
    tmp, created = _prepare_out(out, options.force)
    # the float32 reference needs only the checkpoint: a child process runs it while this one
    # writes and traces, and exits (its memory with it) before ONNX Runtime maps the weights
    reference = Background.process(reference_run, model_dir, config, options, env=REFERENCE_ENV) \
        if options.validate else None
    try:
        graphs, graphs_table = _export_graphs(model_dir, tmp, config, options, progress)
        lint = lint_graphs({g: onnx.load(str(tmp / contract.GRAPH_FILES[g]), load_external_data=False)
                            for g in contract.GRAPHS})
        progress(f"TensorRT lint: {'ok' if lint.ok else f'{len(lint.problems)} problem(s)'}, needs TensorRT "
                 f">= {lint.min_tensorrt}")
        copied = [f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
        for f in copied:
            shutil.copy2(model_dir / f, tmp / f)
        manifest = Manifest(config.to_dict(), options.precision, options.variant, graphs,
                            {"path": str(model_dir.resolve()), "config_sha256": sha256_file(model_dir / "config.json")},
                            dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), copied, versions(),
                            lint.to_dict())
        manifest.weights = weights_record(graphs_table, {g: tmp / contract.GRAPH_FILES[g] for g in contract.GRAPHS})
        manifest.write(tmp)
        if reference is not None:
            _validate(tmp, manifest, reference, progress)
        _move_into_place(tmp, out)
        return manifest
    except BaseException:
        shutil.rmtree(created or tmp, ignore_errors=True)
        raise
    finally:
        if reference is not None:
            reference.close()


def _validate(tmp: Path, manifest: Manifest, reference: "Background", progress: Callable[[str], None]) -> None:
    t = time.perf_counter()
    ref = reference.result()
    progress(f"reference: torch float32 on the checkpoint, in a child process beside the export: "
             f"{reference.seconds:.1f} s ({time.perf_counter() - t:.1f} s waited)")
    t = time.perf_counter()
    manifest.validation, table, where = validate(tmp, manifest, reference=ref)
    manifest.write(tmp)
    verdict = "passed" if manifest.validation["passed"] else "FAILED"
    progress(f"validate ORT vs torch float32 ({VALIDATION_STEPS} decode steps): {verdict}, "
             f"{time.perf_counter() - t:.1f} s")
    q = manifest.validation.get("quantization")
    if q is not None:
        fused = manifest.validation["fused_matmulnbits"]
        progress(f"quantized MatMuls fused into MatMulNBits: {fused['prefill']} and {fused['decode']}, all; "
                 f"quantization error vs full precision: top-1 {q['top1_mean']:.3f}, top-5 {q['top5_mean']:.3f}, "
                 f"KL {q['kl_max_mean']:.3g}" + ("" if q["within_table"] else
                                                 " -- MORE than the table expects: measure it on your text "
                                                 "with tk eval before you deploy"))
    if not manifest.validation["passed"]:
        raise CheckFailed(f"export validation failed: {where or 'ort failed its ' + manifest.dtype + ' tolerance'}",
                          table)


def onnx_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
