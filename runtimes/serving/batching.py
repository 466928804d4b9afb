"""Continuous batching over a static-capacity cache's slots, written once for every backend.

`Batcher` runs a loop on a thread of its own: each step the scheduler (pure, under the batcher's
`BatcherLimits`) plans which requests leave, which take a free slot (the lowest: a step computes
only up to the last busy slot), one decode token for every running request and, within the step's
token budget, prefill chunks of the prompts coming in; the loop runs the plan on the `Slots` and
tells the scheduler what happened. So a long prompt comes in a chunk per step while the others keep
decoding, never stalling them for its whole prefill. Each request in its slot samples by itself
(its `Row`, runtimes/decoding/row.py: its own sampler, processors and log-probabilities, what
`tk generate` runs) and ends by the same `RowPolicy` as
its solo run (EOS, its token budget, its front end's stop); or it is cancelled, or fails alone.
Either way it leaves at once and frees its slot. The steps themselves are runtimes/serving/stepping.py's. With prefix caching (`PrefixStore` decides what
a slot's cache leaves in the `PrefixCache`), a prompt that starts with cached blocks gets them
copied into its slot and prefills only the rest; one that asks for its prompt's log-probabilities
computes its whole prompt.

Front ends (the HTTP server and the Triton model) submit `Request`s and hear of each token through
the request's `on_event`, called on the batcher's thread, never under its lock: keep it short (hand
the event to another thread or an event loop). Stop strings belong to the front end, which has the
text: its `stop(tokens)` is asked after each token. Limits: `slots` requests run at once and
`max_queue` wait; beyond that `submit` raises `QueueFull`, never drops a request. Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Callable, Sequence

import numpy as np

from tk.runtimes.base import InputError, Runtime, RuntimeProblem, check_token_ids
from tk.runtimes.decoding.logits import Processor, TokenLogprob
from tk.runtimes.decoding.rows import FinishReason, RowPolicy, TokenEvent
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.runtimes.decoding.speculative import Speculation
from tk.runtimes.serving.heap import TRIM_EVERY_S, fix_mmap_threshold, trim_heap
from tk.runtimes.serving.prefix_cache import PrefixCache
from tk.runtimes.serving.prefix_store import PrefixStore
from tk.runtimes.serving.run_cost import Costs
from tk.runtimes.serving.scheduler import BatcherLimits, QueueFull, Scheduler, Seq, State
from tk.runtimes.serving.speculating import SlotSpeculation
from tk.runtimes.serving.stepping import Steps
from tk.runtimes.slots import Slots

log = logging.getLogger("tk.batcher")

__all__ = ["Batcher", "BatcherClosed", "BatcherLimits", "QueueFull", "Request", "wait_all"]


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
    _: KW_ONLY
    ignore_eos: bool = False
    on_event: Callable[[TokenEvent], None] | None = None
    stop: Callable[[list[int]], bool] | None = None
    processors: Sequence[Processor] = ()  # change the logits before the sampler draws, in order
    logprobs: int | None = None  # each new token's log-probability, with this many top alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (its first has none): `prompt_scores`
    speculate: bool = True  # where the batcher speculates: this request's guesses are verified (False: opts out)
    id: int = -1
    tokens: list[int] = field(default_factory=list)
    prompt_scores: list[TokenLogprob | None] | None = None  # filled at admission, before the first event
    finish_reason: FinishReason | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Batcher:
    """Start it (or use `with`), `submit` requests, `cancel` them, `close` it. Counters for
    metrics: `running`, `waiting`, `finished[reason]`, `steps`, `prefill_tokens` (computed, not
    reused), `prefix` (the PrefixCache, None where off: its hit rate and reused tokens), and with
    `speculation` the guesses `proposed` and `accepted` (`speculating`): the scheduler plans which
    requests guess each step, and a request's tokens are taken through its own row
    (`Row.take_verified`), so what it gets is what it would get without them."""

    def __init__(self, runtime: Runtime, *, limits: BatcherLimits = BatcherLimits(), eos_ids: Sequence[int] = (),
                 speculation: Speculation | None = None):
        self.runtime, self.limits, self.eos, self.speculation = runtime, limits, frozenset(eos_ids), speculation
        self.costs = Costs()  # what the loop's runs cost: the scheduler's chunks and guesses follow it
        # its proposer, rule and counters (what the runtime can verify is checked at start, once it is loaded)
        self.speculating = None if speculation is None else SlotSpeculation(speculation, self.costs.steps)
        self._cv, self._closed = threading.Condition(), threading.Lock()
        self.arriving = Arrivals(self._cv)  # front ends: `with batcher.arriving():` while reading a request
        self._sched: Scheduler | None = None  # made at start: what the runtime can do is known once it is loaded
        self._seqs: dict[Request, Seq] = {}  # every request submitted and not finished
        self._closing = self._abort = False
        self._ids = itertools.count()
        self._steps: Steps | None = None  # the loop's, over the runtime's slots, while the batcher runs
        self._thread: threading.Thread | None = None
        self.prefix: PrefixCache | None = None
        self.chunked = False  # prompts come in chunks (False: whole, where the backend cannot continue one)
        self.finished = {reason: 0 for reason in FinishReason}

    # --- the front end's side ---

    @property
    def running(self) -> int:
        return len(self._sched.running) if self._sched else 0

    @property
    def waiting(self) -> int:
        return len(self._sched.waiting) if self._sched else 0

    @property
    def steps(self) -> int:
        return self._steps.steps if self._steps else 0

    @property
    def prefill_tokens(self) -> int:
        return self._steps.prefill_tokens if self._steps else 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Batcher":
        if self._steps is not None or self._closing:
            raise RuntimeError("a batcher starts once")
        fix_mmap_threshold()  # its runs' large tensors mapped and unmapped whole (runtimes/serving/heap.py)
        self.runtime.activate()
        slots = None
        try:
            slots = Slots(self.runtime, self.limits.slots)
            if self.speculating is not None:
                self.speculating.open(self.runtime, self.limits.slots)
        except BaseException:
            if slots is not None:
                slots.close()
            self.runtime.deactivate()  # what it loaded (device buffers, sessions) goes back
            raise
        problem = Slots.chunk_problem(self.runtime)
        self.chunked, store = problem is None, None
        if problem:
            log.info("prompts are prefilled whole, not in chunks, and no prefix is cached: %s", problem)
        if self.chunked and self.limits.prefix_cache_bytes > 0 and self.runtime.dims.stateful:
            log.warning("prefix caching is off: this model's recurrent layers carry a state that a cached block of "
                        "keys and values cannot restore (tk keeps no state per block)")
        elif self.chunked and self.limits.prefix_cache_bytes > 0 and self.runtime.layout.ring_free:
            store = PrefixStore(self.runtime, slots, self.limits.prefix_cache_bytes)
            self.prefix = store.cache
        elif self.chunked and self.limits.prefix_cache_bytes > 0:
            log.info("prefix caching is off: a sliding layer's cache is a ring of its window, whose slots a cached "
                     "block of positions cannot restore")
        self._sched = Scheduler(self.limits, chunked=self.chunked, prefix=self.prefix, costs=self.costs,
                                speculation=None if self.speculating is None else self.speculating.rule)
        self._steps = Steps(self.runtime, slots, self.eos, store=store, speculating=self.speculating, costs=self.costs,
                            tell=self._tell, advanced=self._advanced, ended=self._ended, log=log)
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
            self.arriving.last = time.monotonic()
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
        with self._closed:  # (a server's shutdown may close it from two threads)
            if self._thread is None:
                return
            self._thread.join(timeout)
            with self._cv:
                self._abort = True
                self._cv.notify()
            self._thread.join()
            self._thread = None
            self._steps.slots.close()
            self.runtime.deactivate()
            if self.speculating is not None:
                self.speculating.close()

    # --- the loop ---

    def _loop(self) -> None:
        trimmed = time.monotonic()
        while True:
            if time.monotonic() - trimmed > TRIM_EVERY_S or not self._sched.has_work:
                trim_heap()
                trimmed = time.monotonic()
            with self._cv:
                while not (self._sched.has_work or self._closing):
                    self._cv.wait()
                if not (self._sched.running or self._closing):  # an idle loop's first step: a burst joins it
                    self.arriving.gather(self.limits.gather_s, LINGER * self.costs.decode)
                dropped = self._sched.abort_all() if self._abort else []
                if self._closing and not self._sched.has_work and not dropped:
                    return
                plan = self._sched.schedule()
            for seq in dropped:
                self._finish(seq.request, FinishReason.CANCELLED)
            try:
                self._steps.run(plan)
            except Exception as e:  # noqa: BLE001: a bug here must not strand the requests (they would hang)
                self._steps.fail([s for s in plan.admitted + plan.decode + [g.seq for g in plan.verify] +
                                  [c.seq for c in plan.prefill] if s.state is not State.DONE], e)

    def _advanced(self, chunk) -> None:
        with self._cv:
            self._sched.advance(chunk)

    def _ended(self, seq: Seq, reason: FinishReason, scored: TokenLogprob | None) -> None:
        """A request left its slot: the scheduler frees it, its front end hears the finish."""
        with self._cv:
            self._sched.finish(seq)
        self._finish(seq.request, reason, scored)

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


# an idle loop lingers for a burst's next request this share of a decode step (measured) after the last arrived
LINGER = 0.1


class Arrivals:
    """Requests the front ends have begun to read (the body, a chat template, the tokens) and not yet
    submitted, and when the last one was submitted. A burst of requests reaches the batcher over tens
    of milliseconds (an HTTP server reads them one at a time, a few milliseconds apart): the first one
    submitted to an idle loop would prefill and start decoding alone, and its second token would wait
    out the others' prefill, a gap of the whole burst's first run. So an idle loop `gather`s first:
    it waits while requests are arriving and until none has come for a tenth of a decode step
    (LINGER: a few milliseconds on a CPU, less on a GPU), up to `BatcherLimits.gather_s`. A request
    that arrives alone waits that tenth of a step."""

    def __init__(self, cv: threading.Condition):
        self._cv, self.count, self.last = cv, 0, 0.0

    @contextlib.contextmanager
    def __call__(self):
        """Around reading and submitting one request."""
        with self._cv:
            self.count += 1
        try:
            yield
        finally:
            with self._cv:
                self.count -= 1
                self._cv.notify_all()

    def gather(self, limit: float, linger: float) -> None:
        """Under the condition's lock: wait while requests are arriving or one came within `linger`
        seconds, at most `limit` seconds."""
        deadline = time.monotonic() + limit
        while (left := deadline - time.monotonic()) > 0:
            if self.count > 0:
                self._cv.wait(left)
            elif (quiet := self.last + linger - time.monotonic()) > 0:
                self._cv.wait(min(quiet, left))
            else:
                return


def wait_all(requests: Sequence[Request], timeout: float | None = None) -> bool:
    """Wait for requests to finish; False if the timeout passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for r in requests:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not r.done.wait(left):
            return False
    return True
