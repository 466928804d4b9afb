"""Export validation: ORT on a freshly written artifact against the float32 PyTorch reference,
through the parity engine (tk.toolkit.verify.compare) without its probes. The reference runs
need only the checkpoint, so `tk export` makes them in a child process beside tracing
(`reference_run`); `run_validation` judges the artifact in its temporary folder and raises
`CheckFailed` (exit 3) naming the step and layer where ORT first left its tolerance.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from tk.models.spec.contract import GraphDims
from tk.models.spec.manifest import Manifest, ValidationRecord

from tk.models.spec.options import ExportOptions
from tk.models.spec.errors import CheckFailed
from tk.toolkit.backends import reference_runtime, torch_reference
from tk.toolkit.pipeline.background import Background
from tk.toolkit.progress import Progress
from tk.toolkit.verify.compare import ParityReport, ReferenceRun, compare_backends, run_reference
from tk.toolkit.verify.head_rounding import HeadRounding
from tk.toolkit.verify.metrics import random_cases
from tk.toolkit.verify.tolerance import tolerance_for
from tk.toolkit.verify.report import case_dict, describe_divergence, divergence_dict, format_table

VALIDATION_STEPS = 8


def validate(artifact: Path, manifest: Manifest, steps: int = VALIDATION_STEPS,
             reference: tuple[ReferenceRun, ReferenceRun | None] | None = None) -> tuple[ValidationRecord, str, str | None]:
    """Export validation: ORT on the artifact vs the float32 PyTorch reference, through the parity
    engine without its probes. A quantized artifact is judged against the quantized reference with
    the same float tolerances, ORT multiplying in float ("float" compute); its fused MatMuls and its
    quantization error (toolkit/verify/quant.py) are checked after. `reference`: the runs of
    `reference_run` when made already (export makes them beside tracing). Returns the manifest
    record, a printable table, and what failed first (None when all passed)."""
    from tk.runtimes.backends.ort import OrtRuntime

    tol = tolerance_for(manifest.dtype, manifest.config)
    cases = random_cases(manifest.dims.vocab_size)
    if reference is None:
        reference = _reference_runs(lambda quantized: reference_runtime(
            artifact, manifest, debug=manifest.variant.debug_outputs, quantized=quantized), manifest.precision,
            cases, steps, tol)
    graphs_ref, full_ref = reference
    # Where the decode graph also prefills, prompts may run through either graph: ORT runs them through
    # decode.onnx for the fused export and for standard graphs that pad their queries, TensorRT and
    # prefill_via="prefill" through prefill.onnx ("ort/pre" in the table); another portable export's ORT
    # runs prefill.onnx, and serving continues prompts through decode.onnx ("ort/dec"). Both ways are judged.
    other = ("ort/pre", "prefill") if manifest.variant.prefills_through_decode else ("ort/dec", "decode")
    # (a hybrid has one graph, decode.onnx, which prefills every prompt: one way)
    runs = {"ort": None, **(dict([other]) if manifest.variant.decode_prefills and not manifest.dims.stateful else {})}
    reports: list[ParityReport] = []
    head = HeadRounding.of(artifact, manifest)
    for label, prefill_via in runs.items():  # one runtime, so one mapping of the weights, at a time
        with OrtRuntime(artifact, swap_sessions=True, quant_compute="float", prefill_via=prefill_via) as ort:
            reports.append(compare_backends(graphs_ref, {label: ort}, cases, tol, steps, probes=False,
                                            free_running=False, head=head))
    passed = all(r.passed for r in reports)
    judged = [b for r in reports for b in r.backends.values()]
    failing = next((b for b in judged if b.first_divergence is not None), None)
    first = failing.first_divergence if failing else None
    where = describe_divergence(failing.name, first) if failing else None
    cases_run = [c for b in judged for c in b.cases]
    quantized = manifest.precision.quantized
    record = ValidationRecord(passed=passed, reference="torch float32" + (", quantized weights" if quantized else ""),
                              steps=steps, tolerance=dataclasses.asdict(tol),
                              comparisons=[case_dict(c) for c in cases_run], first_divergence=divergence_dict(first))
    table = format_table([c.comparison for c in cases_run])
    if quantized and passed:
        from tk.toolkit.verify.quant import check_fused, quantization_error

        record.fused_matmulnbits = check_fused(artifact, manifest)
        record.quantization, q_table = quantization_error(artifact, manifest, full_ref, cases, steps)
        table += "\n" + q_table
    return record, table, where


def _reference_runs(open_reference, precision, cases, steps, tol) -> tuple[ReferenceRun, ReferenceRun | None]:
    """(the run the graphs must match, the full-precision run when the weights are quantized)."""
    runs = []
    for quantized in ([True, False] if precision.quantized else [False]):
        with open_reference(quantized) as ref:  # unloaded before the next, and before ORT loads
            runs.append(run_reference(ref, cases, steps, tol, probes=False))
    return runs[0], runs[1] if len(runs) > 1 else None


def reference_run(model_dir: Path, config, options: ExportOptions, calibration=None,
                  steps: int = VALIDATION_STEPS) -> tuple[ReferenceRun, ReferenceRun | None]:
    """What validation compares ORT with: the float32 reference decoder of the checkpoint on the
    validation cases (a debug export localizes to the layer outputs; quantized weights: also the
    quantized reference, with its `calibration`). Needs no artifact, so export runs
    it in a child process while it writes and traces."""
    dims = GraphDims.of(config, options.precision, options.variant)
    tol = tolerance_for(options.precision.activations, config)
    p = options.precision
    return _reference_runs(lambda quantized: torch_reference(
        model_dir, dims, config.max_position_embeddings, debug=options.variant.debug_outputs,
        quantized=p if quantized else None, calibration=calibration), p, random_cases(dims.vocab_size), steps, tol)


def run_validation(tmp: Path, manifest: Manifest, reference: "Background",
                   progress: Progress | Callable[[str], None]) -> None:
    Progress.of(progress).step("validate")
    t = time.perf_counter()
    ref = reference.result()
    progress(f"reference: torch float32 on the checkpoint, in a child process beside the export: "
             f"{reference.seconds:.1f} s ({time.perf_counter() - t:.1f} s waited)")
    t = time.perf_counter()
    manifest.validation, table, where = validate(tmp, manifest, reference=ref)
    manifest.write(tmp)
    v = manifest.validation
    verdict = "passed" if v.passed else "FAILED"
    progress(f"validate ORT vs torch float32 ({VALIDATION_STEPS} decode steps): {verdict}, "
             f"{time.perf_counter() - t:.1f} s")
    q = v.quantization
    if q is not None:
        fused = v.fused_matmulnbits
        progress(f"quantized MatMuls fused into MatMulNBits: {' and '.join(map(str, fused.values()))}, all; "
                 f"quantization error vs full precision: top-1 {q['top1_mean']:.3f}, top-5 {q['top5_mean']:.3f}, "
                 f"KL {q['kl_max_mean']:.3g}" + ("" if q["within_table"] else
                                                 " -- MORE than the table expects: measure it on your text "
                                                 "with tk eval before you deploy"))
    if not v.passed:
        raise CheckFailed(f"export validation failed: {where or 'ort failed its ' + manifest.dtype + ' tolerance'}",
                          table)
