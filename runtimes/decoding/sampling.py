"""Next-token selection, shared by every backend: greedy, temperature, top-k, top-p, repetition
penalty, seeded. Pure numpy on float32 logits, so two backends whose logits agree pick the same
tokens for the same seed.

Whatever the logits, a draw stays among the tokens they allow: a non-finite logit (a processor's,
the model's, or a penalty or temperature that overflowed) is made safe at the row before drawing
(NaN: impossible; where a row has +inf, only its +inf tokens, alike), and a row where no token is
possible (every logit -inf: a grammar, a ban) draws `NO_TOKEN`, which ends it (rows.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from tk.models.spec.errors import UsageProblem


GREEDY_BELOW = 1e-5
NO_TOKEN = -1  # what a row draws when no token is possible


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off (Hugging Face semantics: divide positive logits, multiply negative)
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:
            raise UsageProblem(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise UsageProblem(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageProblem(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise UsageProblem(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if self.seed < 0:
            raise UsageProblem(f"seed must be >= 0, got {self.seed}")

    def for_row(self, row: int) -> "SamplingConfig":
        """The sampling of row `row` of a batch (or choice `row` of a request): row 0 draws from `seed`
        itself, row j > 0 from a stream of its own derived from (seed, j), so a row's draws are its solo
        run's whatever shares its steps."""
        if not row:
            return self
        seed = int(np.random.SeedSequence([self.seed, row]).generate_state(1, np.uint64)[0]) >> 1
        return dataclasses.replace(self, seed=seed)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that dividing by it overflows float32 (vLLM's 1e-5)."""
        return self.temperature < GREEDY_BELOW


def finite(logits: np.ndarray) -> np.ndarray:
    """(B, V) float32 logits with no NaN or +inf, allowing no token they did not: NaN becomes -inf
    (impossible), and a row with +inf keeps only those tokens, alike (0, the rest -inf: the limit of
    logits growing without bound). Finite logits come back as they are (the same array)."""
    if np.isfinite(logits).all():
        return logits
    logits = np.where(np.isnan(logits), np.float32(-np.inf), logits)
    top = np.isposinf(logits)
    return np.where(top.any(-1, keepdims=True), np.where(top, np.float32(0), np.float32(-np.inf)), logits)


class Sampler:
    def __init__(self, config: SamplingConfig):
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def scaled(self, logits: np.ndarray, seen: np.ndarray | None = None, rows: list[int] | None = None) -> np.ndarray:
        """(B, V) logits with the repetition penalty and temperature applied, made finite(): what
        greedy takes the argmax of and what `probs` turns into the distribution drawn from."""
        c = self.config
        logits = logits.astype(np.float32, copy=False)  # nothing below writes in place
        if seen is not None and rows is not None and len(rows) != seen.shape[0]:
            seen = seen[rows]
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # what overflows is made finite() below
            if c.repetition_penalty != 1.0 and seen is not None:
                penalized = np.where(logits > 0, logits / c.repetition_penalty, logits * c.repetition_penalty)
                logits = np.where(seen, penalized, logits)
            return finite(logits if c.greedy else logits / c.temperature)

    def probs(self, scaled: np.ndarray) -> np.ndarray:
        """`scaled` logits (B, V) -> the distribution a draw takes (top-k and top-p applied), float32;
        a row where no token is possible is all 0."""
        c = self.config
        none = scaled.max(-1) == -np.inf
        logits = np.where(none[:, None], np.float32(0), scaled) if none.any() else scaled
        if c.top_k:
            kth = -np.sort(-logits, axis=-1)[:, min(c.top_k, logits.shape[-1]) - 1 : min(c.top_k, logits.shape[-1])]
            logits = np.where(logits < kth, -np.inf, logits)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        if c.top_p < 1.0:
            order = np.argsort(-probs, axis=-1, kind="stable")
            sorted_p = np.take_along_axis(probs, order, -1)
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            drop_sorted = (np.cumsum(sorted_p, -1) - sorted_p) >= c.top_p
            drop_sorted[:, 0] = False  # a top_p below float32's least (5e-324 is 0 there) keeps it too
            drop = np.zeros_like(drop_sorted)
            np.put_along_axis(drop, order, drop_sorted, -1)
            probs = np.where(drop, 0.0, probs)
            probs /= probs.sum(-1, keepdims=True)
        return np.where(none[:, None], np.float32(0), probs) if none.any() else probs

    @staticmethod
    def greedy_pick(scaled: np.ndarray) -> np.ndarray:
        """The argmax of each row of `scaled` logits (B,), NO_TOKEN where no token is possible."""
        ids = scaled.argmax(-1)
        return np.where(scaled[np.arange(len(ids)), ids] == -np.inf, NO_TOKEN, ids).astype(np.int64, copy=False)

    @staticmethod
    def draw(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
        """One token per row of `probs` (B, V) for uniforms `u` (B,) in [0, 1): the first token whose
        cumulative mass reaches u's share of the row's total; NO_TOKEN for a row of no mass."""
        cdf = np.cumsum(probs, -1)
        # below the total that float32 summed, above 0: the first token whose cdf reaches u has mass
        v = np.maximum(u * cdf[:, -1], np.finfo(np.float32).tiny)
        return np.where(cdf[:, -1] <= 0, NO_TOKEN, (cdf < v[:, None]).sum(-1)).astype(np.int64)

    def __call__(self, logits: np.ndarray, seen: np.ndarray | None = None, rows: list[int] | None = None,
                 total: int | None = None) -> np.ndarray:
        """logits (B, V) float32 -> ids (B,) int64. seen (total, V) bool: tokens already in each row.

        `rows` name the batch's rows among `total` (rows that finished have left the batch): each
        step draws one number for every row of the `total`, so a row's draws do not depend on
        which other rows are still generating. A row where no token is possible draws NO_TOKEN."""
        scaled = self.scaled(logits, seen, rows)
        if self.config.greedy:
            return self.greedy_pick(scaled)
        probs = self.probs(scaled)
        u = self.rng.random(probs.shape[0]) if total is None or rows is None else self.rng.random(total)[rows]
        return self.draw(probs, u)
