"""The generation loop, written once for every backend, as a stream of token events.

`Generation` left-pads a batch of prompts, starts a session on the runtime, samples with the
shared `Sampler`, and yields one `TokenEvent` per new token (and one when a row finishes). Each
row's end is its `RowPolicy` (runtimes/decoding/rows.py, the batcher's too): EOS, the token budget, or a
stop its consumer asks for with `stop(row)` (stop strings live with the text, in
toolkit/textgen.py); a finished row leaves the session at once, so it is no longer computed.
`generate()` collects the events. It knows nothing about tokenization and nothing about which
backend runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from tk.runtimes.base import InputError, Runtime
from tk.runtimes.decoding.rows import FinishReason, RowPolicy, TokenEvent, seen_matrix
from tk.runtimes.decoding.sampling import Sampler, SamplingConfig


@dataclass
class RowResult:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.LENGTH  # EOS, STOP or LENGTH


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


class Generation:
    """Iterate for token events; `stop(row)` finishes a row after its current token; `result`
    holds the tokens, finish reasons and timings once the iteration is over."""

    def __init__(self, runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (), ignore_eos: bool = False):
        lengths = [len(p) for p in prompts]
        if lengths:  # the shortest (an empty prompt is refused) and the longest (the padded batch must fit)
            RowPolicy.check(min(lengths), max_new_tokens, runtime.max_context)
            RowPolicy.check(max(lengths), max_new_tokens, runtime.max_context)
        self.ids, self.mask = left_pad(prompts)
        self.runtime, self.max_new_tokens, self.sampling = runtime, max_new_tokens, sampling
        self.seen = seen = seen_matrix(sampling, runtime.dims.vocab_size, len(prompts))  # each row marks its line
        self.rows = [RowPolicy(p, max_new_tokens, eos_ids, ignore_eos, None if seen is None else seen[b:b + 1])
                     for b, p in enumerate(prompts)]
        self.result = GenerationResult([RowResult(len(p), row.tokens) for p, row in zip(prompts, self.rows)], 0.0, [])

    def stop(self, row: int) -> None:
        self.rows[row].stop()

    def __iter__(self) -> Iterator[TokenEvent]:
        rt, ids, mask, seen, results = self.runtime, self.ids, self.mask, self.seen, self.result.rows
        B = ids.shape[0]
        sampler = Sampler(self.sampling)
        start = time.perf_counter()
        out, session = rt.start(ids, mask, room=self.max_new_tokens)
        with session:
            token = sampler(out.logits[:, -1], seen, session.rows, B)
            self.result.ttft_s = time.perf_counter() - start
            while True:
                keep = []
                for i, (b, t) in enumerate(zip(session.rows, token.tolist())):  # plain Python: B is small
                    row = self.rows[b]
                    if not row.add(t):  # EOS
                        results[b].finish_reason = row.finish_reason
                        yield TokenEvent(b, None, row.finish_reason)
                        continue
                    yield TokenEvent(b, t, None)  # the consumer may stop(b) here
                    if row.finished():
                        results[b].finish_reason = row.finish_reason
                        yield TokenEvent(b, None, row.finish_reason)
                    else:
                        keep.append(i)
                if not keep:
                    break
                tick = time.perf_counter()
                if len(keep) < session.batch:  # finished rows leave: they are not computed any more
                    session.keep(keep)
                    token = token[keep]
                out = rt.step(session, token)
                token = sampler(out.logits[:, -1], seen, session.rows, B)
                self.result.decode_s.append(time.perf_counter() - tick)


def generate(runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (), ignore_eos: bool = False,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt and collect the result. `stop(row, tokens)` is asked
    after each new token of a row; `on_token(row, token)` is told each token as it arrives."""
    gen = Generation(runtime, prompts, max_new_tokens, sampling, eos_ids, ignore_eos)
    for event in gen:
        if event.token is None:
            continue
        if on_token is not None:
            on_token(event.row, event.token)
        if stop is not None and stop(event.row, gen.result.rows[event.row].tokens):
            gen.stop(event.row)
    return gen.result
