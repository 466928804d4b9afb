"""Probes for the failure modes architecture diagrams hide, run on any backend against itself.

Each probe feeds a backend two inputs that must give the same logits at the positions that
matter, and reports the largest difference:
- future_leak: perturbing later tokens must not move earlier logits (causal mask);
- padding_leak: changing the content under left padding must not move real rows;
- position_drift: the same text at a different cache offset (more left padding) must not move;
- cache_vs_recompute: prefill of N tokens equals prefill of N-k then k decode steps;
- finite: no NaN or Inf in any logit or cache tensor.

A backend whose prefill returns the last position's logits only (tk export --prefill-logits last)
is compared on the positions it returns, and on its cache, which covers every position.

A probe's difference is judged like every other: against the tolerance's bound for the size of
the values compared (tk's tolerances scale with the model), and never tighter than
`probe_noise` times what the reference backend itself gets on the same probe: a deep float32
model's cache-vs-recompute gap is rounding, and PyTorch has it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tk.models.spec.contract import KV
from tk.runtimes.base import Runtime
from tk.runtimes.decoding.generate import left_pad
from tk.toolkit.verify.tolerance import Tolerance


@dataclass
class ProbeResult:
    name: str
    passed: bool
    max_abs: float
    bound: float  # what the probe allowed: the tolerance at the values' size, or the reference's own noise
    detail: str


class Diff:
    """The largest |a - b| over a probe's comparisons, and the largest |a| they covered."""

    def __init__(self):
        self.max_abs, self.scale = 0.0, 0.0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        if a.size:
            self.max_abs = max(self.max_abs, float(np.nan_to_num(np.abs(a - b), nan=np.inf).max()))
            self.scale = max(self.scale, float(np.abs(a).max()))


