"""Serving's speculation rule: which decoding requests verify guesses in a step, and how many. Pure,
like the scheduler that asks it (tests/test_scheduler.py feeds it numbers).

A step that speculates trades one run for several: each guessing request's verify run (its last
token and k guesses, k + 1 tokens charged to the step's budget, as vLLM charges num_tokens_with_spec)
beside the decode run of the others, and a draft model's batched steps. Rows verified in one run are
padded to the longest (`width`), and where a run takes the cache's leading rows the slots below its
highest that sit it out are computed too (`rows`): a run costs the rectangle, which is what the loop records. Whether that pays depends on
what a run costs here, so the loop measures it (runtimes/serving/run_cost.py: seconds = fixed +
per_token * tokens, fitted over its recent runs); a request's guesses are worth what it
accepted of the guesses planned for it so far (`acceptance`, starting from the batcher's own
acceptance so far, worth PRIOR_WEIGHT guesses, and at least EXPLORE until it has guessed once). Where the proposer is cheap (prompt lookup) the loop
proposes before the plan, so a request's `room` is the guesses it has, and one with none is not
charged. The rule takes the set of guessing requests (the best first) whose step
yields the most tokens per second, R + sum(a_i k_i) over the step's cost, and none where none beats
plain decoding: with few rows the weights read dominates and a verify run is almost free, with many
(or with requests whose guesses miss) the extra runs cost more than they save, and the step does not
guess. Where the step's verify run would be wider than any the fit measured lately (RunCost.widest),
the fit's line is a guess there, so the step verifies the guesses of the requests that keep at least
half of theirs (one of them where each verifies in a run of its own): that run is measured, and the
fit decides from then on. Where several requests verify in one run, each verifies at most
BATCH_GUESSES of its guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tk.runtimes.serving.run_cost import RunCost

PRIOR_WEIGHT = 8  # a request starts at the batcher's acceptance so far (0.5 before any), worth 8 planned guesses
# ... and at least this before it has guessed: whether a request's guesses land is its own (a copying answer's
# do, a free one's do not), so one request's misses must not stop every later one from ever trying
EXPLORE = 0.5
# several rows' guesses verified in one run: each row's at most this many. A lone row's run reads the weights
# for its guesses, and a long copy pays (the real 0.5B copying code alone: 12.7 tokens a run at k = 16, 1.33x
# the speed at 8); in a batch each guess costs its compute, and the same copy workload at 8 clients ran at
# 1.35x plain with rows guessing up to 16 against 1.43x at 8 (`--for serve`, three rounds each, paired)
BATCH_GUESSES = 8


@dataclass(frozen=True)
class Guess:
    """A verify run of `seq` this step: its last token and up to `k` guesses (k + 1 tokens charged)."""

    seq: object
    k: int


@dataclass
class SpeculationRule:
    """`batched`: the verify runs of several rows are one run (else each row runs alone: the fused
    graph's attention takes a run over a past one row a batch); `leading`: a run of several slots
    computes the leading rows up to the highest of them (views of the cache's first rows on a CPU),
    so a slot below it that sits the run out costs its compute too; `max_rows`: no guessing while more
    requests decode (vLLM's disable_by_batch_size; None: the cost alone decides); `cost` is the loop's
    latest fit (CostFit.cost)."""

    cost: RunCost
    batched: bool = False
    leading: bool = False
    max_rows: int | None = None
    accepted: int = 0  # over every request so far: the prior of a new one
    planned: int = 0

    def acceptance(self, seq) -> float:
        prior = (self.accepted + 1) / (self.planned + 2)
        if not seq.planned:  # nothing of its own yet: tried at least once, then its own record decides
            prior = max(prior, EXPLORE)
        return (seq.accepted + PRIOR_WEIGHT * prior) / (seq.planned + PRIOR_WEIGHT)

    def seconds(self, plain: Sequence[int], guessing: Sequence[int], ks: Sequence[int]) -> float:
        """A step's runs: the decode run of the `plain` slots, the verify runs of the `guessing` slots
        (`ks` their guesses), the draft's steps."""
        c = self.cost
        verify = c.run(self.width(guessing, ks)) if self.batched else sum(c.run(k + 1) for k in ks)
        return c.run(self.rows(plain)) + verify + c.draft * max(ks, default=0)

    def rows(self, slots: Sequence[int]) -> int:
        """The rows a run of these slots computes: up to the highest of them where runs take leading rows."""
        return (max(slots) + 1 if self.leading else len(slots)) if slots else 0

    def width(self, slots: Sequence[int], ks: Sequence[int]) -> int:
        """The tokens the verify run of these slots' guesses computes, as the loop records it: batched
        (two rows or more), every row padded to the longest (the run is a rectangle, rows x (max k + 1),
        whatever the budget is charged); else each row's run of its own (one row's view), the widest."""
        if not ks:
            return 0
        return self.rows(slots) * (max(ks) + 1) if self.batched and len(ks) > 1 else max(ks) + 1

    def plan(self, decoding: Sequence, spare: int | None = None) -> list[Guess]:
        """The guesses of this step among the `decoding` requests (each `room` > 0 may guess that many),
        within `spare` extra tokens of the step's budget (None: any)."""
        R = len(decoding)
        if self.max_rows is not None and R > self.max_rows:
            return []
        guessing = [s for s in decoding if s.room > 0]
        cap = BATCH_GUESSES if self.batched and len(guessing) > 1 else None
        rooms = [(s, min(s.room, cap or s.room)) for s in guessing]  # (each row's guesses this step)
        ranked = sorted(rooms, key=lambda p: -self.acceptance(p[0]) * p[1])
        slots = [s.slot for s in decoding]
        best, best_rate, chosen, gain, ks = 0, R / self.seconds(slots, [], []), [], 0.0, []
        for seq, k in ranked:
            if spare is not None and sum(ks) + k > spare:
                continue
            chosen.append(seq)
            ks.append(k)
            gain += self.acceptance(seq) * k
            picked = {s.slot for s in chosen}
            rate = (R + gain) / self.seconds([s for s in slots if s not in picked], sorted(picked), ks)
            if rate > best_rate:
                best, best_rate = len(chosen), rate
        if not best and self.cost.widest is not None:  # a run wider than the fit measured lately: measure one
            sure = [i for i, seq in enumerate(chosen) if self.acceptance(seq) >= EXPLORE]
            sure = sure if self.batched else sure[:1]  # (runs of their own: one row's measures what a row's costs)
            if self.width([chosen[i].slot for i in sure], [ks[i] for i in sure]) > self.cost.widest:
                return [Guess(chosen[i], ks[i]) for i in sure]
        return [Guess(seq, k) for seq, k in zip(chosen[:best], ks)]
