"""The batcher's steps: one `StepPlan` of the scheduler run on the `Slots`, on the batcher's thread.

Each request in its slot is an `Occupant`: its scheduler `Seq`, its `Request` and its `Row`
(runtimes/decoding/row.py: its own sampler, processors, policy and log-probabilities, the row
`tk generate` runs), its prompt's ids and the prefix cache's count of its blocks. A step frees the
slots of the requests that left, lets the admitted in (a cached prefix copied into the slot), runs
one decode run of the decoding requests that do not guess, lets a proposer guess for those that do
(a draft model drafts all of them in one batched step a guess) and verifies each request's guesses
in one run (`Row.take_verified`, then one rewind to what it kept), and runs the prompt chunks
(runtimes/serving/prefilling.py: prompts that came in together, in one run where the graphs allow). A
request's events go to the batcher (`tell`, `leave`); a request whose row, sampler, processors or
front end fail fails alone. Every run is timed (`costs`: runtimes/serving/run_cost.py) for the
scheduler's prompt chunks and the speculation rule.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from tk.runtimes.base import Runtime
from tk.runtimes.decoding.logits import TokenLogprob
from tk.runtimes.decoding.row import Row, drain
from tk.runtimes.decoding.rows import FinishReason, TokenEvent
from tk.runtimes.serving.prefilling import Prefilling
from tk.runtimes.serving.prefix_store import PrefixStore
from tk.runtimes.serving.run_cost import Costs
from tk.runtimes.serving.scheduler import Seq, State, StepPlan
from tk.runtimes.serving.spec_rule import Guess
from tk.runtimes.serving.speculating import SlotSpeculation
from tk.runtimes.slots import Slots


class Occupant:
    """A request in its slot."""

    __slots__ = ("seq", "request", "row", "ids", "stored", "proposal")

    def __init__(self, seq: Seq, eos_ids: frozenset, vocab_size: int):
        request = self.request = seq.request
        self.seq, self.ids, self.stored, self.proposal = seq, None, 0, None
        self.row = Row(request.prompt, request.max_new_tokens, request.sampling, vocab_size=vocab_size,
                       eos_ids=eos_ids, ignore_eos=request.ignore_eos, processors=request.processors,
                       logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs, stop=request.stop)
        request.tokens = self.row.tokens

    @property
    def slot(self) -> int:
        return self.seq.slot


class Steps(Prefilling):
    """Runs plans on `slots`; `tell(request, event)` hands a request's event to its front end,
    `advanced(chunk)` tells the scheduler a chunk ran, `ended(seq, reason, scored)` ends a request that
    left its slot (the batcher's bookkeeping); failures are logged to `log`; `costs` hears every run."""

    def __init__(self, runtime: Runtime, slots: Slots, eos: frozenset, *, store: PrefixStore | None,
                 speculating: SlotSpeculation | None, costs: Costs, tell: Callable, advanced: Callable, ended: Callable,
                 log):
        self.runtime, self.slots, self.eos, self.store, self.spec = runtime, slots, eos, store, speculating
        self.costs = costs
        self.tell, self.advanced, self.ended, self.log = tell, advanced, ended, log
        self.running: dict[int, Occupant] = {}  # slot -> its request
        self.last = np.zeros(slots.count, dtype=np.int64)  # each slot's last token: the next step's input
        self.steps = self.prefill_tokens = 0

    def run(self, plan: StepPlan) -> None:
        for seq in plan.left:
            self._leave(seq, FinishReason.CANCELLED)
        for seq in plan.admitted:
            self._enter(seq)
        self._decode(plan.decode, plan.verify)
        self.prefill(plan.prefill)
        if self.spec is not None:
            self._rooms()

    def _rooms(self) -> None:
        """What each decoding request may guess next step (`Seq.room`): where the proposer is cheap
        (prompt lookup), its guesses are made now and the room is how many it has."""
        decoding = [r for r in self.running.values() if r.seq.state is State.DECODE]
        for r in decoding:
            r.seq.room = self.spec.room(self.runtime, r.request, self.slots.written(r.slot), len(r.row.tokens))
        if self.spec.cheap:
            asked = [r for r in decoding if r.seq.room > 0]
            try:
                proposals = self.spec.propose([r.slot for r in asked], [[*r.row.prompt, *r.row.tokens] for r in asked],
                                              [r.seq.room for r in asked])
            except Exception as e:  # noqa: BLE001: the proposer failed them; the others go on
                return self.fail([r.seq for r in asked], e)
            for r, p in zip(asked, proposals):
                r.proposal, r.seq.room = p, len(p.tokens)

    def _timed(self, tokens: int, run: Callable, prompt: bool = False, decode: bool = False):
        tick = time.perf_counter()
        out = run()
        if out is not None:  # (None: the run could not go as one, ran nothing, and is no point of the fit)
            self.costs.add(tokens, time.perf_counter() - tick, prompt, decode)
        return out

    def _enter(self, seq: Seq) -> None:
        """A request takes its slot: its row, its cached prefix copied in."""
        cached, seq.cached = seq.cached, []
        try:
            r = self.running[seq.slot] = Occupant(seq, self.eos, self.runtime.dims.vocab_size)
            r.ids = self.slots.begin(seq.slot, seq.request.prompt)
            if cached:
                self.store.enter(r, cached)
            if self.spec is not None:
                self.spec.begin(seq.slot, seq.request)
        except Exception as e:  # noqa: BLE001: this request fails; the batcher and the others go on
            self.fail([seq], e)

    def _decode(self, decode: list[Seq], verify: list[Guess]) -> None:
        guesses = self._guesses(verify)
        plain = sorted([seq.slot for seq in decode] + [g.seq.slot for g in verify if g.seq.slot not in guesses])
        if plain:
            n = plain[-1] + 1
            try:
                out = self._timed(n if self.runtime.row_views else self.slots.count,
                                  lambda: self.slots.step(self.last[:n], plain), decode=True)
            except Exception as e:  # noqa: BLE001
                return self.fail([self.running[slot].seq for slot in plain], e)
            self.steps += 1
            for slot in plain:
                self._take(slot, lambda r: r.row.take(out.logits[slot:slot + 1, -1]))
        if len(guesses) > 1 and self.spec.rule.batched:  # every guessing slot's run in one
            slots = sorted(guesses)
            tokens = np.zeros((len(slots), 1 + max(len(guesses[s].tokens) for s in slots)), np.int64)
            for i, slot in enumerate(slots):
                tokens[i, :1 + len(guesses[slot].tokens)] = [self.last[slot], *guesses[slot].tokens]
            try:
                # (the run computes the leading rows: a slot below the highest that sits it out too)
                logits = self._timed((slots[-1] + 1) * tokens.shape[1], lambda: self.slots.verify_many(slots, tokens))
            except Exception as e:  # noqa: BLE001
                return self.fail([self.running[slot].seq for slot in slots], e)
            if logits is not None:
                self.steps += 1
                for i, slot in enumerate(slots):
                    self._verified(slot, guesses[slot], self.slots.written(slot), logits[i])
                return
        for slot, proposal in guesses.items():
            self._verify(slot, proposal)

    def _guesses(self, verify: list[Guess]) -> dict:
        """The planned requests' guesses, proposed together (a request with none decodes plainly)."""
        if not verify:
            return {}
        slots = [g.seq.slot for g in verify]
        if self.spec.cheap:  # made after the last step (_rooms), and as many as the plan verifies
            proposals = [self.running[g.seq.slot].proposal.first(g.k) for g in verify]
        else:
            texts = [[*self.running[s].row.prompt, *self.running[s].row.tokens] for s in slots]
            try:
                proposals = self.spec.propose(slots, texts, [g.k for g in verify])
            except Exception as e:  # noqa: BLE001: the proposer failed them; the others go on
                self.fail([g.seq for g in verify], e)
                return {}
        for g, p in zip(verify, proposals):
            g.seq.planned += g.k
        return {slot: p for slot, p in zip(slots, proposals) if p.tokens}

    def _verify(self, slot: int, proposal) -> None:
        """One run checks the slot's guesses; its row takes its tokens (`Row.take_verified`) and the slot
        keeps what it accepted (one rewind)."""
        r, at, guesses = self.running[slot], self.slots.written(slot), proposal.tokens
        try:
            logits = self._timed(len(guesses) + 1, lambda: self.slots.verify(slot, [int(self.last[slot]), *guesses]))
        except Exception as e:  # noqa: BLE001
            return self.fail([r.seq], e)
        self.steps += 1
        self._verified(slot, proposal, at, logits)

    def _verified(self, slot: int, proposal, at: int, logits: np.ndarray) -> None:
        """The slot's row takes a verify run's tokens; the slot keeps what it accepted (one rewind)."""
        r, guesses = self.running[slot], proposal.tokens
        logits = logits[:len(guesses) + 1]
        accepted = self._take(slot, lambda r: r.row.take_verified(logits, guesses, proposal.probs)) or 0
        r.seq.accepted += accepted
        self.spec.verdict(slot, len(guesses), accepted)
        if self.running.get(slot) is r:
            self.slots.rewind(slot, at + 1 + accepted)  # the last token, and the guesses kept

    def _take(self, slot: int, take: Callable):
        """The request in `slot` takes its token(s) (`take(occupant)` -> the row's events): each told to
        its front end, its finish ending it -> what the take returned (None where it failed)."""
        r = self.running[slot]

        def hear(event: TokenEvent) -> None:
            if event.token is None:
                return self._leave(r.seq, event.finish_reason, event.logprob)
            self.last[slot] = event.token
            self.tell(r.request, event)
        try:
            return drain(take(r), hear)
        except Exception as e:  # noqa: BLE001: its sampler or its front end's stop failed: this request only
            if self.running.get(slot) is r:
                self.fail([r.seq], e)

    def _leave(self, seq: Seq, reason: FinishReason, scored: TokenLogprob | None = None) -> None:
        """The request leaves its slot (a completed one's generated blocks kept for the next turn)."""
        r = self.running.pop(seq.slot, None)
        if r is not None and reason.completed and self.store is not None:
            self.store.leave(r)
        self.slots.free(seq.slot)
        self.ended(seq, reason, scored)

    def fail(self, seqs: list[Seq], error: Exception) -> None:
        self.log.error("the batcher failed a step of %d request(s)", len(seqs), exc_info=error)
        for seq in [s for s in seqs if s.state is not State.DONE]:
            seq.request.error = f"{type(error).__name__}: {error}"
            self._leave(seq, FinishReason.ERROR)
