"""What a parity report looks like: the text table, the verdict line, the JSON `tk parity --report`
writes (its schema is `parity_report.schema.json` beside this file), JUnit XML and a plot.

The engine (toolkit/verify/compare.py) makes a typed `ParityReport`; this module only reads it.
Dicts exist here only, where JSON is written (the report, and the cases export validation records
in manifest.json). The JSON holds no timestamps or timings, so two runs with the same seed on the
same machine write the same report.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from tk.toolkit.verify.compare import BackendReport, CaseReport, ParityReport
from tk.toolkit.verify.metrics import Comparison, Divergence, StepResult
from tk.toolkit.verify.probes import ProbeResult

SCHEMA_VERSION = 2
SCHEMA_PATH = Path(__file__).with_name("parity_report.schema.json")


def status(backend: BackendReport) -> str:
    return "skipped" if backend.skipped is not None else "passed" if backend.passed else "failed"


def to_dict(report: ParityReport) -> dict:
    """The report as `tk parity --report` writes it."""
    ref = report.reference
    return {"schema_version": SCHEMA_VERSION, "artifact": str(report.artifact), "dtype": report.dtype,
            "steps": report.steps, "seed": report.seed, "tolerance": asdict(report.tolerance),
            "reference": {"backend": ref.name, "dtype": ref.dtype, "probes": [asdict(p) for p in ref.probes]},
            "backends": {name: backend_dict(b) for name, b in report.backends.items()},
            "passed": report.passed}


def backend_dict(b: BackendReport) -> dict:
    if b.skipped is not None:
        return {"status": "skipped", "reason": b.skipped}
    return {"status": status(b), "reason": None, "dtype": b.dtype, "cases": [case_dict(c) for c in b.cases],
            "first_divergence": divergence_dict(b.first_divergence), "probes": [asdict(p) for p in b.probes]}


def case_dict(c: CaseReport) -> dict:
    cmp = c.comparison
    return {"backend": cmp.backend, "reference": cmp.reference, "case": cmp.case, "passed": cmp.passed,
            "steps": [step_dict(s) for s in cmp.steps], "greedy_match": c.greedy_match,
            "first_divergence": divergence_dict(cmp.first_divergence)}


def step_dict(s: StepResult) -> dict:
    """A judged step as one flat record: the gate's figures among the metrics, as the schema has them."""
    m = s.metrics
    return {"step": m.step, "max_abs": m.max_abs, "mean_abs": m.mean_abs, "max_rel": m.max_rel,
            "error_ratio": s.error_ratio, "cosine_min": m.cosine_min, "top1": s.top1, "top5": m.top5,
            "kl_max": m.kl_max, "kl_ratio": s.kl_ratio, "present_max_abs": list(s.present_max_abs),
            "present_ratio": s.present_ratio, "passed": s.passed, "head_flips": s.head_flips}


def divergence_dict(d: Divergence | None) -> dict | None:
    return None if d is None else asdict(d)


def format_table(results: list[Comparison]) -> str:
    """One row per backend and case: the worst of each metric over its steps, and which steps failed.
    err/bound and kv/bound are the largest logit and cache differences over their bounds (<= 1 passes);
    a W8A8 head's input roundings that went the other way are counted in the result, and err/bound is
    what is left without them."""
    lines = [f"{'backend':8} {'case':20} {'steps':>5} {'max_abs':>9} {'mean_abs':>9} {'max_rel':>9} {'err/bound':>9} "
             f"{'cos_min':>9} {'top1':>5} {'top5':>5} {'kl_max':>8} {'kv_abs':>9} {'kv/bound':>8}  result"]
    for c in results:
        s, m = c.steps, [x.metrics for x in c.steps]
        kv = max((max(x.present_max_abs) for x in s if x.present_max_abs), default=float("nan"))
        failed = [x.metrics.step for x in s if not x.passed]
        verdict = "ok" if not failed else "FAIL at step " + ",".join(map(str, failed[:8])) + (
            "..." if len(failed) > 8 else "")
        if flips := sum(x.head_flips for x in s):
            verdict += f" ({flips} head-input rounding flip{'s' if flips > 1 else ''})"
        lines.append(f"{c.backend:8} {c.case:20} {len(s):>5} {max(x.max_abs for x in m):9.3g} "
                     f"{max(x.mean_abs for x in m):9.3g} {max(x.max_rel for x in m):9.3g} "
                     f"{max(x.error_ratio for x in s):9.3g} {min(x.cosine_min for x in m):9.6f} "
                     f"{min(x.top1 for x in s):5.2f} {min(x.top5 for x in m):5.2f} {max(x.kl_max for x in m):8.2g} "
                     f"{kv:9.3g} {max(x.present_ratio for x in s):8.3g}  {verdict}")
    return "\n".join(lines)


