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

from tk.runtimes.base import Runtime
from tk.runtimes.decoding.rows import FinishReason, RowPolicy, TokenEvent, left_pad, seen_matrix
from tk.runtimes.decoding.sampling import Sampler, SamplingConfig
from tk.runtimes.decoding.speculative import Speculation, SpeculationStats, judge


@dataclass
class RowResult:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.LENGTH  # EOS, STOP or LENGTH


@dataclass
class GenerationResult:
    rows: list[RowResult]
    ttft_s: float  # prefill + first token
    decode_s: list[float]  # one entry per decode step (a verify run of speculated tokens is one)
    speculation: SpeculationStats | None = None  # what speculative decoding counted (None: it did not run)

    @property
    def decode_ms_per_token(self) -> float:
        """Decode time per token of a row: a step's (with speculation, the runs' time over the tokens
        a row got from them, on average: a run yields one token or more)."""
        if not self.decode_s:
            return float("nan")
        if self.speculation is None:
            return 1e3 * float(np.mean(self.decode_s))
        return 1e3 * sum(self.decode_s) / max(float(np.mean([len(r.tokens) - 1 for r in self.rows])), 1.0)

    @property
    def tokens_per_s(self) -> float:
        total = self.ttft_s + sum(self.decode_s)
        return sum(len(r.tokens) for r in self.rows) / total if total else float("nan")

    def timings(self) -> dict:
        spec = {} if self.speculation is None else {"speculation": self.speculation.to_dict()}
        return {"ttft_ms": 1e3 * self.ttft_s, "decode_ms_per_token": self.decode_ms_per_token,
                "tokens_per_s": self.tokens_per_s, "decode_steps": len(self.decode_s), **spec}


class Generation:
    """Iterate for token events; `stop(row)` finishes a row after its current token; `result`
    holds the tokens, finish reasons and timings once the iteration is over."""

    def __init__(self, runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (), ignore_eos: bool = False,
                 speculation: Speculation | None = None):
        if speculation is not None:
            speculation.check(runtime)
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
        self.prompts, self.speculation = [list(p) for p in prompts], speculation
        self.stats = self.result.speculation = None if speculation is None else SpeculationStats()

    def stop(self, row: int) -> None:
        self.rows[row].stop()

    def _take(self, b: int, t: int) -> Iterator[TokenEvent]:
        """Row b's new token `t`: its events; returns whether the row goes on."""
        row, result = self.rows[b], self.result.rows[b]
        if not row.add(t):  # EOS
            result.finish_reason = row.finish_reason
            yield TokenEvent(b, None, row.finish_reason)
            return False
        yield TokenEvent(b, t, None)  # the consumer may stop(b) here
        if row.finished():
            result.finish_reason = row.finish_reason
            yield TokenEvent(b, None, row.finish_reason)
            return False
        return True

    def __iter__(self) -> Iterator[TokenEvent]:
        rt, ids, mask, seen = self.runtime, self.ids, self.mask, self.seen
        B = ids.shape[0]
        sampler = Sampler(self.sampling)
        start = time.perf_counter()
        if self.speculation is not None:
            self.speculation.proposer.start(self.prompts, self.sampling)
        out, session = rt.start(ids, mask, room=self.max_new_tokens)
        with session:
            token = sampler(out.logits[:, -1], seen, session.rows, B)
            self.result.ttft_s = time.perf_counter() - start
            if self.speculation is not None:
                try:
                    yield from self._speculate(session, sampler, [[t] for t in token.tolist()])
                finally:
                    self.speculation.proposer.close()
                return
            while True:
                keep = []
                for i, (b, t) in enumerate(zip(session.rows, token.tolist())):  # plain Python: B is small
                    if (yield from self._take(b, t)):
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

    def _speculate(self, session, sampler: Sampler, new: list[list[int]]) -> Iterator[TokenEvent]:
        """The loop with a proposer: each row's `new` tokens are heard in order (the last is not in the
        cache yet); then the proposer guesses after each row's text, one verify run checks every row's
        guesses, and each row keeps its accepted prefix and the target's next token."""
        rt, spec, stats, B = self.runtime, self.speculation, self.stats, self.ids.shape[0]
        rng = np.random.default_rng([self.sampling.seed, 1])  # the acceptance tests' own draws
        while True:
            keep = []
            for i, (b, tokens) in enumerate(zip(session.rows, new)):
                alive = True
                for t in tokens:
                    alive = yield from self._take(b, t)
                    if not alive:
                        break
                if alive:
                    keep.append(i)
            if not keep:
                return
            tick = time.perf_counter()
            if len(keep) < session.batch:
                session.keep(keep)
                spec.proposer.keep(keep)
            rows = session.rows
            last = np.array([self.rows[b].tokens[-1] for b in rows], dtype=np.int64)
            written = session.static.write
            room = [spec.room(rt, w, self.max_new_tokens - len(self.rows[b].tokens))
                    for b, w in zip(rows, written.tolist())]
            guesses = spec.proposer.propose([self.prompts[b] + self.rows[b].tokens for b in rows], room)
            n = 1 + max(len(g.tokens) for g in guesses)
            stats.steps += 1
            if n == 1:  # nothing to check: a plain step
                out = rt.step(session, last)
                new = [[t] for t in sampler(out.logits[:, -1], self.seen, rows, B).tolist()]
                spec.proposer.accepted([0] * len(rows))
            else:
                batch = np.zeros((len(rows), n), dtype=np.int64)
                batch[:, 0] = last
                for i, g in enumerate(guesses):
                    batch[i, 1:1 + len(g.tokens)] = g.tokens
                logits = rt.verify(session, batch)
                verdicts = [judge(sampler, logits[i, :len(g.tokens) + 1], g,
                                  None if self.seen is None else self.seen[b:b + 1], rng)
                            for i, (b, g) in enumerate(zip(rows, guesses))]
                rt.rewind(session, [int(w) + 1 + v.accepted for w, v in zip(written.tolist(), verdicts)])
                spec.proposer.accepted([v.accepted for v in verdicts])
                stats.proposed += sum(len(g.tokens) for g in guesses)
                stats.accepted += sum(v.accepted for v in verdicts)
                new = [v.kept for v in verdicts]
            stats.tokens += sum(len(t) for t in new)
            self.result.decode_s.append(time.perf_counter() - tick)


def generate(runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (), ignore_eos: bool = False,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None,
             speculation: Speculation | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt and collect the result. `stop(row, tokens)` is asked
    after each new token of a row; `on_token(row, token)` is told each token as it arrives; with
    `speculation`, a proposer's guesses are verified a run at a time (runtimes/decoding/speculative.py)."""
    gen = Generation(runtime, prompts, max_new_tokens, sampling, eos_ids, ignore_eos, speculation)
    for event in gen:
        if event.token is None:
            continue
        if on_token is not None:
            on_token(event.row, event.token)
        if stop is not None and stop(event.row, gen.result.rows[event.row].tokens):
            gen.stop(event.row)
    return gen.result
