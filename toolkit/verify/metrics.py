"""The parity core: run the same tokens through backends, then compare (two pure steps).

`run_trace` drives one runtime through prefill and N decode steps and keeps, per step, the logits
and the slice of every present tensor that step wrote. The reference backend picks its greedy
tokens; every other backend is teacher-forced with those tokens, so one divergent sample does
not derail the rest. `compare_traces` turns two traces into per-step metrics judged against the
model's tolerance (toolkit/verify/tolerance.py), and localizes, from the same diffs, where a
backend first leaves it; `measure_traces` gives the metrics alone, judged by no tolerance
(quantization error). `tk export` validation and `tk parity` are both this code
(toolkit/verify/compare.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tk.models.spec.contract import KV
from tk.runtimes.base import Runtime
from tk.runtimes.decoding.generate import left_pad
from tk.toolkit.verify.tolerance import Tolerance


@dataclass
class Trace:
    backend: str
    tokens: np.ndarray  # (B, steps) int64: the tokens fed to the decode steps
    logits: list[np.ndarray] = field(default_factory=list)  # [prefill (B,S,V), step 1 (B,1,V), ...]
    present: list[list[np.ndarray]] = field(default_factory=list)  # per step, per tensor: what the step wrote
    hidden: list[list[np.ndarray]] = field(default_factory=list)  # per step, per layer (B, S, C); debug backends
    held: list[np.ndarray | None] = field(default_factory=list)  # prefill, per tensor: positions a ring holds (None: all)
    # per step (B, S, K): a W8A8 head's input before its int8 rounding (a reference: head_rounding.py)
    head_inputs: list[np.ndarray] = field(default_factory=list)
    # per present tensor, its name and (layer, kind: KV, or a recurrent state's: compared whole every step)
    names: list[str] = field(default_factory=list)
    kinds: list[tuple[int, str]] = field(default_factory=list)


@dataclass(kw_only=True)
class StepMetrics:
    """What a backend's logits differ by from the reference's at one step, before any tolerance:
    alone for changes meant to move them (quantization, toolkit/verify/quant.py), and inside every
    `StepResult`."""

    step: int  # 0 = prefill
    max_abs: float
    mean_abs: float
    max_rel: float  # max_abs / max |reference logit|
    cosine_min: float  # smallest cosine similarity between reference and backend logit vectors
    top1: float  # fraction of compared positions whose argmax agrees
    top5: float  # mean overlap of the top-5 sets, 0..1
    kl_max: float  # largest KL(softmax(reference) || softmax(backend)) over positions


@dataclass(kw_only=True)
class StepResult:
    """One step judged by a tolerance: its metrics, and what the gate reads."""

    metrics: StepMetrics
    error_ratio: float  # largest |logit difference| / its bound over positions: the gate is <= 1
    top1: float  # as metrics.top1, but the reference's near-ties count as agreeing
    kl_ratio: float  # largest KL / the KL its position's logit bound allows
    present_max_abs: list[float]  # per present tensor, contract order
    present_ratio: float  # largest |cache difference| / its layer's bound
    passed: bool  # the step's gate: logits and cache within their bounds, top-1, top-5 and KL too
    head_flips: int = 0  # roundings of a W8A8 head's input that went the other way, taken out before the gate


@dataclass
class Divergence:
    """Where a backend first leaves its tolerance (compare_traces says in which order it looks)."""

    case: str
    step: int  # 0 = prefill
    row: int
    position: int  # cache index of the token
    where: str  # present.{i}.key|value, hidden.{i} (debug exports) or logits
    layer: int
    max_abs: float
    bound: float  # what that tensor or position may differ by


@dataclass
class Comparison:
    """One backend against the reference on one case, teacher-forced: each step judged, and where
    the backend first left its tolerance (None: nowhere)."""

    backend: str
    reference: str
    case: str
    steps: list[StepResult]
    first_divergence: Divergence | None = None

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.steps)


def run_trace(runtime: Runtime, ids: np.ndarray, mask: np.ndarray, steps: int,
              forced: np.ndarray | None = None, keep_present: bool = True, backend: str | None = None) -> Trace:
    """Prefill then `steps` decode steps; greedy tokens unless `forced` (B, steps) is given. The
    trace is labelled `backend` (default: the runtime's name)."""
    out, session = runtime.start(ids, mask, room=steps)
    kinds = runtime.dims.cache_kinds()
    with session:
        trace = Trace(backend or runtime.name, np.zeros((ids.shape[0], steps), dtype=np.int64), [out.logits],
                      names=runtime.dims.present_names(), kinds=kinds)
        if keep_present:
            trace.present.append(runtime.cache_arrays(session))
            trace.held = runtime.cache_held(session)
        if out.hidden is not None:
            trace.hidden.append(out.hidden)
        for k in range(steps):
            token = forced[:, k] if forced is not None else out.logits[:, -1].argmax(-1)
            trace.tokens[:, k] = token
            out = runtime.step(session, token)
            trace.logits.append(out.logits)
            if keep_present:  # only the position this step wrote (earlier ones were compared already), a state whole
                trace.present.append([a[:, :, -1:] if kind == KV else a
                                      for a, (_, kind) in zip(runtime.cache_arrays(session), kinds)])
            if out.hidden is not None:
                trace.hidden.append(out.hidden)
    return trace


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@dataclass
class LogitMetrics:
    """Reference and backend logits at the compared positions, measured, before any tolerance."""

    ref: np.ndarray  # (N, V) float64
    test: np.ndarray  # (N, V) float64, NaN and Inf replaced by finite stand-ins
    abs_diff: np.ndarray  # (N,) largest |difference| per position (inf where the backend is not finite)
    scale: np.ndarray  # (N,) max |reference logit| per position
    kl: np.ndarray  # (N,) KL(softmax(reference) || softmax(backend)) (inf where the backend is not finite)
    agree: np.ndarray  # (N,) whether the two argmaxes agree
    mean_abs: float
    top5: float
    cosine_min: float

    @property
    def max_abs(self) -> float:
        return float(self.abs_diff.max())

    @property
    def max_rel(self) -> float:
        return self.max_abs / max(float(self.scale.max()), 1e-12)

    def at(self, step: int) -> StepMetrics:
        return StepMetrics(step=step, max_abs=self.max_abs, mean_abs=self.mean_abs, max_rel=self.max_rel,
                           cosine_min=self.cosine_min, top1=float(self.agree.mean()), top5=self.top5,
                           kl_max=float(self.kl.max()))


def measure_logits(ref: np.ndarray, test: np.ndarray, keep: np.ndarray) -> LogitMetrics:
    """The metrics over the positions where `keep` (B, S) is true."""
    r, t = ref[keep].astype(np.float64), test[keep].astype(np.float64)  # (N, V)
    finite = np.isfinite(t).all(-1)  # (N,)
    t = np.nan_to_num(t, nan=0.0, posinf=1e30, neginf=-1e30)
    d = np.abs(r - t)
    k = min(5, r.shape[-1])
    top5_r, top5_t = np.argpartition(-r, k - 1, -1)[:, :k], np.argpartition(-t, k - 1, -1)[:, :k]
    top5 = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(top5_r, top5_t)]))
    cos = (r * t).sum(-1) / np.maximum(np.linalg.norm(r, axis=-1) * np.linalg.norm(t, axis=-1), 1e-30)
    p, q = _softmax(r), _softmax(t)
    kl = (p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))).sum(-1)
    return LogitMetrics(r, t, np.where(finite, d.max(-1), np.inf), np.abs(r).max(-1), np.where(finite, kl, np.inf),
                        r.argmax(-1) == t.argmax(-1), float(d.mean()) if finite.all() else float("inf"), top5,
                        float(cos.min()))


