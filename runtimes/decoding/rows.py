"""One row's rules, written once: what a request may ask, what ends it, and what it has seen.

`RowPolicy` is used by both `Generation` (runtimes/decoding/generate.py: `tk generate`, parity, the
benchmarks) and the batcher (runtimes/serving/batching.py: `tk serve`, Triton), so that a served request
finishes exactly as its solo run does by construction, not by test alone:

- `RowPolicy.check(prompt_tokens, max_new_tokens, max_context)` refuses an empty prompt, a budget
  below one token, and a prompt plus budget beyond the context;
- `add(token)` takes a sampled token: EOS (unless ignore_eos) ends the row and is not kept, as does
  the sampler's `NO_TOKEN` (no token was possible: a stop); a kept token is marked seen (the
  repetition penalty's tokens: the prompt's and the row's own);
- once the consumer has heard the kept token, `finished()` ends the row on a stop (asked for
  through `stop()`, or by the stop hook) or at the token budget.

`FinishReason` is the one set of names for how a row ends; `TokenEvent` is what a consumer hears.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

import numpy as np

from tk.runtimes.errors import InputError
from tk.runtimes.decoding.logits import TokenLogprob
from tk.runtimes.decoding.sampling import NO_TOKEN, SamplingConfig


class FinishReason(str, Enum):
    """How a row (a request) ended. A `str`: it compares, hashes, prints and serializes as its value."""

    EOS = "eos"  # the model's end-of-sequence token (not kept)
    STOP = "stop"  # a stop its consumer asked for (a stop string), or no token was possible (NO_TOKEN)
    LENGTH = "length"  # its token budget
    CANCELLED = "cancelled"  # the batcher's only: the client went away, or the batcher closed
    ERROR = "error"  # the batcher's only: the request failed (its `error` says why)

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def completed(self) -> bool:
        """The row ran to an end of its own (eos, stop, length), not cancelled or failed."""
        return self in (FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH)


@dataclass(frozen=True)
class TokenEvent:
    row: int  # the prompt's index in its batch (a batcher's request is one prompt alone: 0)
    token: int | None  # the new token; None on the row's last event (EOS, which is not kept, or any finish)
    finish_reason: FinishReason | None = None  # set on a row's last event
    # the new token's, where its request asked for log-probabilities; on a finish by EOS, the EOS token's
    logprob: TokenLogprob | None = None


def seen_matrix(sampling: SamplingConfig, vocab_size: int, rows: int) -> np.ndarray | None:
    """The (rows, V) tokens-seen matrix the sampler's repetition penalty reads; None without a penalty."""
    return np.zeros((rows, vocab_size), dtype=bool) if sampling.repetition_penalty != 1.0 else None


class RowPolicy:
    """One row's end and what it has seen. `tokens` are the kept tokens (a `RowResult`'s or a
    `Request`'s list is this one); `seen` (1, V) is the row's line of a seen matrix (None: no
    repetition penalty), marked here; `stop_when(tokens)` is a stop hook asked after each kept
    token, once the consumer has heard it."""

    __slots__ = ("tokens", "max_new_tokens", "eos", "seen", "stop_when", "stopped", "finish_reason")

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
                 ignore_eos: bool = False, seen: np.ndarray | None = None,
                 stop_when: Callable[[list[int]], bool] | None = None):
        self.tokens: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset() if ignore_eos else frozenset(eos_ids)
        self.seen = seen
        if seen is not None:
            seen[0, list(prompt)] = True
        self.stop_when = stop_when
        self.stopped = False
        self.finish_reason: FinishReason | None = None

    @staticmethod
    def check(prompt_tokens: int, max_new_tokens: int, max_context: int) -> None:
        """Refuse what no row can run (InputError, a one-line message for the CLI or a 400)."""
        if prompt_tokens <= 0:
            raise InputError("empty prompt: give at least one token per prompt")
        if max_new_tokens <= 0:
            raise InputError(f"max new tokens must be positive, got {max_new_tokens}")
        if prompt_tokens + max_new_tokens > max_context:
            raise InputError(f"a prompt of {prompt_tokens} tokens plus {max_new_tokens} new tokens exceeds the "
                             f"model's context of {max_context}; shorten the prompt or ask for fewer new tokens")

    def add(self, token: int) -> bool:
        """Take a sampled token: True if the row keeps it, False if it is EOS or NO_TOKEN (the row has ended)."""
        if token == NO_TOKEN:  # whatever ignore_eos says: nothing may follow
            self.finish_reason = FinishReason.STOP
            return False
        if token in self.eos:
            self.finish_reason = FinishReason.EOS
            return False
        self.tokens.append(token)
        if self.seen is not None:
            self.seen[0, token] = True
        return True

    def stop(self) -> None:
        """End the row after the token its consumer is hearing."""
        self.stopped = True

    def finished(self) -> FinishReason | None:
        """After the kept token was heard: STOP if a stop was asked for, LENGTH at the budget, else
        None (the row goes on)."""
        if self.stopped or (self.stop_when is not None and self.stop_when(self.tokens)):
            self.finish_reason = FinishReason.STOP
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason


def left_pad(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """-> (input_ids, attention_mask), both (B, max_len) int64, padding (id 0, mask 0) on the left."""
    if not prompts:
        raise InputError("no prompts: give at least one")
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask
