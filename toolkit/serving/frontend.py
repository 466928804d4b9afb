"""What both serving front ends do alike, written once: a client's generation parameters made a
batcher `Request`, its text as the tokens arrive, when it stops, and what is counted under which
metric names. The OpenAI server (HTTP) and the Triton model (inside Triton) keep
only their transport: how a request arrives, how each piece of text leaves, and the metrics
library they count with.

A `Job` is one client request. Its tokens are detokenized on the batcher's thread as they come
(`TextStream`, vLLM's incremental detokenization): a stop string ends the request right after
the token that completes one, as `tk generate --stop` does, because the batcher asks the job's
stop hook only once `on_event` has heard that token. That costs the batcher's thread two short
decodes and a scan of the stop strings per token and request.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from tk.runtimes.base import InputError
from tk.runtimes.serving.batching import Batcher, Request
from tk.runtimes.decoding.logits import Penalties, Processor, logit_bias, min_tokens
from tk.runtimes.decoding.rows import FinishReason, TokenEvent
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.toolkit.textgen import TextStream, Tokenizer

METRICS = {  # every tk metric's name and help; tk serve exports them all, Triton's model the ones it updates
    "tk_queue_depth": "Requests waiting for a slot",
    "tk_active_slots": "Slots running a request",
    "tk_slots": "Slots of the batcher",
    "tk_requests": "HTTP requests by endpoint and status",
    "tk_requests_finished": "Generations by finish reason",
    "tk_prompt_tokens": "Prompt tokens admitted",
    "tk_generation_tokens": "Tokens generated",
    "tk_time_to_first_token_seconds": "Submit to first token",
    "tk_inter_token_latency_seconds": "Between a request's tokens",
    "tk_prefill_tokens": "Prompt tokens computed (not taken from the prefix cache)",
    "tk_prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "tk_prefix_cache_hits": "Prompt tokens taken from the prefix cache (tokens reused)",
    "tk_prefix_cache_hit_rate": "Prefix cache hits over queries, since start",
    "tk_prefix_cache_bytes": "Memory the prefix cache holds",
    "tk_spec_decode_draft_tokens": "Speculated tokens proposed (tk serve --lookup)",
    "tk_spec_decode_accepted_tokens": "Speculated tokens the target accepted",
}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)  # seconds


@dataclass(frozen=True)
class Params:
    """What a client asks of one generation, as its front end parsed it (with that API's defaults)."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0  # 0 (or vLLM's -1): off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: a fresh random seed
    ignore_eos: bool = False
    stop: Sequence[str] = ()
    min_tokens: int = 0  # no EOS, and no stop string, before this many tokens (vLLM's)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # each token's log-probability, with this many alternatives
    prompt_logprobs: int | None = None  # the prompt's tokens' too
    constraint: Constraint | None = None  # a grammar the text must follow (toolkit/serving/openai/structured.py)
    speculate: bool = True  # where the batcher speculates, this request's guesses are verified (False: it opts out)
    special_tokens: bool = False  # the text keeps special tokens (a tool-call format whose marker is one)

    def sampling(self, choice: int = 0) -> SamplingConfig:
        """The sampling of one of the request's choices (UsageProblem names a value no API schema
        caught). Choice 0 draws from `seed` itself (what `tk generate --seed` draws); choice j > 0
        from a stream of its own, derived from (seed, j)."""
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(4), "little")
        return SamplingConfig(temperature=self.temperature, top_k=0 if self.top_k == -1 else self.top_k,
                              top_p=self.top_p, repetition_penalty=self.repetition_penalty, seed=seed).for_row(choice)

    def processors(self, vocab_size: int, eos_ids: Sequence[int], grammar=None) -> list[Processor]:
        """The logits processors these parameters ask for, in vLLM's order (penalties, bias,
        min_tokens), then the grammar's mask, last, so that nothing re-allows a token it bans."""
        out: list[Processor] = []
        if self.presence_penalty or self.frequency_penalty:
            out.append(Penalties(self.presence_penalty, self.frequency_penalty, vocab_size))
        if self.logit_bias:
            out.append(logit_bias(self.logit_bias, vocab_size))
        if self.min_tokens:
            out.append(min_tokens(self.min_tokens, eos_ids))
        if grammar is not None:
            out.append(grammar)
        return out


