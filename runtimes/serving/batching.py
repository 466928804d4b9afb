"""Continuous batching over a static-capacity cache's slots, written once for every backend.

`Batcher` runs a loop on a thread of its own: each step the scheduler (runtimes/serving/scheduler.py,
pure) plans which requests leave, which take a free slot (the lowest: a step computes only up to
the last busy slot), one decode token for every running request and, within the step's token
budget (`step_tokens`), prefill chunks of the prompts coming in; the loop runs the plan on the
slots (runtimes/serving/slots.py) and tells the scheduler what happened. So a long prompt comes in a
chunk per step while the others keep decoding, never stalling them for its whole prefill. Each
request samples with a `Sampler` of its own (its seed, temperature, top-k/p, repetition penalty),
so its tokens do not depend on what else shares its steps, and ends by the same `RowPolicy` as
its solo run (runtimes/decoding/rows.py: EOS, its token budget, its front end's stop); or it is cancelled,
or fails alone. Either way it leaves at once and frees its slot.

Prefix caching (runtimes/serving/prefix_cache.py): the whole blocks of each prompt, and at its end of the
tokens it generated, are copied out of its slot into a cache of host copies (least recently used
out beyond `prefix_cache_bytes`; 0 turns it off), keyed by the runtime's identity; a prompt that
starts with cached blocks gets them copied into its slot and prefills only the rest. A request
that asks for its prompt's log-probabilities computes its whole prompt.

Front ends (toolkit/serving/frontend.py, under the HTTP server and the Triton model) submit
`Request`s and hear of each token through the request's `on_event`, called on the batcher's
thread, never under its lock: keep it short (hand the event to another thread or an event loop).
Stop strings belong to the front end, which has the text: its `stop(tokens)` is asked after each
token. Limits: `slots` requests run at once and `max_queue` wait; beyond that `submit` raises
`QueueFull`, never drops a request. Imports nothing heavy.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from tk.runtimes.base import InputError, Runtime, RuntimeProblem, check_token_ids
from tk.runtimes.decoding.logits import Processor, TokenLogprob, token_logprobs
from tk.runtimes.serving.prefix_cache import PrefixCache
from tk.runtimes.decoding.rows import FinishReason, RowPolicy, TokenEvent, seen_matrix
from tk.runtimes.decoding.sampling import Sampler, SamplingConfig
from tk.runtimes.serving.scheduler import Chunk, QueueFull, Scheduler, Seq, State, StepPlan, limits_problem
from tk.runtimes.serving.slots import Slots

log = logging.getLogger("tk.batcher")

__all__ = ["Batcher", "BatcherClosed", "QueueFull", "Request", "wait_all"]

# A step's budget is one decode token for each running request, then prefill chunks. Its runs are one
# decode run and one run per chunk (the graphs take no ragged batch), so while a prompt comes in, a
# stream waits its decode step plus a chunk: on CPUs the decode step costs about what reading the
# weights does, whatever the rows, and a chunk that plus its tokens' compute. On 2 cores and a 135M
# model, 8 rows' decode step costs about what a 16-token chunk does (examples/bench_serve.py
# --workload long-prompt measures the gaps). So by default a step takes its decode tokens plus
# CHUNK_TOKENS of prompt, and a step in which nobody decodes (nobody waits) IDLE_TOKENS.
CHUNK_TOKENS = 16
IDLE_TOKENS = 512
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


class BatcherClosed(RuntimeProblem):
    """The batcher is shutting down (or not started) and takes no new requests (HTTP 503)."""


@dataclass(eq=False)
class Request:
    """One prompt's generation. `on_event(TokenEvent)` hears each new token and, last, the finish
    (token None, finish_reason set), on the batcher's thread; `stop(tokens)` is asked after each
    kept token. The batcher fills `tokens`, `finish_reason` and `error` (and `prompt_scores`
    where asked); `done` is set at the end. Log-probabilities are the raw logits' (runtimes/decoding/logits.py)."""

    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    ignore_eos: bool = False
    on_event: Callable[[TokenEvent], None] | None = None
    stop: Callable[[list[int]], bool] | None = None
    processors: Sequence[Processor] = ()  # change the logits before the sampler draws, in order
    logprobs: int | None = None  # each new token's log-probability, with this many top alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (its first has none): `prompt_scores`
    id: int = -1
    tokens: list[int] = field(default_factory=list)
    prompt_scores: list[TokenLogprob | None] | None = None  # filled at admission, before the first event
    finish_reason: FinishReason | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _Running:
    """A request in its slot: its sampler and its row's policy (whose tokens are the request's), its
    prompt's ids, its prompt positions' logits so far (where it asked for their log-probabilities)
    and how many of its blocks the prefix cache holds."""

    __slots__ = ("request", "seq", "sampler", "policy", "ids", "prompt_logits", "stored")

    def __init__(self, seq: Seq, eos_ids: frozenset, vocab_size: int):
        request = seq.request
        self.request, self.seq, self.sampler = request, seq, Sampler(request.sampling)
        self.policy = RowPolicy(request.prompt, request.max_new_tokens, eos_ids, request.ignore_eos,
                                seen_matrix(request.sampling, vocab_size, 1), request.stop)
        request.tokens = self.policy.tokens
        self.ids: np.ndarray | None = None
        self.prompt_logits: list[np.ndarray] = []
        self.stored = 0