def _prefill(rt: Runtime, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """-> (logits (B, S or 1, V), the cache as arrays (B, H, S, D))."""
    out, session = rt.start(ids, mask)
    with session:
        return out.logits, rt.cache_arrays(session)


def _cache_diff(diff: Diff, rt: Runtime, a: list[np.ndarray], b: list[np.ndarray], row: int, positions: slice,
                states: bool = True) -> None:
    """The row's keys and values at `positions`; with `states`, its recurrent layers' states whole (they are
    what the row's every token made of them: compared only where every token is the same)."""
    for x, y, (_, kind) in zip(a, b, rt.dims.cache_kinds()):
        if kind == KV:
            diff.add(x[row, :, positions], y[row, :, positions])
        elif states:
            diff.add(x[row], y[row])


def _result(name: str, diff: Diff, tol: Tolerance, reference: ProbeResult | None, detail: str) -> ProbeResult:
    bound = float(tol.bound(diff.scale))
    if reference is not None:
        bound = max(bound, tol.probe_noise * reference.max_abs)
    return ProbeResult(name, bool(np.isfinite(diff.max_abs) and diff.max_abs <= bound), diff.max_abs, bound, detail)


def future_leak(rt: Runtime, rng: np.random.Generator, tol: Tolerance, ref: ProbeResult | None, n: int = 12,
                t: int = 6) -> ProbeResult:
    ids = rng.integers(0, rt.dims.vocab_size, (1, n))
    other = ids.copy()
    other[0, t:] = (ids[0, t:] + 1 + rng.integers(0, rt.dims.vocab_size - 1, n - t)) % rt.dims.vocab_size
    mask = np.ones_like(ids)
    (a, cache_a), (b, cache_b) = _prefill(rt, ids, mask), _prefill(rt, other, mask)
    first = n - a.shape[1]  # the first position whose logits the backend returns
    diff = Diff()
    _cache_diff(diff, rt, cache_a, cache_b, 0, slice(0, t), states=False)
    if first < t:
        diff.add(a[0, : t - first], b[0, : t - first])
    logits = f"logits at positions {first}..{t - 1} and " if first < t else ""
    return _result("future_leak", diff, tol, ref,
                   f"tokens {t}..{n - 1} changed; {logits}the cache at 0..{t - 1} compared")


def padding_leak(rt: Runtime, rng: np.random.Generator, tol: Tolerance, ref: ProbeResult | None, pad: int = 5,
                 n: int = 8) -> ProbeResult:
    ids, mask = left_pad([rng.integers(0, rt.dims.vocab_size, n + pad).tolist(),
                          rng.integers(0, rt.dims.vocab_size, n).tolist()])
    other = ids.copy()
    other[1, :pad] = rng.integers(0, rt.dims.vocab_size, pad)
    (a, cache_a), (b, cache_b) = _prefill(rt, ids, mask), _prefill(rt, other, mask)
    real = min(n, a.shape[1])  # the row's real tokens are its last n
    diff = Diff()
    diff.add(a[1, -real:], b[1, -real:])
    _cache_diff(diff, rt, cache_a, cache_b, 1, slice(pad, None))
    return _result("padding_leak", diff, tol, ref,
                   f"content under {pad} padding tokens changed; the real tokens of the row compared")


def position_drift(rt: Runtime, rng: np.random.Generator, tol: Tolerance, ref: ProbeResult | None, n: int = 8,
                   offset: int = 7, steps: int = 3) -> ProbeResult:
    prompt = rng.integers(0, rt.dims.vocab_size, n).tolist()
    alone_ids, alone_mask = left_pad([prompt])
    ids, mask = left_pad([prompt, rng.integers(0, rt.dims.vocab_size, n + offset).tolist()])
    alone = _prefill(rt, alone_ids, alone_mask)[0][0]
    diff = Diff()
    diff.add(alone, _prefill(rt, ids, mask)[0][0, -len(alone):])  # the same text, its last positions
    tokens = rng.integers(0, rt.dims.vocab_size, steps)
    (_, a), (_, b) = rt.start(alone_ids, alone_mask, steps), rt.start(ids, mask, steps)
    with a, b:
        for k in range(steps):
            diff.add(rt.step(a, tokens[k : k + 1]).logits[0], rt.step(b, tokens[[k, k]]).logits[0])
    return _result("position_drift", diff, tol, ref,
                   f"the same {n} tokens at cache offset 0 and {offset}, prefill and {steps} decode steps")


def cache_vs_recompute(rt: Runtime, rng: np.random.Generator, tol: Tolerance, ref: ProbeResult | None, n: int = 12,
                       k: int = 4) -> ProbeResult:
    ids = rng.integers(0, rt.dims.vocab_size, (1, n))
    full, full_cache = _prefill(rt, ids, np.ones_like(ids))
    first = n - full.shape[1]  # the first position whose logits the full prefill returns
    out, session = rt.start(ids[:, : n - k], np.ones((1, n - k), dtype=np.int64), k)
    with session:
        positions = range(n - k - out.logits.shape[1], n - k)  # those the short prefill returns
        diff = Diff()
        for i, p in enumerate(positions):
            if p >= first:
                diff.add(full[0, p - first], out.logits[0, i])
        for t in range(n - k, n):
            logits = rt.step(session, ids[:, t]).logits
            if t >= first:
                diff.add(full[0, t - first], logits[0, 0])
        _cache_diff(diff, rt, full_cache, rt.cache_arrays(session), 0, slice(None))
    return _result("cache_vs_recompute", diff, tol, ref,
                   f"prefill {n} vs prefill {n - k} + {k} decode steps, logits and cache")


def finite(rt: Runtime, rng: np.random.Generator, tol: Tolerance, ref: ProbeResult | None, steps: int = 4
           ) -> ProbeResult:
    ids, mask = left_pad([rng.integers(0, rt.dims.vocab_size, 9).tolist(),
                          rng.integers(0, rt.dims.vocab_size, 4).tolist()])
    out, session = rt.start(ids, mask, steps)
    with session:
        logits = out.logits
        bad = [] if np.isfinite(logits).all() else ["prefill logits"]
        for k in range(steps):
            logits = rt.step(session, logits[:, -1].argmax(-1)).logits
            if not np.isfinite(logits).all():
                bad.append(f"step {k + 1} logits")
        if not all(np.isfinite(a).all() for a in rt.cache_arrays(session)):
            bad.append("cache")
    return ProbeResult("finite", not bad, 0.0, 0.0, "NaN/Inf in " + ", ".join(bad) if bad else "all finite")


PROBES = (future_leak, padding_leak, position_drift, cache_vs_recompute, finite)


def run_probes(rt: Runtime, tol: Tolerance, seed: int = 0, reference: list[ProbeResult] | None = None
               ) -> list[ProbeResult]:
    """Every probe on `rt`; with `reference` (the reference backend's own results, same seed),
    a backend is allowed the reference's noise on each probe."""
    refs = reference or [None] * len(PROBES)
    return [probe(rt, np.random.default_rng([seed, i]), tol, ref) for i, (probe, ref) in enumerate(zip(PROBES, refs))]
