"""Slots: the rows of a static-capacity cache as places that requests (serving's) or rows (a draft
model's, beside any loop) take and leave.

`Slots(runtime, count)` opens one session of `count` empty rows on an active runtime whose export
has a static cache (`slots_problem` says why one cannot hold them). A prompt takes a free row
(`begin`), may get cached positions copied in (`load` of what `read` copied out), and comes in by
chunks (`prefill(slot, ids, start, end)`, or `admit` for all of it at once): its first chunk alone
as `tk generate` of it would prefill it (batch 1, no padding), later ones through the decode graph
at the row's write index (`chunk_problem` says where a backend cannot). `step(tokens, active)`
decodes the busy rows together, each at its own length and write index, and computes only up to
the last busy one where the backend views a buffer's leading rows (`Runtime.row_views`; ORT on
CUDA runs every row); `free(slot)` empties a row, which keeps one visible position (0) and
rewrites it: its throwaway row computes no NaN and touches no live row. `extend(slot, ids, at)` runs
more of a slot's text from a position on (what a draft model catches up on). A recurrent layer's state (a
hybrid's) has no position to throw away: a slot's state starts at zero when a prompt takes it, and a
taken slot that sits a step out (mid-prompt) gets its state back after the step. `Slots` holds its runtime
and its one session, and drives the static layout's primitives (`StaticLayout.allocate`,
`write_present`, `prefill_row`, `decode`) and the runtime's `CacheBuffers`; which request sits
where, and what each step computes, is the scheduler's and the batcher's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tk.runtimes.base import Runtime, StepOutput, check_token_ids
from tk.runtimes.cache_layouts import prefill, slots_problem
from tk.runtimes.errors import InputError
from tk.runtimes.session import Session


class Slots:
    """`count` slots over an active runtime's static cache; close it (or use `with`) to release them."""

    def __init__(self, runtime: Runtime, count: int):
        runtime._require_active()
        problem = slots_problem(runtime.dims)
        if problem:
            raise InputError(problem)
        if runtime.max_batch is not None and count > runtime.max_batch:
            raise InputError(f"the {runtime.name} backend runs batches of at most {runtime.max_batch}: use --slots "
                             f"{runtime.max_batch}, or rebuild with tk build-engine --max-batch {count}")
        self.runtime, self.layout, self.buffers = runtime, runtime.layout, runtime.buffers
        # the buffers of a recurrent state (a hybrid's: runtimes.cache_layouts), and the slots prompts hold
        self.states = [i for i, kv in enumerate(self.layout.kv) if not kv]
        self.taken: set[int] = set()
        # one session of `count` rows of the capacity buffers (its `length` means nothing here: each
        # row's is its write index)
        mask = np.zeros((count, self.layout.capacity), dtype=np.int64)
        positions, write = np.zeros((count, 1), dtype=np.int64), np.zeros((count,), dtype=np.int64)
        self.session = Session(runtime, self.layout.allocate(count), mask, positions, 0,
                               self.layout.state(mask, positions, write))
        for slot in range(count):
            self.free(slot)

    @property
    def count(self) -> int:
        return self.session.batch

    @staticmethod
    def prompt_logits_problem(runtime: Runtime) -> str | None:
        """Why this runtime cannot give a prompt's every position's logits (None: it can)."""
        if runtime.all_prefill_logits or runtime.row_slices:
            return None
        return (f"this artifact's prefill returns the last position's logits only, and the {runtime.name} backend "
                "cannot run a prompt through its decode graph instead: prompt log-probabilities need an export "
                "with --prefill-logits all")

    @staticmethod
    def chunk_problem(runtime: Runtime) -> str | None:
        """Why this runtime cannot take a prompt part way in (chunked prefill, cached prefixes): None if it can."""
        if not runtime.row_slices:  # (a device buffer's row would need a pointer binding of its own)
            return f"the {runtime.name} backend cannot run one row of its cache buffers alone"
        return None

    def admit(self, slot: int, prompt: Sequence[int], every: bool = False) -> StepOutput:
        """Prefill `prompt` alone into `slot` (which must be free), in one go -> its logits: the last
        position's, or with `every` each position's (1, T, V), even where the artifact's prefill
        returns the last only (`prefill`)."""
        ids = self.begin(slot, prompt)
        return self.prefill(slot, ids, 0, ids.shape[1], every)

    def begin(self, slot: int, prompt: Sequence[int]) -> np.ndarray:
        """A prompt takes the free `slot`, to come in by `load` and `prefill` -> its ids (1, T). Its
        mask covers the prompt (a chunk's queries see only what is written before them: the causal
        mask), and until the prompt is in, a decode step the row sits out writes its throwaway
        position at the next chunk's start (`write`), which that chunk writes again (in a ring too)."""
        ids = np.asarray(prompt, dtype=np.int64).reshape(1, -1)
        check_token_ids(ids, self.runtime.dims.vocab_size)
        self.layout.check_prompt(ids.shape[1])
        s = self.session
        s.mask[slot] = 0
        s.mask[slot, :ids.shape[1]] = 1
        s.positions[slot] = 0
        s.static.write[slot] = 0
        for i in self.states:  # a recurrent state starts at zero (the prompt's first run reads it)
            self.buffers.write_row(s.cache[i], slot)
        self.taken.add(slot)
        return ids

    def prefill(self, slot: int, ids: np.ndarray, start: int, end: int, every: bool = False) -> StepOutput:
        """Prompt positions start .. end - 1 into `slot` (`ids`: the whole prompt, (1, T); 0 .. start - 1
        are in) -> the last one's logits, or with `every` each one's (1, end - start, V); the prompt's
        last chunk leaves the slot ready to decode. A prompt's first chunk runs through the prefill
        graph where the runtime prefills so (the prompt alone: what `tk generate` of it computes), the
        rest through the decode graph (`StaticLayout.prefill_row`, which needs a row of a buffer:
        Runtime.row_slices), one token per run where `every` needs each position's logits and the
        prefill graph cannot give them."""
        rt, s = self.runtime, self.session
        if start == 0 and rt.prefill_via == "prefill" and (rt.all_prefill_logits or not every):
            out, present = prefill(rt, ids[:, :end], np.ones((1, end), dtype=np.int64))
            try:
                self.layout.write_present(s.cache, present, end, row=slot)
            finally:
                self.buffers.release(present)
        else:
            out = self.layout.prefill_row(s, slot, ids[:, start:end], every, at=start)
        self._prefilled(slot, end, ids.shape[1])
        return out

    def prefill_first(self, slots: list[int], prompts: list[np.ndarray], ends: list[int]) -> np.ndarray:
        """A group of StaticLayout.first_groups (which slots' first chunks go in one run): each slot's
        prompt (prompts[i], (1, T_i)) positions 0 .. ends[i] - 1, as `prefill` takes them, in one run
        -> each one's last position's logits (len(slots), V)."""
        logits = self.layout.prefill_first(self.session, slots, [p[0, :end] for p, end in zip(prompts, ends)])
        for slot, p, end in zip(slots, prompts, ends):
            self._prefilled(slot, end, p.shape[1])
        return logits

    def _prefilled(self, slot: int, end: int, length: int) -> None:
        self.session.static.write[slot] = end
        if end == length:  # the prompt is in: the row decodes from its last position
            self.session.positions[slot] = end - 1

    def extend(self, slot: int, ids: Sequence[int], at: int) -> StepOutput:
        """Run `ids` into the taken `slot` at positions at .. at + n - 1, through the decode graph, in
        place of what the slot held from `at` on -> the last one's logits; the slot then holds at + n
        positions and decodes from the last (a draft catching up on the text it has not run)."""
        s, n = self.session, len(ids)
        if at + n >= self.layout.capacity:
            raise InputError(f"a slot's static cache of {self.layout.capacity} positions cannot take {at + n}")
        s.mask[slot, :at + n] = 1
        s.mask[slot, at + n:] = 0
        out = self.layout.prefill_row(s, slot, np.asarray([ids], dtype=np.int64), at=at)
        s.static.write[slot], s.positions[slot] = at + n, at + n - 1
        return out

    def read(self, slot: int, start: int, end: int) -> list:
        """A copy of the slot's cache positions start .. end - 1: one (1, H, n, D) array per cache
        tensor, in the backend's own kind of array, that `load` takes back."""
        return [self.buffers.read_positions(b, slot, start, end) for b in self.session.cache]

    def load(self, slot: int, parts: list[list]) -> int:
        """`read` copies into the slot from position 0, one after another (a prompt's cached prefix)
        -> the positions written."""
        at = 0
        for part in parts:
            n = part[0].shape[2]
            for buf, src in zip(self.session.cache, part):
                self.buffers.copy_positions(buf, src, n, dst_row=slot, src_row=0, dst_at=at)
            at += n
        self.session.static.write[slot] = at
        return at

    def free(self, slot: int) -> None:
        """An empty slot: one visible position (0), so that its throwaway row computes no NaN."""
        s = self.session
        s.mask[slot] = 0
        s.mask[slot, 0] = 1
        s.positions[slot] = 0
        s.static.write[slot] = 0
        self.taken.discard(slot)

    def step(self, tokens, active: list[int]) -> StepOutput:
        """One decode step of the `active` slots, each at its own length; `tokens` (max(active) + 1,)
        holds each active slot's last token (the others' are ignored) -> logits (max(active) + 1 rows,
        or every slot's where the backend cannot view leading rows, 1, V): the rows past the last
        active one are not computed where it can."""
        n = max(active) + 1 if self.runtime.row_views else self.session.batch
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        check_token_ids(tokens, self.runtime.dims.vocab_size)
        rows = np.asarray(active, dtype=np.int64)
        if self.session.static.write[rows].max() >= self.layout.capacity:
            raise InputError(f"decode: a slot's static cache of {self.layout.capacity} positions is full")
        if n == 1 and self.layout.paired(self.session):  # the first slot alone: a run of two (Runs.step_paired)
            if (out := self.layout.step_paired(self.session, 0, int(tokens[0, 0]))) is not None:
                return out
        # a taken slot that sits the step out keeps its recurrent state (the step writes every row's)
        idle = sorted(self.taken.difference(active)) if self.states else []
        kept = [(b, i, self.buffers.read_row(self.session.cache[i], b)) for b in idle if b < n for i in self.states]
        out = self.layout.decode(self.session, tokens, rows, n)
        for b, i, value in kept:
            self.buffers.write_row(self.session.cache[i], b, value)
        return out

    def verify(self, slot: int, tokens: Sequence[int]) -> np.ndarray:
        """The slot's last token and the guesses after it, in one run at its write index -> each
        position's logits (n, V); the slot keeps what `rewind` says (StaticLayout.verify)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
        check_token_ids(ids, self.runtime.dims.vocab_size)
        return self.layout.verify(self.session, ids, slot)[0]

    def verify_many(self, slots: list[int], tokens: np.ndarray) -> np.ndarray | None:
        """Several slots' verify runs (tokens (len(slots), n), each its last token and guesses, padded) in
        one run -> their logits (len(slots), n, V); None where the graph runs them one a run (the fused
        graph) or a slot has no room (StaticLayout.verify_rows)."""
        if not self.runtime.row_views:
            return None
        tokens = np.asarray(tokens, dtype=np.int64)
        check_token_ids(tokens, self.runtime.dims.vocab_size)
        return self.layout.verify_rows(self.session, slots, tokens)

    def rewind(self, slot: int, length: int) -> None:
        """The slot keeps its cache's first `length` positions (of what its last verify wrote)."""
        self.layout.rewind(self.session, [length], [slot])

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "Slots":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def written(self, slot: int) -> int:
        """The positions in the slot's cache (its write index): its prompt's and every fed-back token's."""
        return int(self.session.static.write[slot])