@dataclass
class LogitDiff:
    """One step's logits judged: what each position may differ by, and the step's result."""

    abs_diff: np.ndarray  # (N,) largest |difference| per position (inf where the backend is not finite)
    bound: np.ndarray  # (N,) what each position may differ by
    passed: bool  # the logits' own gate (bound, top-1, top-5, KL), whatever the cache did
    result: StepResult


def compare_logits(ref: np.ndarray, test: np.ndarray, keep: np.ndarray, tol: Tolerance, step: int,
                   present: tuple[list[float], float] = ([], 0.0), head=None,
                   head_input: np.ndarray | None = None) -> LogitDiff:
    """Metrics over the positions where `keep` (B, S) is true, judged by `tol`; `present` is (per
    tensor max |difference|, worst ratio to its bound) of the step's cache. With a W8A8 `head`
    (toolkit/verify/head_rounding.py) and the reference's `head_input` (B, S, K), a position over its
    bound is judged with the flips of the head's input rounding that explain it taken out; the
    metrics stay what was measured."""
    m = judged = measure_logits(ref, test, keep)
    bound = tol.bound(m.scale)
    flips = 0
    if head is not None and head_input is not None and (over := m.abs_diff > bound).any():
        x = head_input[keep]
        fixed, flips = head.explain(m.ref, m.test, x, over, tol.bound(np.abs(x).max(-1)))
        if flips:
            judged = measure_logits(m.ref[None], fixed[None], np.ones((1, len(fixed)), dtype=bool))
    top2 = -np.partition(-judged.ref, 1, axis=-1)[:, :2]  # (N, 2): best and second-best reference logits
    decided = (top2[:, 0] - top2[:, 1]) >= tol.tie * bound
    top1 = float((judged.agree | ~decided).mean())  # near-ties may go either way
    ratio = float((judged.abs_diff / bound).max())
    kl_ratio = float((judged.kl / tol.max_kl(bound)).max())
    pmax, pratio = present
    logits_passed = bool(ratio <= 1.0 and kl_ratio <= 1.0 and top1 >= tol.min_top1 and judged.top5 >= tol.min_top5)
    result = StepResult(metrics=m.at(step), error_ratio=ratio, top1=top1, kl_ratio=kl_ratio, present_max_abs=pmax,
                        present_ratio=pratio, passed=bool(logits_passed and pratio <= 1.0), head_flips=flips)
    return LogitDiff(judged.abs_diff, bound, logits_passed, result)


