"""The generation loop, written once for every backend.

Left-pads a batch of prompts, derives position ids from the mask, runs prefill then one decode
step per token, samples with the shared `Sampler`, and finishes each row on EOS, a stop
condition or the token budget. It knows nothing about tokenization (stop strings arrive as a
callable) and nothing about which backend runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from models.contract import position_ids_from_mask
from runtimes.base import InputError, Runtime
from runtimes.sampling import Sampler, SamplingConfig


@dataclass
class RowResult:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "eos" | "stop" | "length"


@dataclass
class GenerationResult:
    rows: list[RowResult]
    ttft_s: float  # prefill + first token
    decode_s: list[float]  # one entry per decode step

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * float(np.mean(self.decode_s)) if self.decode_s else float("nan")

    @property
    def tokens_per_s(self) -> float:
        total = self.ttft_s + sum(self.decode_s)
        return sum(len(r.tokens) for r in self.rows) / total if total else float("nan")

    def timings(self) -> dict:
        return {"ttft_ms": 1e3 * self.ttft_s, "decode_ms_per_token": self.decode_ms_per_token,
                "tokens_per_s": self.tokens_per_s, "decode_steps": len(self.decode_s)}


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """-> (input_ids, attention_mask), both (B, max_len) int64, padding on the left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("empty prompt: give at least one token per prompt")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask


class DecodeFeed:
    """The attention mask and position ids of a left-padded batch being decoded: each step adds
    one real position. The mask lives in a buffer with room for more, so growing it is a view,
    and the positions are counted up in place: no array is built per step (this runs between
    two decode steps, when the caches are cold and every numpy call costs ~10 us)."""

    def __init__(self, mask: np.ndarray, room: int = 64):
        B, T = mask.shape
        self.buffer = np.ones((B, T + max(room, 1)), dtype=np.int64)
        self.buffer[:, :T] = mask
        self.length = T
        self.positions = mask.sum(-1, keepdims=True) - 1  # (B, 1): the last token's, a real one

    def grow(self) -> tuple[np.ndarray, np.ndarray]:
        """One more real position -> (mask (B, T + 1), position ids (B, 1))."""
        if self.length == self.buffer.shape[1]:
            self.buffer = np.concatenate([self.buffer, np.ones_like(self.buffer)], axis=1)
        self.length += 1
        self.positions += 1
        return self.buffer[:, : self.length], self.positions


def decode_step(runtime: Runtime, tokens: np.ndarray, feed: DecodeFeed, cache):
    """Feed one token per row at the next position of `feed`. Returns (logits (B, 1, V), cache)."""
    mask, positions = feed.grow()
    return runtime.decode(np.asarray(tokens, dtype=np.int64).reshape(-1, 1), mask, positions, cache)


def generate(
    runtime: Runtime,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    stop: Callable[[int, list[int]], bool] | None = None,
    on_token: Callable[[int, int], None] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt.

    `stop(row, tokens)` is asked after each new token of a row (stop strings live there);
    `on_token(row, token)` is told each token as it arrives (streaming).
    """
    if max_new_tokens <= 0:
        raise InputError(f"max new tokens must be positive, got {max_new_tokens}")
    ids, mask = left_pad(prompts)
    longest = ids.shape[1]
    if longest + max_new_tokens > runtime.max_context:
        raise InputError(f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the model's "
                         f"context of {runtime.max_context}; shorten the prompt or lower --max-new-tokens")
    B, V = ids.shape[0], runtime.dims.vocab_size
    sampler = Sampler(sampling)
    seen = None
    if sampling.repetition_penalty != 1.0:
        seen = np.zeros((B, V), dtype=bool)
        rows, cols = np.nonzero(mask)
        seen[rows, ids[rows, cols]] = True
    eos = set() if ignore_eos else set(eos_ids)
    results = [RowResult(prompt_tokens=len(p)) for p in prompts]
    active = list(range(B))  # rows still generating; plain Python: B is small and this runs every step
    feed = DecodeFeed(mask, room=max_new_tokens)

    start = time.perf_counter()
    logits, cache = runtime.prefill(ids, mask, position_ids_from_mask(mask))
    token = sampler(logits[:, -1], seen)
    ttft = time.perf_counter() - start
    decode_s: list[float] = []
    for step in range(max_new_tokens):
        tokens = token.tolist()
        for b in list(active):
            t, row = tokens[b], results[b]
            if t in eos:
                row.finish_reason = "eos"
                active.remove(b)
                continue
            row.tokens.append(t)
            if seen is not None:
                seen[b, t] = True
            if on_token is not None:
                on_token(b, t)
            if stop is not None and stop(b, row.tokens):
                row.finish_reason = "stop"
                active.remove(b)
        if not active or step == max_new_tokens - 1:
            break
        tick = time.perf_counter()
        logits, cache = decode_step(runtime, token, feed, cache)
        token = sampler(logits[:, -1], seen)
        decode_s.append(time.perf_counter() - tick)
    return GenerationResult(results, ttft, decode_s)
