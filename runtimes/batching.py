"""Continuous batching over a static-capacity cache's slots, written once for every backend.

`Batcher` runs a loop on a thread of its own. Between decode steps it lets cancelled requests
leave and admits waiting ones, each prefilled alone into a free slot (the lowest: the step
computes only up to the last busy slot), exactly as `tk generate` of that prompt alone would
prefill it; every step then decodes all running requests together, each at its own length and
write index (runtimes/slots.py). Each request samples with a `Sampler` of its own (its seed,
temperature, top-k/p, repetition penalty), so its tokens do not depend on what else shares its
steps, and ends by the same `RowPolicy` as its solo run (runtimes/rows.py: EOS, its token budget,
its front end's stop); or it is cancelled, or fails alone. Either way it leaves at once and frees
its slot.

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
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from tk.runtimes.base import InputError, Runtime, RuntimeProblem, check_token_ids
from tk.runtimes.logits import Processor, TokenLogprob, token_logprobs
from tk.runtimes.rows import FinishReason, RowPolicy, TokenEvent, seen_matrix
from tk.runtimes.sampling import Sampler, SamplingConfig
from tk.runtimes.slots import Slots

log = logging.getLogger("tk.batcher")


class QueueFull(RuntimeProblem):
    """Every slot is busy and the queue is full: retry later (HTTP 429)."""


class BatcherClosed(RuntimeProblem):
    """The batcher is shutting down (or not started) and takes no new requests (HTTP 503)."""


@dataclass(eq=False)
class Request:
    """One prompt's generation. `on_event(TokenEvent)` hears each new token and, last, the finish
    (token None, finish_reason set), on the batcher's thread; `stop(tokens)` is asked after each
    kept token. The batcher fills `tokens`, `finish_reason` and `error` (and `prompt_scores`
    where asked); `done` is set at the end. Log-probabilities are the raw logits' (runtimes/logits.py)."""

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
    """A request in its slot: its sampler and its row's policy (whose tokens are the request's)."""

    __slots__ = ("request", "sampler", "policy")

    def __init__(self, request: Request, eos_ids: frozenset, vocab_size: int):
        self.request, self.sampler = request, Sampler(request.sampling)
        self.policy = RowPolicy(request.prompt, request.max_new_tokens, eos_ids, request.ignore_eos,
                                seen_matrix(request.sampling, vocab_size, 1), request.stop)
        request.tokens = self.policy.tokens