@dataclass
class TensorCheck:
    """One cache or hidden tensor of one step: |difference| reduced to (B, S), and its bound."""

    where: str  # present.{i}.key|value (or a recurrent layer's present.{i}.conv|recurrent) or hidden.{i}
    layer: int
    diff: np.ndarray  # (B, S) largest |difference| per row and position (0 on padding)
    bound: float

    @property
    def ratio(self) -> float:
        return float(self.diff.max() / self.bound)


def _abs_diff(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    return np.abs(ref.astype(np.float64) - np.nan_to_num(test.astype(np.float64), nan=np.inf))


def tensor_checks(ref: Trace, test: Trace, step: int, keep: np.ndarray, tol: Tolerance,
                  num_layers: int) -> list[TensorCheck]:
    """The step's cache tensors and (debug backends) hidden states, in the order the model
    computes them: each layer's K/V (of its input) or recurrent state (after the step), then its
    output. Each is judged relative to the reference tensor's own magnitude at its depth; a
    recurrent state, whole, at its row's last position."""
    checks = []
    for layer in range(num_layers):
        if ref.present and test.present:
            for i in [i for i, (at, _) in enumerate(ref.kinds) if at == layer]:
                r, t = ref.present[step][i], test.present[step][i]
                if ref.kinds[i][1] != KV:  # (B, ...): per row, at the row's last position this step
                    rows = keep.any(-1)
                    last = keep.shape[1] - 1 - np.argmax(keep[:, ::-1], axis=-1)
                    d = np.zeros(keep.shape)
                    d[np.arange(len(d)), last] = np.where(rows, _abs_diff(r, t).reshape(len(r), -1).max(-1), 0.0)
                    scale = float(np.abs(r).reshape(len(r), -1).max(-1)[rows].max())
                    checks.append(TensorCheck(ref.names[i], layer, d, tol.bound(scale, layer + 1)))
                    continue
                k = keep  # (B, Hkv, S, D)
                for held in (ref.held, test.held):  # a ring no longer holds its oldest positions
                    if step == 0 and held and held[i] is not None:
                        k = k & held[i]
                d = np.where(k, _abs_diff(r, t).max(axis=(1, 3)), 0.0)
                scale = float(np.abs(r).max(axis=(1, 3))[k].max())
                checks.append(TensorCheck(ref.names[i], layer, d, tol.bound(scale, layer + 1)))
        if ref.hidden and test.hidden:
            r = ref.hidden[step][layer]  # (B, S, C)
            d = np.where(keep, _abs_diff(r, test.hidden[step][layer]).max(-1), 0.0)
            scale = float(np.abs(r).max(-1)[keep].max())
            checks.append(TensorCheck(f"hidden.{layer}", layer, d, tol.bound(scale, layer + 1)))
    return checks


def _common_positions(ref: np.ndarray, test: np.ndarray, keep: np.ndarray):
    """The logit positions both backends return: all of them, or the trailing ones where one
    backend's prefill returns the last position only (tk export --prefill-logits last; its cache
    still covers every position). -> (ref, test, keep, index of the first position kept)."""
    n = min(ref.shape[1], test.shape[1])
    return ref[:, -n:], test[:, -n:], keep[:, -n:], ref.shape[1] - n


def _step_keep(mask: np.ndarray, step: int) -> np.ndarray:
    """(B, S) positions a step compares: the prompt's real tokens at prefill, the new token after."""
    return mask.astype(bool) if step == 0 else np.ones((mask.shape[0], 1), dtype=bool)


def compare_traces(ref: Trace, test: Trace, mask: np.ndarray, tol: Tolerance, case: str, head=None) -> Comparison:
    """Every step of `test` judged against `ref`, and, from the same diffs, the first (step,
    position, layer) where `test` leaves its tolerance. `head`: the artifact's W8A8 head
    (toolkit/verify/head_rounding.py), whose input roundings `ref.head_inputs` lets it explain.

    Within a step, tensors are checked in the order the model computes them: for each layer its
    cache (present.{i}: K/V of the layer's input), then its output (hidden.{i}, when both
    backends expose hidden states: a debug export), then the logits. Without hidden states, a
    present.{i} that diverges while present.{i-1} agreed puts the fault in layer i-1's output or
    layer i's own K/V path; logits diverging after every cache agreed put it in the last layer,
    the final norm or the head.
    """
    results, first = [], None
    num_layers = tol.depth - 1
    for step, (r, t) in enumerate(zip(ref.logits, test.logits)):
        keep = _step_keep(mask, step)
        checks = tensor_checks(ref, test, step, keep, tol, num_layers)
        kv = [c for c in checks if c.where.startswith("present")]
        present = ([float(c.diff.max()) for c in kv], max((c.ratio for c in kv), default=0.0))
        r, t, logits_keep, first_kept = _common_positions(r, t, keep)
        x = ref.head_inputs[step][:, first_kept:] if len(ref.head_inputs) == len(ref.logits) else None
        logits = compare_logits(r, t, logits_keep, tol, step, present, head, x)
        results.append(logits.result)
        if first is None:
            offset = 0 if step == 0 else mask.shape[1] + step - 1  # cache index of the step's position
            first = _divergence(case, step, offset, checks, logits, logits_keep, first_kept, num_layers)
    return Comparison(test.backend, ref.backend, case, results, first)


def _divergence(case: str, step: int, offset: int, checks: list[TensorCheck], logits: LogitDiff, keep: np.ndarray,
                first_kept: int, num_layers: int) -> Divergence | None:
    """The step's first tensor out of its bound; else its logits, when they fail their own gate."""
    for c in checks:
        if c.ratio > 1.0:
            b, s = np.unravel_index(int(c.diff.argmax()), c.diff.shape)
            return Divergence(case, step, int(b), int(s) + offset, c.where, c.layer, float(c.diff.max()), c.bound)
    if logits.passed:
        return None
    worst = int(np.argmax(logits.abs_diff / logits.bound))
    b, s = np.argwhere(keep)[worst]
    return Divergence(case, step, int(b), int(s) + offset + first_kept, "logits", num_layers - 1,
                      float(logits.abs_diff[worst]), float(logits.bound[worst]))


def measure_traces(ref: Trace, test: Trace, mask: np.ndarray) -> list[StepMetrics]:
    """Each step's logits of `test` (teacher-forced with `ref`'s tokens) against `ref`'s, measured
    and not judged; the cache is not compared."""
    out = []
    for step, (r, t) in enumerate(zip(ref.logits, test.logits)):
        r, t, keep, _ = _common_positions(r, t, _step_keep(mask, step))
        out.append(measure_logits(r, t, keep).at(step))
    return out


def random_cases(vocab_size: int, seed: int = 0, lengths: tuple[tuple[int, ...], ...] = ((7,), (5, 9, 12))):
    """Named (input_ids, attention_mask) cases: batch 1, and a left-padded batch of different lengths."""
    rng = np.random.default_rng(seed)
    cases = {}
    for lens in lengths:
        prompts = [rng.integers(0, vocab_size, n).tolist() for n in lens]
        cases[f"batch{len(lens)}-len{'/'.join(map(str, lens))}"] = left_pad(prompts)
    return cases
