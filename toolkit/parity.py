"""The parity core: run the same tokens through backends, then compare (two pure steps).

`run_trace` drives one runtime through prefill and N decode steps and keeps, per step, the logits
and the slice of every present tensor that step wrote. The reference backend picks its greedy
tokens; every other backend is teacher-forced with those tokens, so one divergent sample does
not derail the rest. `compare_traces` turns two traces into per-step metrics judged against one
per-dtype tolerance table, and `first_divergence` localizes where a backend first leaves it.
`tk export` validation and `tk parity` are both this code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from models.contract import position_ids_from_mask, present_names
from runtimes.base import Runtime
from runtimes.generate import DecodeFeed, decode_step, left_pad


@dataclass(frozen=True)
class Tolerance:
    max_abs: float  # largest |logit difference| allowed at any compared position
    min_top1: float  # fraction of decided positions whose argmax must agree
    tie_margin: float  # a position whose reference top-2 logits are closer than this is a tie, not a decision
    present_abs: float  # largest |difference| allowed in any present (KV cache) tensor
    probe_abs: float  # a backend compared with itself (leak, drift, cache-vs-recompute probes)


# Judged against a float32 PyTorch reference. Where each value comes from:
TOLERANCES = {
    # Optimum's runtime tests use 1e-4 on tiny fp32 models; PyTorch's own Llama logits with vs
    # without cache differ by ~1e-5 (transformers #25420). Measured here: ORT vs torch on the
    # tiny test families stays under 2e-5 in logits and 1e-5 in the cache. A flip needs a margin
    # under 2 * max_abs: that is a tie.
    "float32": Tolerance(max_abs=1e-4, min_top1=1.0, tie_margin=2e-4, present_abs=1e-4, probe_abs=1e-4),
    # ORT's llama_parity.py bounds fp16 logits at 0.5. PyTorch's own cache/no-cache gap is 0.0195
    # in fp16 (transformers #25420), so margins under 0.02 are ties. Measured here: logits
    # 0.003-0.022, cache 0.002-0.01 (values of order 1, 11 bits of mantissa).
    "float16": Tolerance(max_abs=0.5, min_top1=0.95, tie_margin=0.02, present_abs=0.05, probe_abs=0.05),
    # bf16 has 8 bits of mantissa: PyTorch's own cache/no-cache gap is 0.125 (transformers #25420).
    "bfloat16": Tolerance(max_abs=1.0, min_top1=0.9, tie_margin=0.125, present_abs=0.25, probe_abs=0.25),
}


def tolerance_for(dtype: str, **overrides) -> Tolerance:
    return replace(TOLERANCES[dtype], **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class Trace:
    backend: str
    tokens: np.ndarray  # (B, steps) int64: the tokens fed to the decode steps
    logits: list[np.ndarray] = field(default_factory=list)  # [prefill (B,S,V), step 1 (B,1,V), ...]
    present: list[list[np.ndarray]] = field(default_factory=list)  # per step, per tensor: what the step wrote
    hidden: list[list[np.ndarray]] = field(default_factory=list)  # per step, per layer (B, S, C); debug backends


@dataclass
class StepResult:
    step: int  # 0 = prefill
    max_abs: float
    max_rel: float  # max_abs / max |reference logit|
    cosine_min: float  # smallest cosine similarity between reference and backend logit vectors
    top1: float  # fraction of compared positions whose argmax agrees (reference near-ties count as agreeing)
    top5: float  # mean overlap of the top-5 sets, 0..1
    kl_max: float  # largest KL(softmax(reference) || softmax(backend)) over positions
    present_max_abs: list[float]  # per present tensor, contract order
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
              forced: np.ndarray | None = None, keep_present: bool = True) -> Trace:
    """Prefill then `steps` decode steps; greedy tokens unless `forced` (B, steps) is given."""
    logits, cache = runtime.prefill(ids, mask, position_ids_from_mask(mask))
    feed = DecodeFeed(mask, room=steps)
    trace = Trace(runtime.name, np.zeros((ids.shape[0], steps), dtype=np.int64), [logits])
    if keep_present:
        trace.present.append(runtime.cache_arrays(cache))
    if runtime.hidden is not None:
        trace.hidden.append(runtime.hidden)
    for k in range(steps):
        token = forced[:, k] if forced is not None else logits[:, -1].argmax(-1)
        trace.tokens[:, k] = token
        logits, cache = decode_step(runtime, token, feed, cache)
        trace.logits.append(logits)
        if keep_present:  # only the position this step wrote; earlier ones were compared already
            trace.present.append([a[:, :, -1:] for a in runtime.cache_arrays(cache)])
        if runtime.hidden is not None:
            trace.hidden.append(runtime.hidden)
    return trace


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def compare_logits(ref: np.ndarray, test: np.ndarray, keep: np.ndarray, tol: Tolerance, step: int,
                   present_max_abs: list[float] | None = None) -> StepResult:
    """Metrics over the positions where `keep` (B, S) is true."""
    present_max_abs = present_max_abs or []
    r, t = ref[keep].astype(np.float64), test[keep].astype(np.float64)  # (N, V)
    finite = bool(np.isfinite(t).all())
    t = np.nan_to_num(t, nan=0.0, posinf=1e30, neginf=-1e30)
    max_abs = float(np.abs(r - t).max()) if finite else float("inf")
    top2 = -np.partition(-r, 1, axis=-1)[:, :2]  # (N, 2): best and second-best reference logits
    decided = (top2[:, 0] - top2[:, 1]) >= tol.tie_margin
    top1 = float(((r.argmax(-1) == t.argmax(-1)) | ~decided).mean())  # near-ties may go either way
    k = min(5, r.shape[-1])
    top5_r, top5_t = np.argpartition(-r, k - 1, -1)[:, :k], np.argpartition(-t, k - 1, -1)[:, :k]
    top5 = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(top5_r, top5_t)]))
    cos = (r * t).sum(-1) / np.maximum(np.linalg.norm(r, axis=-1) * np.linalg.norm(t, axis=-1), 1e-30)
    p, q = _softmax(r), _softmax(t)
    kl = (p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))).sum(-1)
    passed = (finite and max_abs <= tol.max_abs and top1 >= tol.min_top1
              and all(d <= tol.present_abs for d in present_max_abs))
    return StepResult(step, max_abs, max_abs / max(float(np.abs(r).max()), 1e-12), float(cos.min()), top1, top5,
                      float(kl.max()), present_max_abs, passed)


def _present_diffs(ref: list[np.ndarray], test: list[np.ndarray], rows_keep: np.ndarray) -> list[np.ndarray]:
    """|ref - test| per present tensor, (B, Hkv, S, D) with padding positions zeroed."""
    out = []
    for r, t in zip(ref, test):
        d = np.abs(r.astype(np.float64) - np.nan_to_num(t.astype(np.float64), nan=np.inf))
        out.append(np.where(rows_keep[:, None, :, None], d, 0.0))
    return out


def _common_positions(ref: np.ndarray, test: np.ndarray, keep: np.ndarray):
    """The logit positions both backends return: all of them, or the trailing ones where one
    backend's prefill returns the last position only (tk export --prefill-logits last; its cache
    still covers every position). -> (ref, test, keep, index of the first position kept)."""
    n = min(ref.shape[1], test.shape[1])
    return ref[:, -n:], test[:, -n:], keep[:, -n:], ref.shape[1] - n


def compare_traces(ref: Trace, test: Trace, mask: np.ndarray, tol: Tolerance, case: str) -> Comparison:
    results = []
    for step, (r, t) in enumerate(zip(ref.logits, test.logits)):
        keep = mask.astype(bool) if step == 0 else np.ones((mask.shape[0], 1), dtype=bool)
        pmax = None
        if ref.present and test.present:
            pmax = [float(d.max()) for d in _present_diffs(ref.present[step], test.present[step], keep)]
        r, t, logits_keep, _ = _common_positions(r, t, keep)
        results.append(compare_logits(r, t, logits_keep, tol, step, pmax))
    return Comparison(test.backend, ref.backend, case, results)


def first_divergence(ref: Trace, test: Trace, mask: np.ndarray, tol: Tolerance, num_layers: int) -> dict | None:
    """The first (step, position, layer) where `test` leaves its tolerance, or None.

    Within a step, tensors are checked in the order the model computes them: for each layer its
    cache (present.{i}: K/V of the layer's input), then its output (hidden.{i}, when both
    backends expose hidden states: a debug export), then the logits. Without hidden states, a
    present.{i} that diverges while present.{i-1} agreed puts the fault in layer i-1's output or
    layer i's own K/V path; logits diverging after every cache agreed put it in the last layer,
    the final norm or the head.
    """
    names = present_names(num_layers)
    for step, (r, t) in enumerate(zip(ref.logits, test.logits)):
        keep = mask.astype(bool) if step == 0 else np.ones((mask.shape[0], 1), dtype=bool)
        offset = 0 if step == 0 else mask.shape[1] + step - 1  # cache index of the step's position
        checks = []  # (where, layer, |diff| reduced to (B, S))
        kv = _present_diffs(ref.present[step], test.present[step], keep) if ref.present and test.present else []
        hidden = ref.hidden and test.hidden
        for layer in range(num_layers):
            for i in (2 * layer, 2 * layer + 1):
                if kv:
                    checks.append((names[i], layer, kv[i].max(axis=(1, 3)), tol.present_abs))
            if hidden:
                d = np.abs(ref.hidden[step][layer].astype(np.float64) - np.nan_to_num(test.hidden[step][layer], nan=np.inf))
                checks.append((f"hidden.{layer}", layer, np.where(keep, d.max(-1), 0.0), tol.present_abs))
        for where, layer, d, limit in checks:
            if d.max() > limit:
                b, s = np.unravel_index(int(d.argmax()), d.shape)
                return {"step": step, "row": int(b), "position": int(s) + offset, "where": where, "layer": layer,
                        "max_abs": float(d.max())}
        r, t, keep, first = _common_positions(r, t, keep)
        if not compare_logits(r, t, keep, tol, step).passed:
            diff = np.where(keep, np.abs(r - np.nan_to_num(t, nan=np.inf)).max(-1), 0.0)
            b, s = np.unravel_index(int(diff.argmax()), diff.shape)
            return {"step": step, "row": int(b), "position": int(s) + offset + first, "where": "logits",
                    "layer": num_layers - 1, "max_abs": float(diff.max())}
    return None


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
    """One row per backend and case: the worst of each metric over its steps, and which steps failed."""
    lines = [f"{'backend':8} {'case':20} {'steps':>5} {'max_abs':>9} {'max_rel':>9} {'cos_min':>9} {'top1':>5} "
             f"{'top5':>5} {'kl_max':>8} {'kv_abs':>9}  result"]
    for c in results:
        s = c.steps
        kv = max((max(x.present_max_abs) for x in s if x.present_max_abs), default=float("nan"))
        failed = [x.step for x in s if not x.passed]
        verdict = "ok" if not failed else "FAIL at step " + ",".join(map(str, failed[:8])) + (
            "..." if len(failed) > 8 else "")
        lines.append(f"{c.backend:8} {c.case:20} {len(s):>5} {max(x.max_abs for x in s):9.3g} "
                     f"{max(x.max_rel for x in s):9.3g} {min(x.cosine_min for x in s):9.6f} "
                     f"{min(x.top1 for x in s):5.2f} {min(x.top5 for x in s):5.2f} {max(x.kl_max for x in s):8.2g} "
                     f"{kv:9.3g}  {verdict}")
    return "\n".join(lines)
