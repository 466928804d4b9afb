"""What a request does with a row's logits besides sampling, written once for every backend:
log-probabilities of the tokens (the ones it was given and the ones it chose), and the
processors that change the logits before its sampler draws (OpenAI's `logit_bias`, presence and
frequency penalties, vLLM's `min_tokens`; a grammar's token mask comes from the serving front end
in the same shape). Pure numpy on float32 logits.

Log-probabilities are the model's own (vLLM's default, `raw_logprobs`): a log-softmax of the raw
logits, before any processor, penalty or temperature, so a token's log-probability does not depend
on how it was sampled and equals what `transformers` computes from the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

# A request's processor: (logits (1, V) float32, the tokens it kept so far) -> logits (1, V), a new
# array: its input stays as it was (the raw logits give the log-probabilities). It runs on the
# batcher's thread, before sampling.
Processor = Callable[[np.ndarray, Sequence[int]], np.ndarray]
ROWS_AT_ONCE = 64  # prompt positions per log-softmax (a long prompt's (T, V) float32 would double)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, and the `top` most likely tokens at its position (id, logprob),
    most likely first (empty when none were asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(n, V) -> (n, V) float32 log-probabilities."""
    x = logits.astype(np.float32, copy=False)
    peak = x.max(-1, keepdims=True)
    return x - (peak + np.log(np.exp(x - peak).sum(-1, keepdims=True)))


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """Each row of `logits` (n, V) scored at its token of `tokens` (n,), with its `top` alternatives."""
    out = []
    for start in range(0, len(tokens), ROWS_AT_ONCE):
        lp = log_softmax(logits[start:start + ROWS_AT_ONCE])
        for row, token in zip(lp, tokens[start:start + ROWS_AT_ONCE]):
            best = ()
            if top > 0:
                k = min(top, row.shape[0])
                ids = np.argpartition(-row, k - 1)[:k]
                ids = ids[np.lexsort((ids, -row[ids]))]  # most likely first, ties by id
                best = tuple((int(i), float(row[i])) for i in ids)
            out.append(TokenLogprob(int(token), float(row[token]), best))
    return out


def logit_bias(bias: dict[int, float], vocab_size: int) -> Processor:
    """OpenAI's `logit_bias`: a fixed amount added to some tokens' logits (-100 bans, 100 forces)."""
    add = np.zeros((1, vocab_size), dtype=np.float32)
    for token, value in bias.items():
        add[0, token] = value
    return lambda logits, tokens: logits + add


def min_tokens(count: int, eos_ids: Sequence[int]) -> Processor:
    """vLLM's `min_tokens`: no end-of-sequence token before `count` tokens were kept."""
    eos = list(eos_ids)

    def mask(logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        if len(tokens) >= count or not eos:
            return logits
        logits = logits.copy()
        logits[:, eos] = -np.inf
        return logits
    return mask


class Penalties:
    """OpenAI's presence and frequency penalties over the tokens the request generated (as vLLM
    applies them): logit - presence * [count > 0] - frequency * count."""

    def __init__(self, presence: float, frequency: float, vocab_size: int):
        self.presence, self.frequency = presence, frequency
        self.counts = np.zeros((1, vocab_size), dtype=np.float32)
        self.counted = 0

    def __call__(self, logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        for token in tokens[self.counted:]:
            self.counts[0, token] += 1
        self.counted = len(tokens)
        penalty = self.presence * (self.counts > 0) + self.frequency * self.counts
        return logits - penalty.astype(np.float32)