def summary(report: ParityReport) -> str:
    """A readable table of every step, then one line per backend and probe failures."""
    lines = [format_table([c.comparison for b in report.backends.values() for c in b.cases]), ""]
    for probe in report.reference.probes:
        if not probe.passed:
            lines.append(f"reference probe {probe.name} FAILED: max_abs {probe.max_abs:.3g} > bound "
                         f"{probe.bound:.3g} ({probe.detail})")
    for name, b in report.backends.items():
        if b.skipped is not None:
            lines.append(f"{name}: skipped: {b.skipped}")
            continue
        match = [m for c in b.cases for m in c.greedy_match or []]
        free = f"; free-running greedy match {min(match)}..{max(match)} of {report.steps} tokens" if match else ""
        lines.append(f"{name}: {status(b)}{free}")
        for probe in b.probes:
            lines.append(f"  probe {probe.name:20} {'ok' if probe.passed else 'FAIL'}  max_abs "
                         f"{probe.max_abs:.3g}  bound {probe.bound:.3g}  ({probe.detail})")
        if b.first_divergence is not None:
            lines.append("  " + describe_divergence(name, b.first_divergence))
    return "\n".join(lines)


def verdict(report: ParityReport, required: tuple[str, ...] = ()) -> str | None:
    """Why the run fails the gate (tk parity exits 3 with this line), or None when it passes."""
    failed = [name for name, b in report.backends.items() if b.failed]
    if failed:
        b = report.backends[failed[0]]
        failing = [p.name for p in b.probes if not p.passed]
        return "parity failed: " + (describe_divergence(failed[0], b.first_divergence) if b.first_divergence else
                                    f"{failed[0]} failed the probe(s) {', '.join(failing)}")
    if not report.passed:
        return "parity failed: the reference backend failed a probe"
    skipped = [name for name in required if name not in report.backends or report.backends[name].skipped is not None]
    if skipped:
        return f"parity failed: required backend {', '.join(skipped)} was skipped"
    return None


def describe_divergence(backend: str, d: Divergence) -> str:
    where = (f"{d.where} (layer {d.layer})" if d.where != "logits"
             else f"the logits after every cache tensor agreed (layer {d.layer}, final norm or head)")
    size = (f"max_abs {d.max_abs:.3g} > bound {d.bound:.3g}" if d.max_abs > d.bound else
            f"max_abs {d.max_abs:.3g} within its bound, but top-1, top-5 or KL out of tolerance")
    return (f"{backend} first leaves its tolerance at step {d.step}, row {d.row}, position {d.position}, "
            f"in {where} of case {d.case}: {size}")


def write_junit(report: ParityReport, path: Path, required: tuple[str, ...] = ()) -> None:
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

    def probe_case(owner: str, p: ProbeResult) -> None:
        failure = None if p.passed else (f"{owner} failed the probe {p.name}: max_abs {p.max_abs:.3g} > "
                                         f"bound {p.bound:.3g} ({p.detail})")
        case(f"tk.parity.{owner}.probes", p.name, failure)

    for p in report.reference.probes:
        probe_case("reference", p)
    for name, b in report.backends.items():
        if b.skipped is not None:
            reason = f"{name} was skipped: {b.skipped}"
            case(f"tk.parity.{name}", "backend", *((reason, None) if name in required else (None, reason)))
            continue
        for c in b.cases:
            cmp, failure = c.comparison, None
            if not cmp.passed:
                s = next(s for s in cmp.steps if not s.passed)
                failure = (describe_divergence(name, cmp.first_divergence) if cmp.first_divergence else
                           f"{name} failed a token-level gate at step {s.metrics.step}: top1 {s.top1:.2f}, top5 "
                           f"{s.metrics.top5:.2f}, kl {s.metrics.kl_max:.3g}")
            case(f"tk.parity.{name}", cmp.case, failure, text=format_table([cmp]))
        for p in b.probes:
            probe_case(name, p)
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(tc.find("failure") is not None for tc in cases)))
    suite.set("skipped", str(sum(tc.find("skipped") is not None for tc in cases)))
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def plot(report: ParityReport, path: Path) -> None:
    """Max |logit difference| per step and backend, log scale (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, b in report.backends.items():
        for c in b.cases:
            steps = c.comparison.steps
            ax.semilogy([s.metrics.step for s in steps], [max(s.error_ratio, 1e-12) for s in steps],
                        marker="o", label=f"{name} {c.comparison.case}")
    ax.axhline(1.0, color="red", linestyle="--", label="tolerance")
    ax.set_xlabel("step (0 = prefill)")
    ax.set_ylabel("max |logit difference| / its bound, vs torch fp32")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
