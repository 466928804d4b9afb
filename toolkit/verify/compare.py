"""`tk parity`: every backend against the float32 PyTorch reference, as one JSON report.

Composes the parity core (toolkit/verify/metrics.py) and the probes (toolkit/verify/probes.py). The report's
schema is `parity_report.schema.json` beside this file; it holds no timestamps or timings, so two
runs with the same seed on the same machine write the same report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tk.models.artifact import Manifest
from tk.models.errors import UsageProblem
from tk.runtimes.base import BackendUnavailable, InputError, Runtime
from tk.runtimes.generate import left_pad
from tk.toolkit.verify.metrics import (Comparison, Tolerance, Trace, compare_traces, first_divergence, format_table,
                            random_cases, run_trace, tolerance_for)
from tk.toolkit.backends import BackendOptions, open_runtime, reference_runtime
from tk.toolkit.verify.probes import ProbeResult, run_probes

SCHEMA_VERSION = 2
SCHEMA_PATH = Path(__file__).with_name("parity_report.schema.json")


def greedy_match(ref_tokens: np.ndarray, free_tokens: np.ndarray) -> list[int]:
    """Per row, how many greedy tokens a freely generating backend shares with the reference."""
    same = ref_tokens == free_tokens
    return [int(row.argmin()) if not row.all() else int(row.size) for row in same]


@dataclass
class ReferenceRun:
    """What the reference computed: its greedy traces per case and its own probe results."""

    backend: str
    dtype: str
    traces: dict[str, Trace]
    probes: list[ProbeResult]


def run_reference(reference: Runtime, cases: dict, steps: int, tol: Tolerance, seed: int = 0,
                  probes: bool = True) -> ReferenceRun:
    return ReferenceRun(reference.name, reference.dims.kv_dtype,
                        {case: run_trace(reference, ids, mask, steps) for case, (ids, mask) in cases.items()},
                        run_probes(reference, tol, seed) if probes else [])


def compare_backends(reference: Runtime | ReferenceRun, backends: dict[str, Runtime | str], cases: dict,
                     tol: Tolerance, steps: int, seed: int = 0, probes: bool = True, free_running: bool = True) -> dict:
    """Run, then compare. `backends` maps a name to a runtime, or to the reason it was skipped.

    The one parity engine: `tk parity` runs it whole; export validation runs it without the
    probes and the free-running pass (probes=False, free_running=False), and from a `ReferenceRun`
    made before ONNX Runtime loads, so the reference's weights and ORT's are never in memory at once."""
    if not isinstance(reference, ReferenceRun):
        reference = run_reference(reference, cases, steps, tol, seed, probes)
    ref_probes = reference.probes
    report = {"reference": {"backend": reference.backend, "dtype": reference.dtype,
                            "probes": [p.to_dict() for p in ref_probes]},
              "backends": {}}
    traces = reference.traces
    for name, rt in backends.items():
        if isinstance(rt, str):
            report["backends"][name] = {"status": "skipped", "reason": rt}
            continue
        entry: dict = {"status": "passed", "reason": None, "dtype": rt.dims.kv_dtype, "cases": [],
                       "first_divergence": None}
        for case, (ids, mask) in cases.items():
            ref = traces[case]
            forced = run_trace(rt, ids, mask, steps, forced=ref.tokens)
            cmp = compare_traces(ref, forced, mask, tol, case)
            match = None
            if free_running:
                match = greedy_match(ref.tokens, run_trace(rt, ids, mask, steps, keep_present=False).tokens)
            div = first_divergence(ref, forced, mask, tol)
            div = None if div is None else {"case": case, **div}
            entry["cases"].append({**cmp.to_dict(), "greedy_match": match, "first_divergence": div})
            if div is not None and entry["first_divergence"] is None:
                entry["first_divergence"] = div
        entry["probes"] = [p.to_dict() for p in (run_probes(rt, tol, seed, ref_probes) if probes else [])]
        ok = all(c["passed"] for c in entry["cases"]) and all(p["passed"] for p in entry["probes"])
        entry["status"] = "passed" if ok else "failed"
        report["backends"][name] = entry
    report["passed"] = (all(p["passed"] for p in report["reference"]["probes"])
                        and all(b["status"] != "failed" for b in report["backends"].values()))
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


def parity(artifact: Path, backends: list[str], steps: int = 16, seed: int = 0, prompts_file: Path | None = None,
           overrides: dict | None = None, options: BackendOptions = BackendOptions()) -> dict:
    """The whole `tk parity` run on an artifact; backends that cannot load are reported as skipped."""
    if steps < 1:
        raise UsageProblem(f"--steps must be at least 1, got {steps}")
    manifest = Manifest.read(artifact)
    manifest_dtype = manifest.dtype
    tol = tolerance_for(manifest_dtype, manifest.config, **(overrides or {}))
    if manifest.precision.quantized:  # judged against the quantized reference: ORT multiplies in float too
        options = dataclasses.replace(options, quant_compute="float")
    with contextlib.ExitStack() as active:  # every loaded runtime is closed, whatever happens
        # hidden states, where others have them
        ref = active.enter_context(reference_runtime(artifact, manifest, debug=True))
        runtimes: dict[str, Runtime | str] = {}
        for name in backends:
            try:
                runtimes[name] = active.enter_context(open_runtime(artifact, name, options))
            except BackendUnavailable as e:  # not installed here, or (trt) no engines built yet
                runtimes[name] = str(e)
        cases = artifact_cases(artifact, prompts_file, ref.dims.vocab_size, seed)
        report = compare_backends(ref, runtimes, cases, tol, steps, seed)
    return {"schema_version": SCHEMA_VERSION, "artifact": str(artifact), "dtype": manifest_dtype, "steps": steps,
            "seed": seed, "tolerance": dataclasses.asdict(tol), **report}


def summary(report: dict) -> str:
    """A readable table of every step, then one line per backend and probe failures."""
    comparisons = [Comparison.from_dict(c) for e in report["backends"].values() for c in e.get("cases", [])]
    lines = [format_table(comparisons), ""]
    for probe in report["reference"]["probes"]:
        if not probe["passed"]:
            lines.append(f"reference probe {probe['name']} FAILED: max_abs {probe['max_abs']:.3g} > bound "
                         f"{probe['bound']:.3g} ({probe['detail']})")
    for name, e in report["backends"].items():
        if e["status"] == "skipped":
            lines.append(f"{name}: skipped: {e['reason']}")
            continue
        match = [m for c in e["cases"] for m in c["greedy_match"] or []]
        free = f"; free-running greedy match {min(match)}..{max(match)} of {report['steps']} tokens" if match else ""
        lines.append(f"{name}: {e['status']}{free}")
        for probe in e["probes"]:
            lines.append(f"  probe {probe['name']:20} {'ok' if probe['passed'] else 'FAIL'}  max_abs "
                         f"{probe['max_abs']:.3g}  bound {probe['bound']:.3g}  ({probe['detail']})")
        if e["first_divergence"]:
            lines.append("  " + describe_divergence(name, e["first_divergence"]))
    return "\n".join(lines)


def verdict(report: dict, required: tuple[str, ...] = ()) -> str | None:
    """Why the run fails the gate (tk parity exits 3 with this line), or None when it passes."""
    failed = [b for b, e in report["backends"].items() if e["status"] == "failed"]
    if failed:
        d = report["backends"][failed[0]]["first_divergence"]
        failing = [p["name"] for p in report["backends"][failed[0]]["probes"] if not p["passed"]]
        return "parity failed: " + (describe_divergence(failed[0], d) if d else
                                    f"{failed[0]} failed the probe(s) {', '.join(failing)}")
    if not report["passed"]:
        return "parity failed: the reference backend failed a probe"
    skipped = [b for b in required if report["backends"].get(b, {}).get("status", "skipped") == "skipped"]
    if skipped:
        return f"parity failed: required backend {', '.join(skipped)} was skipped"
    return None


def describe_divergence(backend: str, d: dict) -> str:
    where = (f"{d['where']} (layer {d['layer']})" if d["where"] != "logits"
             else f"the logits after every cache tensor agreed (layer {d['layer']}, final norm or head)")
    size = (f"max_abs {d['max_abs']:.3g} > bound {d['bound']:.3g}" if d["max_abs"] > d["bound"] else
            f"max_abs {d['max_abs']:.3g} within its bound, but top-1, top-5 or KL out of tolerance")
    return (f"{backend} first leaves its tolerance at step {d['step']}, row {d['row']}, position {d['position']}, "
            f"in {where} of case {d['case']}: {size}")


def write_junit(report: dict, path: Path, required: tuple[str, ...] = ()) -> None:
    """The gate in the format CI systems show: one test case per backend x case and per probe
    (reference probes included); a failure's message is the line that locates it."""
    import xml.etree.ElementTree as ET

    suite = ET.Element("testsuite", name="tk parity")

    def case(classname: str, name: str, failure: str | None = None, skipped: str | None = None, text: str = ""):
        tc = ET.SubElement(suite, "testcase", classname=classname, name=name)
        if failure is not None:
            ET.SubElement(tc, "failure", message=failure).text = text or failure
        elif skipped is not None:
            ET.SubElement(tc, "skipped", message=skipped)

    def probe_case(owner: str, p: dict) -> None:
        failure = None if p["passed"] else (f"{owner} failed the probe {p['name']}: max_abs {p['max_abs']:.3g} > "
                                            f"bound {p['bound']:.3g} ({p['detail']})")
        case(f"tk.parity.{owner}.probes", p["name"], failure)

    for p in report["reference"]["probes"]:
        probe_case("reference", p)
    for name, e in report["backends"].items():
        if e["status"] == "skipped":
            reason = f"{name} was skipped: {e['reason']}"
            case(f"tk.parity.{name}", "backend", *((reason, None) if name in required else (None, reason)))
            continue
        for c in e["cases"]:
            failure = None
            if not c["passed"]:
                failed = [s for s in c["steps"] if not s["passed"]]
                failure = (describe_divergence(name, c["first_divergence"]) if c["first_divergence"] else
                           f"{name} failed a token-level gate at step {failed[0]['step']}: top1 {failed[0]['top1']:.2f}"
                           f", top5 {failed[0]['top5']:.2f}, kl {failed[0]['kl_max']:.3g}")
            case(f"tk.parity.{name}", c["case"], failure, text=format_table([Comparison.from_dict(c)]))
        for p in e["probes"]:
            probe_case(name, p)
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(tc.find("failure") is not None for tc in cases)))
    suite.set("skipped", str(sum(tc.find("skipped") is not None for tc in cases)))
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def plot(report: dict, path: Path) -> None:
    """Max |logit difference| per step and backend, log scale (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, e in report["backends"].items():
        for c in e.get("cases", []):
            ax.semilogy([s["step"] for s in c["steps"]], [max(s["error_ratio"], 1e-12) for s in c["steps"]],
                        marker="o", label=f"{name} {c['case']}")
    ax.axhline(1.0, color="red", linestyle="--", label="tolerance")
    ax.set_xlabel("step (0 = prefill)")
    ax.set_ylabel("max |logit difference| / its bound, vs torch fp32")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
