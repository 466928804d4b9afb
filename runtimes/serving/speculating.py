"""Serving's speculation: the batcher's proposer over its slots (prompt lookup, or a draft model in
`Slots` of its own, slot i drafting for the request in the batcher's slot i, every guessing slot in
one batched step: runtimes/decoding/speculative.py), a request's opt-out, the scheduler's rule
(runtimes/serving/spec_rule.py, with the costs the loop measures) and the counters. The acceptance
step is each request's `Row.take_verified`, as in `tk generate`: a request's tokens are what they are
without the guesses for a deterministic guess, and keep its distribution for a sampled draft's.
"""

from __future__ import annotations

import time

from tk.runtimes.base import Runtime
from tk.runtimes.decoding.speculative import DraftModel, Proposal, Speculation
from tk.runtimes.serving.run_cost import PRIOR, CostFit
from tk.runtimes.serving.spec_rule import SpeculationRule


class SlotSpeculation:
    """The batcher's speculation over `slots` slots; `fit` holds what the loop's steps cost (the loop
    adds every decode and verify run, this a draft's steps), `rule` what the scheduler asks (its
    costs the fit's, set by the scheduler each step). Counts the guesses `proposed` and `accepted`."""

    def __init__(self, speculation: Speculation, fit: CostFit):
        self.speculation, self.proposer, self.fit = speculation, speculation.proposer, fit
        self.rule = SpeculationRule(PRIOR, batched=False, max_rows=speculation.max_rows)
        self.proposed = self.accepted = 0

    def open(self, runtime: Runtime, slots: int) -> None:
        """Check the loaded target can verify; open the proposer's rows (a draft's slots)."""
        self.speculation.check(runtime)
        self.proposer.open(slots)
        # several slots' verify runs go in one run where the graph takes runs of several rows over a past
        # (the portable graph; the fused one's attention takes them one row a run)
        self.rule.batched = runtime.row_views and not runtime.layout.fused
        self.rule.leading = runtime.row_views  # (the decode run's and a batched verify run's rows)

    def close(self) -> None:
        self.proposer.close()
        if isinstance(self.proposer, DraftModel):  # the batcher loaded it; nobody else holds it
            self.proposer.runtime.deactivate()

    @property
    def cheap(self) -> bool:
        """Guessing costs no run (prompt lookup): the loop guesses before each plan."""
        return not isinstance(self.proposer, DraftModel)

    def begin(self, slot: int, request) -> None:
        self.proposer.begin(slot, request.prompt, request.sampling)

    def room(self, runtime: Runtime, request, written: int, tokens: int) -> int:
        """The most guesses the request's next step may verify (0: it opted out)."""
        if not request.speculate:
            return 0
        return max(0, self.speculation.room(runtime, written, request.max_new_tokens - tokens))

    def propose(self, slots: list[int], texts: list[list[int]], ks: list[int]) -> list[Proposal]:
        tick = time.perf_counter()
        out = self.proposer.propose(slots, texts, ks)
        if isinstance(self.proposer, DraftModel):
            self.fit.add_draft(max((len(p.tokens) for p in out), default=0), time.perf_counter() - tick)
        return out

    def verdict(self, slot: int, guessed: int, kept: int) -> None:
        self.proposed += guessed
        self.accepted += kept
        self.rule.planned += guessed  # the prior of the next requests
        self.rule.accepted += kept
        self.proposer.accept(slot, kept)
