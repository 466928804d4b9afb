"""The parity core: run the same tokens through backends, then compare (two pure steps).

`run_trace` drives one runtime through prefill and N decode steps. The reference backend picks
its greedy tokens; every other backend is teacher-forced with those tokens, so one divergent
sample does not derail the rest. `compare_traces` turns two traces into per-step metrics
judged against one per-dtype tolerance table. `tk export` validation and `tk parity` are both
this code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from models.contract import position_ids_from_mask
from runtimes.base import Runtime
from runtimes.generate import left_pad


@dataclass(frozen=True)
class Tolerance:
    max_abs: float  # largest |logit difference| allowed at any compared position
    min_top1: float  # fraction of decided positions whose argmax must agree
    tie_margin: float  # a position whose reference top-2 logits are closer than this is a tie, not a decision


# Judged against a float32 PyTorch reference. Where each value comes from:
TOLERANCES = {
    # Optimum's runtime tests use 1e-4 on tiny fp32 models; PyTorch's own Llama logits with vs
    # without cache differ by ~1e-5 (transformers #25420). Measured here: ORT vs torch on the
    # tiny test families stays under 2e-5. A flip needs a margin under 2 * max_abs: that is a tie.
    "float32": Tolerance(max_abs=1e-4, min_top1=1.0, tie_margin=2e-4),
    # ORT's llama_parity.py bounds fp16 logits at 0.5. PyTorch's own cache/no-cache gap is 0.0195
    # in fp16 (transformers #25420), so margins under 0.02 are ties. Measured here: 0.003-0.015.
    "float16": Tolerance(max_abs=0.5, min_top1=0.95, tie_margin=0.02),
    # bf16 has 8 bits of mantissa: PyTorch's own cache/no-cache gap is 0.125 (transformers #25420).
    "bfloat16": Tolerance(max_abs=1.0, min_top1=0.9, tie_margin=0.125),
}


@dataclass
class Trace:
    backend: str
    tokens: np.ndarray  # (B, steps) int64: the tokens fed to the decode steps
    logits: list[np.ndarray] = field(default_factory=list)  # [prefill (B,S,V), step 1 (B,1,V), ...]


@dataclass
class StepResult:
    step: int  # 0 = prefill
    max_abs: float
    max_rel: float  # max_abs / max |reference logit|
    top1: float  # fraction of compared positions whose argmax agrees (reference near-ties count as agreeing)
    passed: bool


@dataclass
class Comparison:
    backend: str
    reference: str
    case: str
    steps: list[StepResult]

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.steps)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "reference": self.reference, "case": self.case,
                "passed": self.passed, "steps": [asdict(s) for s in self.steps]}


def run_trace(runtime: Runtime, ids: np.ndarray, mask: np.ndarray, steps: int,
              forced: np.ndarray | None = None) -> Trace:
    """Prefill then `steps` decode steps; greedy tokens unless `forced` (B, steps) is given."""
    logits, cache = runtime.prefill(ids, mask, position_ids_from_mask(mask))
    trace = Trace(runtime.name, np.zeros((ids.shape[0], steps), dtype=np.int64), [logits])
    for k in range(steps):
        token = forced[:, k] if forced is not None else logits[:, -1].argmax(-1)
        trace.tokens[:, k] = token
        mask = np.concatenate([mask, np.ones((ids.shape[0], 1), dtype=np.int64)], axis=1)
        logits, cache = runtime.decode(token[:, None].astype(np.int64), mask,
                                       mask.sum(-1, keepdims=True) - 1, cache)
        trace.logits.append(logits)
    return trace


def compare_logits(ref: np.ndarray, test: np.ndarray, keep: np.ndarray, tol: Tolerance, step: int) -> StepResult:
    """Metrics over the positions where `keep` (B, S) is true."""
    r, t = ref[keep], test[keep]  # (N, V)
    if not r.size:
        return StepResult(step, 0.0, 0.0, 1.0, True)
    max_abs = float(np.abs(r.astype(np.float64) - t).max())
    top2 = -np.partition(-r, 1, axis=-1)[:, :2]  # (N, 2): best and second-best reference logits
    decided = (top2[:, 0] - top2[:, 1]) >= tol.tie_margin
    agree = r.argmax(-1) == t.argmax(-1)
    top1 = float((agree | ~decided).mean())  # a near-tie may go either way without counting against
    finite = bool(np.isfinite(t).all())
    return StepResult(step, max_abs, max_abs / max(float(np.abs(r).max()), 1e-12), top1,
                      finite and max_abs <= tol.max_abs and top1 >= tol.min_top1)


def compare_traces(ref: Trace, test: Trace, mask: np.ndarray, tol: Tolerance, case: str) -> Comparison:
    steps = [compare_logits(ref.logits[0], test.logits[0], mask.astype(bool), tol, 0)]
    every = np.ones((mask.shape[0], 1), dtype=bool)
    steps += [compare_logits(r, t, every, tol, k) for k, (r, t) in enumerate(zip(ref.logits[1:], test.logits[1:]), 1)]
    return Comparison(test.backend, ref.backend, case, steps)


def random_cases(vocab_size: int, seed: int = 0, lengths: tuple[tuple[int, ...], ...] = ((7,), (5, 9, 12))):
    """Named (input_ids, attention_mask) cases: batch 1, and a left-padded batch of different lengths."""
    rng = np.random.default_rng(seed)
    cases = {}
    for lens in lengths:
        prompts = [rng.integers(0, vocab_size, n).tolist() for n in lens]
        cases[f"batch{len(lens)}-len{'/'.join(map(str, lens))}"] = left_pad(prompts)
    return cases


def run_parity(reference: Runtime, others: list[Runtime], tolerance: Tolerance, steps: int = 8,
               seed: int = 0) -> list[Comparison]:
    """Run every case through the reference (greedy), teacher-force the others, compare."""
    results = []
    for case, (ids, mask) in random_cases(reference.dims.vocab_size, seed).items():
        ref = run_trace(reference, ids, mask, steps)
        for rt in others:
            results.append(compare_traces(ref, run_trace(rt, ids, mask, steps, forced=ref.tokens), mask,
                                          tolerance, case))
    return results


def format_table(results: list[Comparison]) -> str:
    lines = [f"{'backend':8} {'case':22} {'step':>4} {'max_abs':>10} {'max_rel':>10} {'top1':>6}  result"]
    for c in results:
        for s in c.steps:
            lines.append(f"{c.backend:8} {c.case:22} {s.step:>4} {s.max_abs:10.3g} {s.max_rel:10.3g} "
                         f"{s.top1:6.2f}  {'ok' if s.passed else 'FAIL'}")
    return "\n".join(lines)