class Batcher:
    """Start it (or use `with`), `submit` requests, `cancel` them, `close` it. Counters for
    metrics: `running`, `waiting`, `finished[reason]`, `steps`."""

    def __init__(self, runtime: Runtime, slots: int = 8, max_queue: int = 64, eos_ids: Sequence[int] = ()):
        if slots < 1 or max_queue < 0:
            raise InputError(f"slots must be >= 1 and the queue >= 0, got {slots} and {max_queue}")
        self.runtime, self.slots, self.max_queue = runtime, slots, max_queue
        self.eos = frozenset(eos_ids)
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, _Running] = {}  # slot -> its request
        self._cancel: set[Request] = set()
        self._closing = False
        self._abort = False
        self._admitting = 0  # taken from the queue, not yet in a slot
        self._last = np.zeros(slots, dtype=np.int64)  # each slot's last token: the next step's input
        self._ids = itertools.count()
        self._rows: Slots | None = None  # the runtime's slots, open while the batcher runs
        self._thread: threading.Thread | None = None
        self.finished = {reason: 0 for reason in FinishReason}
        self.steps = 0

    # --- the front end's side ---

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

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
            if len(self._running) + self._admitting + len(self._waiting) >= self.slots + self.max_queue:
                raise QueueFull(f"all {self.slots} slots are busy and the queue of {self.max_queue} is full; "
                                "retry later")
            request.id = next(self._ids)
            self._waiting.append(request)
            self._cv.notify()
        return request

    def cancel(self, request: Request) -> None:
        """End a request now (a client went away): it leaves before the next step, its slot freed."""
        with self._cv:
            if request.done.is_set():
                return
            queued = request in self._waiting
            if queued:
                self._waiting.remove(request)
            else:
                self._cancel.add(request)
                self._cv.notify()
        if queued:  # outside the lock: the front end's callback runs
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
            dropped: list[Request] = []
            with self._cv:
                while not (self._waiting or self._running or self._cancel or self._closing):
                    self._cv.wait()
                if self._abort:
                    self._cancel.update(r.request for r in self._running.values())
                    dropped, self._waiting = list(self._waiting), deque()
                if self._closing and not (self._waiting or self._running) and not dropped:
                    return
                cancel, self._cancel = self._cancel, set()
                admit = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.slots - len(self._running)))]
                self._admitting = len(admit)
            for request in dropped:
                self._finish(request, FinishReason.CANCELLED)
            try:
                for slot in [s for s, r in self._running.items() if r.request in cancel]:
                    self._leave(slot, FinishReason.CANCELLED)
                for request in admit:
                    self._admit(request)
                if self._running:
                    self._step()
            except Exception as e:  # noqa: BLE001: a bug here must not strand the requests (they would hang)
                with self._cv:
                    stranded = [r for r in admit if r.finish_reason is None and r not in
                                {x.request for x in self._running.values()}]
                    self._admitting = 0
                self._fail(list(self._running), e)
                for request in stranded:
                    request.error = f"{type(e).__name__}: {e}"
                    self._finish(request, FinishReason.ERROR)

    def _admit(self, request: Request) -> None:
        slot = min(set(range(self.slots)) - set(self._running))
        try:
            running = _Running(request, self.eos, self.runtime.dims.vocab_size)
        except Exception as e:  # noqa: BLE001: this request fails; the batcher and the others go on
            with self._cv:
                self._admitting -= 1
            request.error = f"{type(e).__name__}: {e}"
            return self._finish(request, FinishReason.ERROR)
        with self._cv:  # from the queue's count to the slots', at once (submit counts both)
            self._admitting -= 1
            self._running[slot] = running
        try:
            out = self._rows.admit(slot, request.prompt, every=request.prompt_logprobs is not None)
            if request.prompt_logprobs is not None:  # position i's logits score prompt token i + 1
                request.prompt_scores = [None, *token_logprobs(out.logits[0, :-1], request.prompt[1:],
                                                               request.prompt_logprobs)]
        except Exception as e:  # noqa: BLE001
            return self._fail([slot], e)
        self._next(slot, out.logits[:, -1])

    def _step(self) -> None:
        active = sorted(self._running)
        try:
            out = self._rows.step(self._last[: active[-1] + 1], active)
        except Exception as e:  # noqa: BLE001
            self._fail(active, e)
            return
        self.steps += 1
        for slot in active:
            self._next(slot, out.logits[slot : slot + 1, -1])

    def _next(self, slot: int, logits: np.ndarray) -> None:
        try:
            self._sample(slot, logits)
        except Exception as e:  # noqa: BLE001: its sampler or its front end's stop failed: this request only
            if slot in self._running:
                self._fail([slot], e)

    def _sample(self, slot: int, logits: np.ndarray) -> None:
        """Sample the slot's next token from its logits (1, V); tell the front end; maybe leave."""
        r = self._running[slot]
        policy, request, raw = r.policy, r.request, logits
        for process in request.processors:
            logits = process(logits, policy.tokens)
        token = int(r.sampler(logits, policy.seen, [0], 1)[0])
        scored = None if request.logprobs is None else token_logprobs(raw, [token], request.logprobs)[0]
        if not policy.add(token):  # EOS: not kept, but its log-probability is told with the finish (lm-eval reads it)
            return self._leave(slot, policy.finish_reason, scored)
        self._last[slot] = token
        self._tell(request, TokenEvent(0, token, None, scored))
        if policy.finished():
            self._leave(slot, policy.finish_reason)

    def _leave(self, slot: int, reason: FinishReason, scored: TokenLogprob | None = None) -> None:
        request = self._running.pop(slot).request
        self._rows.free(slot)
        self._finish(request, reason, scored)

    def _fail(self, slots: list[int], error: Exception) -> None:
        log.error("the batcher failed a step of %d request(s)", len(slots), exc_info=error)
        for slot in slots:
            self._running[slot].request.error = f"{type(error).__name__}: {error}"
            self._leave(slot, FinishReason.ERROR)

    def _finish(self, request: Request, reason: FinishReason, scored: TokenLogprob | None = None) -> None:
        request.finish_reason = reason
        with self._cv:  # cancel() finishes a queued request on its caller's thread
            self.finished[reason] += 1
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
