"""`tk export` as a library call: plan, export both graphs (a hybrid's one: contract.GraphDims.graphs),
check them, validate with the parity engine, and only then publish the folder.

Every option, and every refusal that depends on the model, is checked from config.json before a
weight is read (`ExportOptions.check`). Everything is written to a temporary folder beside OUT
(OUT's missing parents are created); any failure, an interruption included (Ctrl-C, or SIGTERM
where the CLI turns it into one), removes what this export created, so OUT either does not exist or
holds a complete, validated artifact. Progress: the steps load, trace, quantize (or weights, for
float weights: streamed beside tracing, counted by bytes and tensors), write and validate
(tk.toolkit.progress).
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
from pathlib import Path
from typing import Callable

import onnx

from tk.exporters.contract_check import check_graph_file
from tk.exporters.onnx_util import opset_of
from tk.exporters.onnx_export import CONTRIB_OPS, finish_graph, trace_graph
from tk.exporters.trt_lint import lint_graphs
from tk.exporters.weights import (WEIGHTS_FILE, export_view, plan_weights, planned_size, quant_table, weights_record,
                                  write_weights)
from tk.models.spec import contract
from tk.models.spec.contract import GraphDims
from tk.models.spec.manifest import GraphFile, Manifest, Source, sha256_file
from tk.models.spec.variant import Target
from tk.models.quant.calibration import Calibration, save as save_calibration
from tk.models.spec.options import PROFILES, ExportOptions
from tk.toolkit.folders import move_into_place
from tk.models.checkpoint.prequantized import read_prequantized
from tk.models.spec.dtypes import DTYPES
from tk.models.spec.errors import FilesystemProblem
from tk.models.checkpoint.loading import CheckpointReader, read_config, torch_dtype
from tk.toolkit.pipeline.background import Background
from tk.toolkit.pipeline.calibrate import calibrate
from tk.toolkit.pipeline.validate import reference_run, run_validation
from tk.toolkit.progress import Progress
from tk.toolkit.versions import package_version

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
REFERENCE_ENV = {"OMP_NUM_THREADS": "1"}  # the child shares the cores with tracing and the writer


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("tk", "torch", "onnx", "onnxscript", "onnxruntime", "transformers"):
        if (version := package_version(pkg)) is not None:
            out[pkg] = version
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
    move_into_place(tmp, out)


def _export_graphs(model_dir: Path, tmp: Path, config, options: ExportOptions, progress: Progress,
                   calibration: Calibration | None = None) -> tuple[dict[str, GraphFile], dict]:
    """Write the artifact's one weights file on a thread while both graphs are traced on the meta
    device (exporters/weights.py: the weights are never in memory whole, and tracing needs none),
    then point the graphs at the file, optimize, grow and contract-check them."""
    p = options.precision
    dtype = torch_dtype(p.activations if p.quantized else p.weights)  # the view's: quantized weights are traced in it
    view = export_view(config, dtype)  # on the meta device
    stop = threading.Event()
    dims = GraphDims.of(config, options.precision, options.variant)
    progress.step("trace")
    weighing = "quantize" if p.quantized else "weights"
    if p.quantized:  # before the trace patches math (models/quant/kernel.py)
        from tk.models.quant.kernel import ready
        ready()
    size, tensors = planned_size(plan_weights(view, options.precision))
    with progress.task(weighing, size, "B", tensors, "tensors") as task:  # begins now, beside tracing
        writer = Background.thread(write_weights, CheckpointReader(model_dir, config), view, tmp / WEIGHTS_FILE,
                                   dtype, stop=stop, precision=options.precision, calibration=calibration, task=task)
        try:
            traced = {g: trace_graph(view, g, dims) for g in dims.graphs}
            progress.step(weighing)
            table = writer.result()
        finally:
            stop.set()  # a failed trace stops the writer at its next tensor
            writer.close()
    progress.step("write")
    data_bytes = (tmp / WEIGHTS_FILE).stat().st_size
    progress(f"write {WEIGHTS_FILE} from {model_dir} ({p.describe()}, {data_bytes / 2**20:,.1f} MiB, "
             f"streamed, beside tracing): {writer.seconds:.1f} s")
    opsets, seconds = {}, {}
    for graph in dims.graphs:
        path = tmp / contract.GRAPH_FILES[graph]
        seconds[graph], how = finish_graph(traced[graph], view, path, table, quant_table(view, options.precision))
        opsets[graph] = opset_of(check_graph_file(path, graph, dims, CONTRIB_OPS[options.variant.target]))
        cache = f", static cache of {dims.kv_capacity}" if graph == contract.DECODE and dims.kv_capacity else ""
        fused = ", ONNX Runtime fused kernels" if options.variant.target is Target.ORT else ""
        progress(f"export {graph}{cache}{fused} ({how}): {seconds[graph]:.1f} s, contract ok")
    return {g: GraphFile(contract.GRAPH_FILES[g], sha256_file(tmp / contract.GRAPH_FILES[g]), WEIGHTS_FILE,
                         data_bytes, opsets[g], round(seconds[g], 2)) for g in dims.graphs}, table


def export_artifact(model_dir: str | Path, out: str | Path, options: ExportOptions | None = None,
                    progress: Progress | Callable[[str], None] | None = None, **flags) -> Manifest:
    """Write a complete artifact to `out` and return its manifest. `options`, or the keywords of
    `ExportOptions.from_flags` (profile, dtype, opset, kv_cache, max_seq_len, target, prefill_logits,
    debug_outputs, validate, force, weights, block_size, quantize_lm_head). `progress`: a Progress,
    or a callable that gets the notes only."""
    model_dir, out = Path(model_dir), Path(out)
    progress = Progress.of(progress)
    progress.step("load")
    options = options or ExportOptions.from_flags(**flags)
    config = read_config(model_dir)  # a bad checkpoint fails before the filesystem is touched
    prequantized = read_prequantized(model_dir)
    if prequantized is not None:  # GPTQ/AWQ: its integers, as they are
        options = options.prequantized(prequantized, model_dir.name)
    options = options.for_model(config)  # what a profile leaves to the model: capacity, block size
    options.check(config, has_cuda_provider=_ort_has_cuda)
    if options.profile is not None:
        progress(f"--for {options.profile}: {PROFILES[options.profile].why}; that is {recipe(options)}")
    calibration = None
    if options.calibration is not None:
        start = time.perf_counter()
        calibration, record = calibrate(model_dir, config, options.precision, options.calibration)
        options = dataclasses.replace(options, precision=dataclasses.replace(options.precision, calibration=record))
        progress(f"calibration: activation statistics of {len(calibration.importance)} weights on {record.tokens:,} "
                 f"tokens of {record.file}, channel scales for {record.scaled_weights} of them: "
                 f"{time.perf_counter() - start:.1f} s")
    tmp, created = _prepare_out(out, options.force)
    # the float32 reference needs only the checkpoint: a child process runs it while this one
    # writes and traces, and exits (its memory with it) before ONNX Runtime maps the weights
    reference = Background.process(reference_run, model_dir, config, options, calibration,
                                   env=REFERENCE_ENV) if options.validate else None
    try:
        if calibration is not None:
            save_calibration(tmp, calibration)
        graphs, graphs_table = _export_graphs(model_dir, tmp, config, options, progress, calibration)
        lint = lint_graphs({g: onnx.load(str(tmp / contract.GRAPH_FILES[g]), load_external_data=False)
                            for g in graphs})
        progress(f"TensorRT lint: {'ok' if lint.ok else f'{len(lint.problems)} problem(s)'}, needs TensorRT "
                 f">= {lint.min_tensorrt}")
        copied = [f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
        for f in copied:
            shutil.copy2(model_dir / f, tmp / f)
        manifest = Manifest(config=config, precision=options.precision, variant=options.variant, graphs=graphs,
                            source=Source(str(model_dir.resolve()), sha256_file(model_dir / "config.json")),
                            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                            tokenizer_files=copied, versions=versions(), trt_lint=lint.to_dict(), profile=options.profile,
                            weights=weights_record(graphs_table, {g: tmp / contract.GRAPH_FILES[g] for g in graphs}))
        manifest.write(tmp)
        if reference is not None:
            run_validation(tmp, manifest, reference, progress)
        _move_into_place(tmp, out)
        return manifest
    except BaseException:
        shutil.rmtree(created or tmp, ignore_errors=True)
        raise
    finally:
        if reference is not None:
            reference.close()


def recipe(options: ExportOptions) -> str:
    """The explicit flags that export what `options` export (a profile's, spelled out)."""
    v, p = options.variant, options.precision
    flags = [f"--target {v.target.value}", f"--kv-cache {v.cache.value}"]
    flags += [f"--max-seq-len {v.capacity}"] if v.capacity is not None else []
    flags += [f"--prefill-logits {v.prefill_logits.value}", f"--dtype {DTYPES[p.activations].short}"]
    flags += [f"--weights {p.weights} --block-size {p.block_size}"] if p.quantized else []
    return " ".join(flags)
