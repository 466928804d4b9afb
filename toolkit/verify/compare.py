"""`tk parity`'s engine: every backend against the float32 PyTorch reference, as one typed report.

Composes the parity core (toolkit/verify/metrics.py) and the probes (toolkit/verify/probes.py) into
a `ParityReport`: per backend, either the reason it was skipped or its cases and probes. Whether
something passed is decided by the leaves (a step's gate, a probe) and aggregated here, by the
`passed` properties; nothing else decides it. The report's text, JSON (schema'd), JUnit and plot
are toolkit/verify/report.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tk.models.spec.manifest import Manifest
from tk.models.spec.errors import UsageProblem
from tk.runtimes.backends.torch import resolve_device
from tk.runtimes.base import BackendUnavailable, InputError, Runtime
from tk.runtimes.decoding.generate import left_pad
from tk.toolkit.backends import BackendOptions, open_runtime, reference_runtime
from tk.toolkit.verify.head_rounding import HeadRounding, record_head_inputs
from tk.toolkit.verify.metrics import Comparison, Divergence, Trace, compare_traces, random_cases, run_trace
from tk.toolkit.verify.probes import ProbeResult, run_probes
from tk.toolkit.verify.tolerance import Tolerance, tolerance_for


def greedy_match(ref_tokens: np.ndarray, free_tokens: np.ndarray) -> list[int]:
    """Per row, how many greedy tokens a freely generating backend shares with the reference."""
    same = ref_tokens == free_tokens
    return [int(row.argmin()) if not row.all() else int(row.size) for row in same]


@dataclass
class CaseReport:
    """One backend on one case: the teacher-forced comparison (its steps and first divergence), and
    how many greedy tokens the free-running backend shared with the reference (None: not run)."""

    comparison: Comparison
    greedy_match: list[int] | None = None


@dataclass
class BackendReport:
    """One backend: skipped (and why), or its cases and probes. The reference is one too, with
    probes only."""

    name: str
    dtype: str | None = None  # of its KV cache
    cases: list[CaseReport] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    skipped: str | None = None  # why it did not run (not installed, no engines built); None: it ran

    @property
    def passed(self) -> bool:
        return (self.skipped is None and all(c.comparison.passed for c in self.cases)
                and all(p.passed for p in self.probes))

    @property
    def failed(self) -> bool:
        """Ran and did not pass (a skipped backend neither passed nor failed)."""
        return self.skipped is None and not self.passed

    @property
    def first_divergence(self) -> Divergence | None:
        """The first divergence of its first case that has one."""
        return next((c.comparison.first_divergence for c in self.cases if c.comparison.first_divergence), None)


@dataclass
class ParityReport:
    """The reference's own probes and every backend against it. `artifact` and `dtype` are set when
    the run was on an artifact (`parity`)."""

    reference: BackendReport
    backends: dict[str, BackendReport]
    tolerance: Tolerance
    steps: int
    seed: int
    artifact: str | Path | None = None  # as given to `parity`
    dtype: str | None = None  # the artifact's

    @property
    def passed(self) -> bool:
        """Every reference probe passed and no backend failed (skipped backends do not fail)."""
        return self.reference.passed and not any(b.failed for b in self.backends.values())


@dataclass
class ReferenceRun:
    """What the reference computed: its greedy traces per case and its own probe results."""

    backend: str
    dtype: str
    traces: dict[str, Trace]
    probes: list[ProbeResult]


def run_reference(reference: Runtime, cases: dict, steps: int, tol: Tolerance, seed: int = 0,
                  probes: bool = True) -> ReferenceRun:
    """The reference's greedy trace of each case (with what a W8A8 head took in before rounding it:
    toolkit/verify/head_rounding.py) and its probes."""
    traces = {}
    for case, (ids, mask) in cases.items():
        with record_head_inputs(reference) as seen:
            traces[case] = run_trace(reference, ids, mask, steps)
        traces[case].head_inputs = seen
    return ReferenceRun(reference.name, reference.dims.kv_dtype, traces,
                        run_probes(reference, tol, seed) if probes else [])


def compare_backends(reference: Runtime | ReferenceRun, backends: dict[str, Runtime | str], cases: dict,
                     tol: Tolerance, steps: int, seed: int = 0, probes: bool = True,
                     free_running: bool = True, head: HeadRounding | None = None) -> ParityReport:
    """Run, then compare. `backends` maps a label to a runtime, or to the reason it was skipped; the
    label names the backend in the report (export validation runs ORT twice: "ort" and "ort/pre").
    `head`: the artifact's W8A8 head, whose input's roundings may go either way at a boundary.

    The one parity engine: `tk parity` runs it whole; export validation runs it without the
    probes and the free-running pass (probes=False, free_running=False), and from a `ReferenceRun`
    made before ONNX Runtime loads, so the reference's weights and ORT's are never in memory at once."""
    if not isinstance(reference, ReferenceRun):
        reference = run_reference(reference, cases, steps, tol, seed, probes)
    report = ParityReport(BackendReport(reference.backend, reference.dtype, probes=reference.probes), {}, tol,
                          steps, seed)
    for label, rt in backends.items():
        if isinstance(rt, str):
            report.backends[label] = BackendReport(label, skipped=rt)
            continue
        entry = BackendReport(label, rt.dims.kv_dtype)
        for case, (ids, mask) in cases.items():
            ref = reference.traces[case]
            forced = run_trace(rt, ids, mask, steps, forced=ref.tokens, backend=label)
            match = None
            if free_running:
                match = greedy_match(ref.tokens, run_trace(rt, ids, mask, steps, keep_present=False).tokens)
            entry.cases.append(CaseReport(compare_traces(ref, forced, mask, tol, case, head), match))
        entry.probes = run_probes(rt, tol, seed, reference.probes) if probes else []
        report.backends[label] = entry
    return report


def artifact_cases(artifact: Path, prompts_file: Path | None, vocab_size: int, seed: int) -> dict:
    """Random cases, or one left-padded batch from a prompts file (one text per line, or a JSON
    list of token-id lists)."""
    if prompts_file is None:
        return random_cases(vocab_size, seed)
    text = Path(prompts_file).read_text()
    try:
        prompts = json.loads(text)
    except json.JSONDecodeError:
        from tk.toolkit.textgen import Tokenizer

        tok = Tokenizer(artifact)
        prompts = [tok.encode(line) for line in text.splitlines() if line.strip()]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise InputError(f"{prompts_file} holds no prompts: one text per line, or a JSON list of token-id lists")
    return {f"file-batch{len(prompts)}": left_pad(prompts)}


def parity(artifact: Path, backends: list[str], *, steps: int = 16, seed: int = 0, prompts_file: Path | None = None,
           options: BackendOptions = BackendOptions(), atol: float | None = None, rtol: float | None = None,
           min_top1: float | None = None) -> ParityReport:
    """The whole `tk parity` run on an artifact; backends that cannot load are reported as skipped.
    `atol`, `rtol` and `min_top1` replace the artifact's tolerance's, where given."""
    if steps < 1:
        raise UsageProblem(f"--steps must be at least 1, got {steps}")
    manifest = Manifest.read(artifact)
    tol = tolerance_for(manifest.dtype, manifest.config, atol=atol, rtol=rtol, min_top1=min_top1)
    if manifest.precision.quantized:  # judged against the quantized reference: ORT multiplies in float too
        options = dataclasses.replace(options, quant_compute="float")
    with contextlib.ExitStack() as active:  # every loaded runtime is closed, whatever happens
        # hidden states, where others have them
        ref = active.enter_context(reference_runtime(artifact, manifest, debug=True))
        runtimes: dict[str, Runtime | str] = {}
        for name in backends:
            if name == "torch" and _torch_is_reference(manifest, options):
                runtimes[name] = ref  # the same checkpoint, dtype and device: loaded once
                continue
            try:
                runtimes[name] = active.enter_context(open_runtime(artifact, name, options))
            except BackendUnavailable as e:  # not installed here, or (trt) no engines built yet
                runtimes[name] = str(e)
        cases = artifact_cases(artifact, prompts_file, ref.dims.vocab_size, seed)
        report = compare_backends(ref, runtimes, cases, tol, steps, seed, head=HeadRounding.of(artifact, manifest))
    return dataclasses.replace(report, artifact=artifact, dtype=manifest.dtype)


def _torch_is_reference(manifest: Manifest, options: BackendOptions) -> bool:
    """Whether the torch backend would compute what `parity`'s reference computes: float32 on the
    CPU, the plain graphs' math. (The reference also returns hidden states; compared with
    themselves, they agree.)"""
    return manifest.dtype == "float32" and resolve_device(options.device) == "cpu" and not options.static_cache