class Batcher:
    """Start it (or use `with`), `submit` requests, `cancel` them, `close` it. Counters for
    metrics: `running`, `waiting`, `finished[reason]`, `steps`, `prefill_tokens` (computed, not
    reused), and `prefix` (the PrefixCache, None where off: its hit rate and reused tokens)."""

    def __init__(self, runtime: Runtime, slots: int = 8, max_queue: int = 64, eos_ids: Sequence[int] = (),
                 step_tokens: int | None = None, prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES):
        if problem := limits_problem(slots, max_queue, step_tokens):
            raise InputError(problem)
        self.runtime, self.slots, self.max_queue, self.step_tokens = runtime, slots, max_queue, step_tokens
        self.prefix_cache_bytes = prefix_cache_bytes
        self.eos = frozenset(eos_ids)
        self._cv = threading.Condition()
        self._sched: Scheduler | None = None  # made at start: what the runtime can do is known once it is loaded
        self._seqs: dict[Request, Seq] = {}  # every request submitted and not finished
        self._running: dict[int, _Running] = {}  # slot -> its request (the loop thread's)
        self._closing = False
        self._abort = False
        self._last = np.zeros(slots, dtype=np.int64)  # each slot's last token: the next step's input
        self._ids = itertools.count()
        self._rows: Slots | None = None  # the runtime's slots, open while the batcher runs
        self._thread: threading.Thread | None = None
        self.prefix: PrefixCache | None = None
        self._block_bytes = 0  # what one of its blocks holds
        self.chunked = False  # prompts come in chunks (False: whole, where the backend cannot continue one)
        self.finished = {reason: 0 for reason in FinishReason}
        self.steps = 0
        self.prefill_tokens = 0

    # --- the front end's side ---

    @property
    def running(self) -> int:
        return len(self._sched.running) if self._sched else 0

    @property
    def waiting(self) -> int:
        return len(self._sched.waiting) if self._sched else 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Batcher":
        if self._rows is not None or self._closing:
            raise RuntimeError("a batcher starts once")
        self.runtime.activate()
        try:
            self._rows = Slots(self.runtime, self.slots)
        except BaseException:
            self.runtime.deactivate()  # what it loaded (device buffers, sessions) goes back
            raise
        problem = Slots.chunk_problem(self.runtime)
        self.chunked = problem is None
        if problem:
            log.info("prompts are prefilled whole, not in chunks, and no prefix is cached: %s", problem)
        if self.chunked and self.prefix_cache_bytes > 0 and self.runtime.layout.ring_free:
            self.prefix = PrefixCache(self.runtime.identity, max_bytes=self.prefix_cache_bytes)
        self._sched = Scheduler(self.slots, self.max_queue, self.step_tokens, self.chunked, self.prefix, IDLE_TOKENS,
                                CHUNK_TOKENS)
        self._block_bytes = self.runtime.dims.kv_bytes_per_token() * (self.prefix.block if self.prefix is not None else 0)
        self._thread = threading.Thread(target=self._loop, name="tk-batcher", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> "Batcher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self, prompt: Sequence[int], max_new_tokens: int, prompt_logprobs: bool = False) -> None:
        """Refuse what no slot can hold, or no slot can score (InputError, a one-line message for a 400)."""
        RowPolicy.check(len(prompt), max_new_tokens, self.runtime.max_context)
        if prompt_logprobs and (problem := Slots.prompt_logits_problem(self.runtime)):
            raise InputError(problem)
        check_token_ids(np.asarray(prompt, dtype=np.int64), self.runtime.dims.vocab_size)
        if self.runtime.max_prompt is not None and len(prompt) > self.runtime.max_prompt:
            raise InputError(f"a prompt of {len(prompt)} tokens is longer than the {self.runtime.name} backend's "
                             f"{self.runtime.max_prompt}; shorten it (or rebuild with a larger --max-input-len)")

    def submit(self, request: Request) -> Request:
        self.check(request.prompt, request.max_new_tokens, request.prompt_logprobs is not None)
        with self._cv:
            if self._closing or not self.alive:
                raise BatcherClosed("the batcher is shutting down and takes no new requests")
            seq = Seq(request.prompt, request, reuse=request.prompt_logprobs is None)
            self._sched.add(seq)  # QueueFull
            request.id = next(self._ids)
            self._seqs[request] = seq
            self._cv.notify()
        return request

    def cancel(self, request: Request) -> None:
        """End a request now (a client went away): it leaves before the next step, its slot freed."""
        with self._cv:
            seq = self._seqs.get(request)
            if seq is None:
                return
            gone = self._sched.abort(seq)
            self._cv.notify()
        if gone:  # it was waiting; outside the lock: the front end's callback runs
            self._finish(request, FinishReason.CANCELLED)

    def close(self, timeout: float = 0.0) -> None:
        """Take no new requests; let the running and waiting ones finish for up to `timeout`
        seconds, then cancel what is left, stop the loop and release the cache."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            with self._cv:
                self._abort = True
                self._cv.notify()
            self._thread.join()
            self._thread = None
            self._rows.close()
            self.runtime.deactivate()

    # --- the loop ---

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._sched.has_work or self._closing):
                    self._cv.wait()
                dropped = self._sched.abort_all() if self._abort else []
                if self._closing and not self._sched.has_work and not dropped:
                    return
                plan = self._sched.schedule()
            for seq in dropped:
                self._finish(seq.request, FinishReason.CANCELLED)
            try:
                self._run(plan)
            except Exception as e:  # noqa: BLE001: a bug here must not strand the requests (they would hang)
                self._fail([s for s in plan.admitted + plan.decode + [c.seq for c in plan.prefill]
                            if s.state is not State.DONE], e)

    def _run(self, plan: StepPlan) -> None:
        for seq in plan.left:
            self._leave(seq, FinishReason.CANCELLED)
        for seq in plan.admitted:
            self._enter(seq)
        if plan.decode:
            self._decode([seq.slot for seq in plan.decode])
        for chunk in plan.prefill:
            if chunk.seq.state is State.PREFILL:  # (not failed this step)
                self._prefill(chunk)

    def _enter(self, seq: Seq) -> None:
        """A request takes its slot: its sampler and policy, its cached prefix copied in."""
        cached, seq.cached = seq.cached, []
        try:
            running = _Running(seq, self.eos, self.runtime.dims.vocab_size)
            self._running[seq.slot] = running
            running.ids = self._rows.begin(seq.slot, seq.request.prompt)
            if cached:
                self._rows.load(seq.slot, cached)
                running.stored = len(cached)
        except Exception as e:  # noqa: BLE001: this request fails; the batcher and the others go on
            self._fail([seq], e)

    def _decode(self, active: list[int]) -> None:
        try:
            out = self._rows.step(self._last[: active[-1] + 1], active)
        except Exception as e:  # noqa: BLE001
            self._fail([self._running[slot].seq for slot in active], e)
            return
        self.steps += 1
        for slot in active:
            self._next(slot, out.logits[slot : slot + 1, -1])

    def _prefill(self, chunk: Chunk) -> None:
        seq = chunk.seq
        r = self._running[seq.slot]
        request = r.request
        every = request.prompt_logprobs is not None
        try:
            out = self._rows.prefill(seq.slot, r.ids, chunk.start, chunk.end, every)
            with self._cv:
                self._sched.advance(chunk)
            self.prefill_tokens += chunk.end - chunk.start
            self._store(r, request.prompt, chunk.end)
            if every:  # position i's logits score prompt token i + 1
                r.prompt_logits.append(out.logits[0])
                if chunk.last:
                    logits = np.concatenate(r.prompt_logits)
                    request.prompt_scores = [None, *token_logprobs(logits[:-1], request.prompt[1:],
                                                                   request.prompt_logprobs)]
        except Exception as e:  # noqa: BLE001
            return self._fail([seq], e)
        if chunk.last:
            self._next(seq.slot, out.logits[:, -1])

    def _store(self, r: _Running, tokens: Sequence[int], upto: int) -> None:
        """Keep the whole blocks of `tokens` whose positions (below `upto`) are in the slot's cache."""
        if self.prefix is None:
            return
        names, block = self.prefix.names(tokens, upto // self.prefix.block), self.prefix.block
        for i in range(r.stored, len(names)):
            parent = names[i - 1] if i else None
            part = None if names[i] in self.prefix else self._rows.read(r.seq.slot, i * block, (i + 1) * block)
            if not self.prefix.put(names[i], parent, part, self._block_bytes):
                break
            r.stored = i + 1

    def _next(self, slot: int, logits: np.ndarray) -> None:
        try:
            self._sample(slot, logits)
        except Exception as e:  # noqa: BLE001: its sampler or its front end's stop failed: this request only
            if slot in self._running:
                self._fail([self._running[slot].seq], e)

    def _sample(self, slot: int, logits: np.ndarray) -> None:
        """Sample the slot's next token from its logits (1, V); tell the front end; maybe leave."""
        r = self._running[slot]
        policy, request, raw = r.policy, r.request, logits
        for process in request.processors:
            logits = process(logits, policy.tokens)
        token = int(r.sampler(logits, policy.seen, [0], 1)[0])
        scored = None if request.logprobs is None else token_logprobs(raw, [token], request.logprobs)[0]
        if not policy.add(token):  # EOS: not kept, but its log-probability is told with the finish (lm-eval reads it)
            return self._leave(r.seq, policy.finish_reason, scored)
        self._last[slot] = token
        self._tell(request, TokenEvent(0, token, None, scored))
        if policy.finished():
            self._leave(r.seq, policy.finish_reason)

    def _leave(self, seq: Seq, reason: FinishReason, scored: TokenLogprob | None = None) -> None:
        """The request leaves its slot (a completed one's generated blocks kept for the next turn)."""
        r = self._running.pop(seq.slot, None)
        if r is not None and reason.completed and self.prefix is not None:
            try:  # the positions in the cache: the prompt's and every fed-back token's
                self._store(r, [*seq.prompt, *r.policy.tokens], int(self._rows.session.static.write[seq.slot]))
            except Exception:  # noqa: BLE001: a cache that could not keep it is no reason to fail the request
                log.exception("the prefix cache could not keep a finished request's blocks")
        self._rows.free(seq.slot)
        with self._cv:
            self._sched.finish(seq)
        self._finish(seq.request, reason, scored)

    def _fail(self, seqs: list[Seq], error: Exception) -> None:
        log.error("the batcher failed a step of %d request(s)", len(seqs), exc_info=error)
        for seq in [s for s in seqs if s.state is not State.DONE]:
            seq.request.error = f"{type(error).__name__}: {error}"
            self._leave(seq, FinishReason.ERROR)

    def _finish(self, request: Request, reason: FinishReason, scored: TokenLogprob | None = None) -> None:
        request.finish_reason = reason
        with self._cv:  # cancel() finishes a queued request on its caller's thread
            self.finished[reason] += 1
            self._seqs.pop(request, None)
        self._tell(request, TokenEvent(0, None, reason, scored))
        request.done.set()

    @staticmethod
    def _tell(request: Request, event: TokenEvent) -> None:
        if request.on_event is not None:
            try:
                request.on_event(event)
            except Exception:  # a front end's callback must not stop the batcher
                log.exception("a request's on_event raised")


def wait_all(requests: Sequence[Request], timeout: float | None = None) -> bool:
    """Wait for requests to finish; False if the timeout passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for r in requests:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not r.done.wait(left):
            return False
    return True
