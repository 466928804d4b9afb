"""The generation loop, written once for every backend, as a stream of token events.

`Generation` left-pads a batch of prompts, starts a session on the runtime and yields one
`TokenEvent` per new token (and one when a row finishes). Each prompt is a `Row`
(runtimes/decoding/row.py, the batcher's too): its own sampler and seed stream (row 0 draws from the
seed itself, row j from a stream derived from (seed, j): `SamplingConfig.for_row`), its logits
processors, and its `RowPolicy`: EOS, the token budget, or a stop its consumer asks for with
`stop(row)` (stop strings live with the text, in toolkit/textgen.py); a finished row leaves the
session at once, so it is no longer computed. With a `Speculation`, a proposer keyed by row guesses,
one verify run checks every row's guesses, and each row takes its tokens through `Row.take_verified`.
`generate()` collects the events. It knows nothing about tokenization and nothing about which
backend runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from tk.runtimes.base import Runtime
from tk.runtimes.decoding.logits import Processor
from tk.runtimes.decoding.row import Row
from tk.runtimes.decoding.rows import FinishReason, RowPolicy, TokenEvent, left_pad
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.runtimes.decoding.speculative import Speculation, SpeculationStats


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
    holds the tokens, finish reasons and timings once the iteration is over. `processors(row)` gives
    a row's logits processors (logit bias, penalties, a grammar: runtimes/decoding/logits.py)."""

    def __init__(self, runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (), ignore_eos: bool = False,
                 speculation: Speculation | None = None,
                 processors: Callable[[int], Sequence[Processor]] | None = None):
        if speculation is not None:
            speculation.check(runtime)
        lengths = [len(p) for p in prompts]
        if lengths:  # the shortest (an empty prompt is refused) and the longest (the padded batch must fit)
            RowPolicy.check(min(lengths), max_new_tokens, runtime.max_context)
            RowPolicy.check(max(lengths), max_new_tokens, runtime.max_context)
        self.ids, self.mask = left_pad(prompts)
        self.runtime, self.max_new_tokens, self.sampling = runtime, max_new_tokens, sampling
        self.prompts, self.speculation = [list(p) for p in prompts], speculation
        self.rows = [Row(p, max_new_tokens, sampling.for_row(b), vocab_size=runtime.dims.vocab_size, eos_ids=eos_ids,
                         ignore_eos=ignore_eos, processors=processors(b) if processors else (), index=b)
                     for b, p in enumerate(self.prompts)]
        self.result = GenerationResult([RowResult(len(p), row.tokens) for p, row in zip(prompts, self.rows)], 0.0, [])
        self.stats = self.result.speculation = None if speculation is None else SpeculationStats()

    def stop(self, row: int) -> None:
        self.rows[row].policy.stop()

    def _ended(self, b: int, events: Iterator[TokenEvent]) -> Iterator[TokenEvent]:
        """Row b's events of one take; returns what the take returns, and records how the row ended."""
        out = yield from events
        row = self.rows[b]
        if row.policy.finish_reason is not None:
            self.result.rows[b].finish_reason = row.policy.finish_reason
        return out

    def _take_all(self, session, logits: np.ndarray) -> Iterator[TokenEvent]:
        """Each row of the session takes its token from its logits (B, V) -> the rows (indices) that go on."""
        keep = []
        for i, b in enumerate(session.rows):  # plain Python: B is small
            if (yield from self._ended(b, self.rows[b].take(logits[i:i + 1]))):
                keep.append(i)
        return keep

    def __iter__(self) -> Iterator[TokenEvent]:
        rt = self.runtime
        start = time.perf_counter()
        out, session = rt.start(self.ids, self.mask, room=self.max_new_tokens)
        with session:
            keep = yield from self._take_all(session, out.logits[:, -1])
            self.result.ttft_s = time.perf_counter() - start
            if self.speculation is not None:
                yield from self._speculate(session, keep)
                return
            while keep:
                tick = time.perf_counter()
                if len(keep) < session.batch:  # finished rows leave: they are not computed any more
                    session.keep(keep)
                out = rt.step(session, [self.rows[b].tokens[-1] for b in session.rows])
                keep = yield from self._take_all(session, out.logits[:, -1])
                self.result.decode_s.append(time.perf_counter() - tick)

    def _speculate(self, session, keep: list[int]) -> Iterator[TokenEvent]:
        """The loop with a proposer: it guesses after each row's text, one verify run checks every
        row's guesses, and each row takes its accepted prefix and the target's next token."""
        rt, spec, stats = self.runtime, self.speculation, self.stats
        proposer = spec.proposer
        proposer.open(len(self.rows))
        try:
            for b, row in enumerate(self.rows):
                proposer.begin(b, row.prompt, row.sampler.config)
            while keep:
                tick = time.perf_counter()
                if len(keep) < session.batch:
                    session.keep(keep)
                rows, written = session.rows, session.static.write.tolist()
                room = [spec.room(rt, w, self.max_new_tokens - len(self.rows[b].tokens)) for b, w in zip(rows, written)]
                guesses = proposer.propose(rows, [self.prompts[b] + self.rows[b].tokens for b in rows], room)
                n = 1 + max(len(g.tokens) for g in guesses)
                batch = np.zeros((len(rows), n), dtype=np.int64)
                for i, (b, g) in enumerate(zip(rows, guesses)):
                    batch[i, 0] = self.rows[b].tokens[-1]
                    batch[i, 1:1 + len(g.tokens)] = g.tokens
                logits = rt.step(session, batch[:, 0]).logits if n == 1 else rt.verify(session, batch)
                keep, lengths, before = [], [], sum(len(self.rows[b].tokens) for b in rows)
                for i, (b, g, w) in enumerate(zip(rows, guesses, written)):
                    events = self.rows[b].take_verified(logits[i, :len(g.tokens) + 1], g.tokens, g.probs)
                    accepted = yield from self._ended(b, events)
                    if self.rows[b].policy.finish_reason is None:
                        keep.append(i)
                    proposer.accept(b, accepted)
                    lengths.append(w + 1 + accepted)
                    stats.proposed += len(g.tokens)
                    stats.accepted += accepted
                if n > 1:
                    rt.rewind(session, lengths)
                stats.steps += 1
                stats.tokens += sum(len(self.rows[b].tokens) for b in rows) - before
                self.result.decode_s.append(time.perf_counter() - tick)
        finally:
            proposer.close()


def generate(runtime: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] = (), ignore_eos: bool = False,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None,
             speculation: Speculation | None = None,
             processors: Callable[[int], Sequence[Processor]] | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt and collect the result. `stop(row, tokens)` is asked
    after each new token of a row; `on_token(row, token)` is told each token as it arrives; with
    `speculation`, a proposer's guesses are verified a run at a time (runtimes/decoding/speculative.py)."""
    gen = Generation(runtime, prompts, max_new_tokens, sampling, eos_ids, ignore_eos, speculation, processors)
    for event in gen:
        if event.token is None:
            continue
        if on_token is not None:
            on_token(event.row, event.token)
        if stop is not None and stop(event.row, gen.result.rows[event.row].tokens):
            gen.stop(event.row)
    return gen.result
