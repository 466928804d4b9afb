"""Serving's speculation: which running requests guess, and what (`SlotSpeculation`, the batcher's),
and a draft model's slots beside the batcher's (`SlotDraft`).

Slot i of the draft drafts for the request in the batcher's slot i. Its cache catches up lazily on
what it has not run (a new request's whole prompt the first time, in runs of the decode graph's
largest; then the target's token and the guess it drafted without running), drafts up to k tokens
greedily (while it is sure of them: `DraftModel`'s p_min), and keeps what the target kept. Greedy guesses are deterministic, so the batcher's rule
(take the request's own token at each verified position while it equals the guess) is speculative
sampling's for them: a request's tokens are what they are without the draft, sampled ones too.
"""

from __future__ import annotations

import numpy as np

from tk.runtimes.base import InputError, Runtime
from tk.runtimes.decoding.speculative import P_MIN, DraftModel, PromptLookup, Speculation, confidence
from tk.runtimes.serving.slots import Slots


class SlotDraft:
    """`count` draft slots over a draft runtime (activated at `open`); `propose(slot, key, text, k)`
    where `key` names the request (a new one starts the slot over), then `accepted(slot, kept)`."""

    def __init__(self, runtime: Runtime, count: int, vocab_size: int, p_min: float = P_MIN):
        if problem := runtime.verify_problem:
            raise InputError(f"the draft: {problem}")
        self.runtime, self.count, self.vocab_size, self.p_min = runtime, count, vocab_size, p_min
        self.slots: Slots | None = None
        self.keys: list[object] = [None] * count  # the request each slot drafts for
        self.held = [0] * count  # per slot, the positions of its cache that are its request's text
        self.guessed = [0] * count  # per slot, how many guesses its last proposal made

    def open(self) -> "SlotDraft":
        self.runtime.activate()
        self.slots = Slots(self.runtime, self.count)
        return self

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None
        self.runtime.deactivate()

    def _best(self, logits: np.ndarray) -> int:
        """The draft's greedy guess among the target's vocabulary."""
        return int(np.argmax(logits[: self.vocab_size]))

    def propose(self, slot: int, key: object, text: list[int], k: int) -> list[int]:
        slots, layout = self.slots, self.runtime.layout
        if self.keys[slot] is not key:
            self.keys[slot], self.held[slot] = key, 0
        L, held = len(text), self.held[slot]
        if k <= 0 or L + k >= layout.capacity:  # (no catch-up ran: what the slot holds stays as it was)
            self.guessed[slot] = 0
            return []
        s = slots.session
        s.mask[slot, :L] = 1
        out = layout.prefill_row(s, slot, np.asarray([text[held:]], dtype=np.int64), at=held)
        slots.rewind(slot, L)
        logits, guesses = out.logits[0, -1], []
        tokens = np.zeros(slot + 1, dtype=np.int64)
        while len(guesses) < k and confidence(logits[None, : self.vocab_size])[0] >= self.p_min:
            guesses.append(self._best(logits))
            if len(guesses) < k:
                tokens[slot] = guesses[-1]
                logits = slots.step(tokens, [slot]).logits[slot, -1]
        self.held[slot], self.guessed[slot] = L, len(guesses)
        return guesses

    def accepted(self, slot: int, kept: int) -> None:
        """The target kept `kept` of the slot's last guesses: its cache ran every guess but the last."""
        self.held[slot] += min(kept, max(self.guessed[slot] - 1, 0))


class SlotSpeculation:
    """The batcher's speculation: prompt lookup, or a draft model in slots of its own; off while more
    requests decode than `max_rows`. Counts the guesses `proposed` and `accepted`."""

    def __init__(self, speculation: Speculation):
        if not isinstance(speculation.proposer, (PromptLookup, DraftModel)):
            raise InputError(f"the batcher speculates with prompt lookup or a draft model, not {speculation.proposer.name}")
        self.speculation, self.draft = speculation, None
        self.proposed = self.accepted = 0

    def open(self, runtime: Runtime, slots: int) -> None:
        """Check the loaded target can verify; open the draft's slots (a draft model)."""
        self.speculation.check(runtime)
        if isinstance(draft := self.speculation.proposer, DraftModel):
            self.draft = SlotDraft(draft.runtime, slots, runtime.dims.vocab_size, draft.p_min).open()

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()

    def guesses(self, running: dict, slots: list[int], room: dict[int, int], fail) -> dict[int, list[int]]:
        """Each speculating slot's guesses (none where more than max_rows decode, or none found): `running`
        maps a slot to its `Running`, `room[slot]` the most guesses it may take; `fail(seq, error)` fails one."""
        spec = self.speculation
        if spec.max_rows is not None and len(slots) > spec.max_rows:
            return {}
        slots = [slot for slot in slots if running[slot].request.speculate]
        texts = [[*running[slot].request.prompt, *running[slot].policy.tokens] for slot in slots]
        ks = [room[slot] for slot in slots]
        if self.draft is None:
            return {slot: g.tokens for slot, g in zip(slots, spec.proposer.propose(texts, ks)) if g.tokens}
        out = {}
        for slot, text, k in zip(slots, texts, ks):  # each slot's draft in runs of its own
            try:
                out[slot] = self.draft.propose(slot, running[slot].request, text, k)
            except Exception as e:  # noqa: BLE001: this request fails; the others go on
                fail(running[slot].seq, e)
        return {slot: g for slot, g in out.items() if g}

    def verdict(self, slot: int, guessed: int, kept: int) -> None:
        self.proposed += guessed
        self.accepted += kept
        if self.draft is not None:
            self.draft.accepted(slot, kept)
