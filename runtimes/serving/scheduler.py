"""Serving's scheduler: which requests hold slots, and what each step computes. Pure: no model, no
thread, no clock (tests/test_scheduler.py drives it alone, as vLLM's tests/v1/core/test_scheduler.py
drives vLLM's).

A request (`Seq`) waits in a queue, takes a free slot (the lowest), prefills its prompt, decodes,
and ends; or it is aborted at any of those. Each `schedule()` returns a `StepPlan` within its
`BatcherLimits`: a budget of `step_tokens` tokens (None: the decode tokens plus `chunk_tokens` for
each prompt coming in, or more where the loop's measured costs (`costs`) say the step's own runs take
long: STALL below), first one token for every decoding request (decode first, as
onnxruntime-genai's AllocateDecodeFirstTokenBudget and vLLM's scheduler do), then prefill chunks
of the prompts already in slots, oldest first, then new admissions while slots and budget last.
With a `SpeculationRule`, decoding requests whose next step may verify guesses (`Seq.room`) are
planned as `Guess`es, k + 1 tokens each out of the same budget (vLLM's num_tokens_with_spec), where
the rule's measured costs say the step gains by them (runtimes/serving/spec_rule.py); with a fixed
`step_tokens` their guesses take what the decode tokens and the prompts coming in leave.
So a long prompt is prefilled a chunk per step while the running requests keep decoding. A step
in which no request decodes has nobody to keep waiting: its budget is `idle_tokens` (at least
`step_tokens`), without a fixed `step_tokens` for each prompt coming in (a burst's prompts go in
together, their first chunks in one run: runtimes/serving/prefilling.py, and then decode together);
so is one in which more prompts are coming in than requests decode (a burst arriving over a few
steps, rather than a trickle beside one stream). `chunked` False (a backend that cannot continue a prompt part way:
Slots.chunk_problem) prefills each prompt whole in the step that admits it, over budget if it
must. With a `PrefixCache`, an admitted prompt first takes the longest cached prefix of its own
tokens (`Seq.cached`, for the loop to copy into its slot) and prefills only the rest; a prompt
whose first block is not cached yet but is that of a prompt still prefilling waits for it (and the
queue behind it), to take what that one computes rather than compute it again beside it (a burst
of requests that share a system prompt).

The loop (runtimes/serving/batching.py) runs the plan, then tells the scheduler what happened:
`advance(chunk)` after a chunk ran (its last one makes the request decode) and `finish(seq)` when
a request ends (EOS, a stop, its budget, an error), which frees its slot. There is no preemption:
a static cache reserves each slot's whole context up front, so a request that holds a slot can
always finish; what cannot get a slot waits, and beyond `max_queue` waiting, `add` refuses
(QueueFull, HTTP 429). Not thread-safe: the batcher calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Sequence

from tk.runtimes.errors import InputError, RuntimeProblem
from tk.runtimes.serving.prefix_cache import PrefixCache
from tk.runtimes.serving.run_cost import Costs
from tk.runtimes.serving.spec_rule import Guess, SpeculationRule


class QueueFull(RuntimeProblem):
    """Every slot is busy and the queue is full: retry later (HTTP 429)."""


class State(str, Enum):
    WAITING = "waiting"  # in the queue
    PREFILL = "prefill"  # in a slot, its prompt part way into the cache
    DECODE = "decode"  # in a slot, one token per step
    DONE = "done"  # ended (finished or aborted); its slot is free


@dataclass(eq=False)
class Seq:
    """One request as the scheduler sees it. `request` is the caller's (opaque here)."""

    prompt: Sequence[int]
    request: Any = None
    reuse: bool = True  # may start from a cached prefix (False: it needs every prompt position's logits)
    state: State = State.WAITING
    slot: int | None = None
    computed: int = 0  # prompt tokens in its slot's cache
    reused: int = 0  # of which came from the prefix cache
    cached: list = field(default_factory=list)  # the matched prefix's payloads, until the loop copies them
    aborted: bool = False
    head: bytes | None = None  # its first block's name in the prefix cache (b"": shorter than a block)
    room: int = 0  # decoding: the most guesses its next step may verify (0: it does not speculate)
    planned: int = 0  # guesses planned for it so far (each a verified position it was charged)
    accepted: int = 0  # of which the target accepted


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens start .. end - 1 of `seq` to prefill this step; the last one ends its prefill."""

    seq: Seq
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.seq.prompt)


@dataclass
class StepPlan:
    left: list[Seq] = field(default_factory=list)  # aborted in a slot: the loop frees the row and ends them
    admitted: list[Seq] = field(default_factory=list)  # took a slot this step (a cached prefix to copy first)
    decode: list[Seq] = field(default_factory=list)  # one token each
    verify: list[Guess] = field(default_factory=list)  # decoding requests that guess this step instead
    prefill: list[Chunk] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(g.k + 1 for g in self.verify) + sum(c.end - c.start for c in self.prefill)


# A step's budget is one decode token for each running request, then prefill chunks. Its runs are one
# decode run (and the guessing requests' verify runs) and the chunks' runs, so while a prompt comes in a
# stream waits its step plus a chunk: on CPUs the decode step costs about what reading the weights does,
# whatever the rows, and a chunk that plus its tokens' compute. So by default a step takes, beside its
# decode and verify tokens, CHUNK_TOKENS for each prompt coming in or, where the loop has measured its
# runs (runtimes/serving/run_cost.py), the prompt tokens whose run costs STALL times what the step's
# decode and verify runs cost, whichever is more: a prompt coming in at most doubles a stream's gap, and
# comes in faster beside a costlier step (several rows' verify runs) rather than a few tokens each of many
# slow steps (beside a plain decode step, a chunk's own weights read leaves it CHUNK_TOKENS). A step in
# which nobody decodes (nobody waits) takes IDLE_TOKENS.
STALL = 1.0
CHUNK_TOKENS = 16
IDLE_TOKENS = 512
GATHER_S = 0.1  # the most an idle loop waits for requests that are arriving (runtimes/serving/batching.py: Arrivals)
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class BatcherLimits:
    """Serving's limits, checked once here (InputError, one line): `slots` requests run at once and
    `max_queue` wait; a step computes `step_tokens` (None: its decode tokens plus `chunk_tokens` for
    each prompt coming in), or `idle_tokens` where nobody decodes; `prefix_cache_bytes` of cached
    prefixes (0: none); an idle loop waits up to `gather_s` for requests the front end is reading."""

    slots: int = 8
    max_queue: int = 64
    step_tokens: int | None = None
    chunk_tokens: int = CHUNK_TOKENS
    idle_tokens: int = IDLE_TOKENS
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    gather_s: float = GATHER_S

    def __post_init__(self):
        if self.slots < 1 or self.max_queue < 0:
            raise InputError(f"slots must be >= 1 and the queue >= 0, got {self.slots} and {self.max_queue}")
        if self.step_tokens is not None and self.step_tokens < self.slots:
            raise InputError(f"a step's budget of {self.step_tokens} tokens is less than one decode token for each "
                             f"of the {self.slots} slots; give at least {self.slots}")
        if self.chunk_tokens < 1 or min(self.idle_tokens, self.prefix_cache_bytes, self.gather_s) < 0:
            raise InputError(f"a chunk takes >= 1 token and the idle budget, prefix cache and gathering >= 0, got "
                             f"{self.chunk_tokens}, {self.idle_tokens}, {self.prefix_cache_bytes} and {self.gather_s}")


class Scheduler:
    def __init__(self, limits: BatcherLimits, *, chunked: bool = True, prefix: PrefixCache | None = None,
                 speculation: SpeculationRule | None = None, costs: Costs | None = None):
        """`chunked` False: each prompt is prefilled whole, in the step that admits it; `speculation`:
        which decoding requests verify guesses each step (None: none); `costs`: what the loop's runs
        cost, as it measures them (None: not measured; the budget counts tokens only)."""
        self.limits, self.chunked, self.speculation, self.costs = limits, chunked, speculation, costs
        self.idle_tokens = max(limits.step_tokens or limits.chunk_tokens, limits.idle_tokens)
        self.prefix = prefix if chunked else None  # a cached prefix is useless where a prompt cannot continue
        self.waiting: deque[Seq] = deque()
        self.running: dict[int, Seq] = {}  # slot -> its request (prefilling or decoding)
        self._prefilling: list[Seq] = []  # in slots, prefilling, oldest first

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, seq: Seq) -> None:
        slots, max_queue = self.limits.slots, self.limits.max_queue
        if len(self.running) + len(self.waiting) >= slots + max_queue:
            raise QueueFull(f"all {slots} slots are busy and the queue of {max_queue} is full; retry later")
        seq.state = State.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Seq) -> bool:
        """End a request. True: it was waiting and is gone now (the caller ends it); False: it leaves
        its slot in the next plan (`StepPlan.left`), or it had ended already."""
        if seq.state is State.WAITING:
            self.waiting.remove(seq)
            seq.state = State.DONE
            return True
        if seq.state is not State.DONE:
            seq.aborted = True
        return False

    def abort_all(self) -> list[Seq]:
        """Abort everything: returns the waiting requests, gone now; those in slots leave in the next plan."""
        gone = list(self.waiting)
        for seq in gone:
            self.abort(seq)
        for seq in self.running.values():
            seq.aborted = True
        return gone

    def finish(self, seq: Seq) -> None:
        """A request in a slot ended: the slot is free for the next plan."""
        if seq.state in (State.PREFILL, State.DECODE):
            del self.running[seq.slot]
            if seq in self._prefilling:
                self._prefilling.remove(seq)
        seq.state, seq.cached = State.DONE, []

    def advance(self, chunk: Chunk) -> None:
        """A planned chunk ran: its tokens are in the cache; after the last, the request decodes."""
        seq = chunk.seq
        if seq.state is not State.PREFILL:
            return  # it ended (failed) during the step
        seq.computed = chunk.end
        if chunk.last:
            seq.state = State.DECODE
            self._prefilling.remove(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for seq in [s for s in self.running.values() if s.aborted]:
            self.finish(seq)
            plan.left.append(seq)
        plan.decode = [self.running[slot] for slot in sorted(self.running) if self.running[slot].state is State.DECODE]
        coming = len(self._prefilling) + min(len(self.waiting), self.limits.slots - len(self.running))
        fixed, streams, cost = self.limits.step_tokens, len(plan.decode), self.costs.steps.cost if self.costs else None
        # nobody waits on the step: idle_tokens (a prompt coming in each, where the budget is not fixed)
        idle = self.idle_tokens * (max(1, coming) if fixed is None else 1)
        if not plan.decode:
            budget = idle
        else:
            chunks = self.limits.chunk_tokens * max(1, coming)
            if self.speculation is not None:  # guesses out of what the prompts coming in leave
                if cost is not None:
                    self.speculation.cost = cost
                spare = None if fixed is None else fixed - streams - (chunks if coming else 0)
                plan.verify = self.speculation.plan(plan.decode, spare)
                guessing = {id(g.seq) for g in plan.verify}
                plan.decode = [seq for seq in plan.decode if id(seq) not in guessing]
            if fixed is not None:
                budget = fixed - plan.tokens
            elif coming > streams:  # more wait than stream: prompts first
                budget = max(chunks, idle)
            else:  # a chunk run that costs STALL times the step's own runs, where measured
                budget = max(chunks, min(idle, self._stall_tokens(plan, cost)))
        for seq in self._prefilling:
            budget -= self._chunk(plan, seq, budget)
        free = sorted(set(range(self.limits.slots)) - set(self.running))
        while self.waiting and free and budget > 0 and not self._shares_a_pending_prefix(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.slot, seq.state = free.pop(0), State.PREFILL
            if self.prefix is not None and seq.reuse:
                seq.cached = self.prefix.match(seq.prompt, len(seq.prompt) - 1)
                seq.computed = seq.reused = len(seq.cached) * self.prefix.block
            self.running[seq.slot] = seq
            self._prefilling.append(seq)
            plan.admitted.append(seq)
            budget -= self._chunk(plan, seq, budget)
        return plan

    def _stall_tokens(self, plan: StepPlan, cost) -> int:
        """The prompt tokens whose run costs STALL times what the step's decode and verify runs cost (the
        prompt chunks' own fit: a chunk's run reads the weights too; a plain decode step's cost is the
        last one's, measured), in whole chunk_tokens (the runs' shapes stay few: ONNX Runtime keeps a
        memory plan for each)."""
        if self.costs is None or (chunk := self.costs.prompts.cost).per_token <= 0:
            return 0
        plain, guessing = [s.slot for s in plan.decode], [g.seq.slot for g in plan.verify]
        runs = (self.speculation.seconds(plain, guessing, [g.k for g in plan.verify]) if plan.verify
                else self.costs.decode or cost.run(len(plain)))  # (a plain step's: what the last one measured)
        step = self.limits.chunk_tokens
        return max(0, int((STALL * runs - chunk.fixed) / chunk.per_token)) // step * step

    def _head(self, seq: Seq) -> bytes:
        if seq.head is None:
            seq.head = next(iter(self.prefix.names(seq.prompt, 1)), b"")
        return seq.head

    def _shares_a_pending_prefix(self, seq: Seq) -> bool:
        """Its first block is one a prompt still prefilling will put in the prefix cache (not there yet)."""
        if self.prefix is None or not seq.reuse or not self._head(seq) or seq.head in self.prefix:
            return False
        return any(self._head(other) == seq.head for other in self._prefilling)

    def _chunk(self, plan: StepPlan, seq: Seq, budget: int) -> int:
        """Plan the next chunk of a prefilling request within `budget` -> the tokens it takes."""
        left = len(seq.prompt) - seq.computed
        n = min(left, budget) if self.chunked else (left if budget > 0 else 0)
        if n <= 0:
            return 0
        plan.prefill.append(Chunk(seq, seq.computed, seq.computed + n))
        return n