class Grammar(Protocol):
    """One generation's grammar: a processor (it bans the tokens the grammar forbids next) that
    also says when the grammar is complete (nothing may follow but EOS)."""

    def __call__(self, logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray: ...

    def complete(self, tokens: Sequence[int]) -> bool: ...


class Constraint(Protocol):
    """A grammar a request's text must follow: `start(sampling)` gives each of its generations a
    matcher (the sampling: a tool call's grammar lets the model's own draws end the reply)."""

    def start(self, sampling: SamplingConfig) -> Grammar: ...


class Metrics:
    """What a front end counts, each hook told on the batcher's thread (`submitted` on the
    submitter's). The base counts nothing; each front end counts with its own library."""

    def submitted(self, prompt_tokens: int) -> None:
        pass

    def token(self, first: bool, seconds: float) -> None:
        """A new token, `seconds` after the request's previous one (the first: after submission)."""

    def finished(self, reason: FinishReason, tokens: int) -> None:
        pass


class Job(ABC):
    """One client request over the batcher: its `request`, its `text` (None without a tokenizer:
    token ids only), its metrics. A front end subclasses it with its transport: `deliver(piece,
    event)` hands out each event with the new text it makes safe to show (the rest of the text
    on a completed finish), and `listening()` may say the client is gone (the job then cancels)."""

    def __init__(self, batcher: Batcher, prompt: Sequence[int], params: Params, *, tokenizer: Tokenizer | None,
                 metrics: Metrics, choice: int = 0):
        if params.stop and tokenizer is None:
            raise InputError("stop needs the artifact's tokenizer")
        self.batcher, self.prompt, self.metrics, self.min_tokens = batcher, list(prompt), metrics, params.min_tokens
        self.text = TextStream(tokenizer, params.stop, params.special_tokens) if tokenizer is not None else None
        self.last = time.perf_counter()  # the last token's time (at first: submission)
        sampling = params.sampling(choice)
        self.grammar = params.constraint.start(sampling) if params.constraint is not None else None
        processors = params.processors(batcher.runtime.dims.vocab_size, sorted(batcher.eos), self.grammar)
        self.request = Request(self.prompt, params.max_tokens, sampling, ignore_eos=params.ignore_eos,
                               on_event=self._on_event, stop=self._stopped, processors=processors,
                               logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
                               speculate=params.speculate)

    def submit(self) -> Request:
        """Hand the request to the batcher (QueueFull, BatcherClosed, InputError as it raises them)."""
        self.batcher.submit(self.request)
        self.metrics.submitted(len(self.prompt))
        return self.request

    def cancel(self) -> None:
        self.batcher.cancel(self.request)

    def listening(self) -> bool:
        return True

    @abstractmethod
    def deliver(self, piece: str, event: TokenEvent) -> None:
        """Hand one event and its new text to the client (the front end's transport)."""

    def _stopped(self, tokens: list[int]) -> bool:  # asked by the batcher right after on_event heard a token
        """A stop string appeared, or the grammar is complete (nothing may follow but EOS: the row
        ends here, with or without ignore_eos)."""
        return (self.text is not None and self.text.stopped) or (self.grammar is not None and
                                                                 self.grammar.complete(tokens))

    def _on_event(self, event: TokenEvent) -> None:  # the batcher's thread
        now = time.perf_counter()
        if event.token is None:
            done = self.text is not None and event.finish_reason.completed
            piece = self.text.finish() if done else ""
            self.metrics.finished(event.finish_reason, len(self.request.tokens))
        else:
            if not self.listening():
                return self.cancel()
            armed = len(self.request.tokens) >= self.min_tokens  # vLLM: no stop string before min_tokens
            piece = self.text.add(event.token, armed) if self.text is not None else ""
            self.metrics.token(len(self.request.tokens) == 1, now - self.last)
            self.last = now
        self.deliver(piece, event)
