"""Serving's slots: the rows of a static-capacity cache as places that requests take and leave.

`Slots(runtime, count)` opens one session of `count` empty rows on an active runtime whose export
has a static cache (`slots_problem` says why one cannot hold them). A prompt takes a free row
(`begin`), may get cached positions copied in (`load` of what `read` copied out), and comes in by
chunks (`prefill(slot, ids, start, end)`, or `admit` for all of it at once): its first chunk alone
as `tk generate` of it would prefill it (batch 1, no padding), later ones through the decode graph
at the row's write index (`chunk_problem` says where a backend cannot). `step(tokens, active)`
decodes the busy rows together, each at its own length and write index, and computes only up to
the last busy one where the backend views a buffer's leading rows (`Runtime.row_views`; ORT on
CUDA runs every row); `free(slot)` empties a row, which keeps one visible position (0) and
rewrites it: its throwaway row computes no NaN and touches no live row. The rows' mechanics are the
static layout's (runtimes/cache_layouts.StaticLayout); which request sits where, and what each step
computes, is the scheduler's and the batcher's (runtimes/serving/scheduler.py, runtimes/serving/batching.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tk.runtimes.base import Runtime, StepOutput, check_token_ids
from tk.runtimes.cache_layouts import slots_problem
from tk.runtimes.errors import InputError


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
        self.runtime, self.layout = runtime, runtime.layout
        self.session = self.layout.open_slots(runtime, count)

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
        returns the last only (StaticLayout.prefill_slot)."""
        ids = self.begin(slot, prompt)
        return self.prefill(slot, ids, 0, ids.shape[1], every)

    def begin(self, slot: int, prompt: Sequence[int]) -> np.ndarray:
        """A prompt takes the free `slot`, to come in by `load` and `prefill` -> its ids (1, T)."""
        ids = np.asarray(prompt, dtype=np.int64).reshape(1, -1)
        check_token_ids(ids, self.runtime.dims.vocab_size)
        self.layout.begin(self.session, slot, ids.shape[1])
        return ids

    def prefill(self, slot: int, ids: np.ndarray, start: int, end: int, every: bool = False) -> StepOutput:
        """Prompt positions start .. end - 1 into `slot` (0 .. start - 1 are in) -> the last one's logits
        (or each one's, with `every`); the prompt's last chunk leaves the slot ready to decode."""
        return self.layout.prefill_slot(self.runtime, self.session, slot, ids, start, end, every)

    def read(self, slot: int, start: int, end: int) -> list:
        """A copy of the slot's cache positions start .. end - 1 (one array per cache tensor)."""
        return self.layout.read_slot(self.runtime, self.session, slot, start, end)

    def load(self, slot: int, parts: list[list]) -> int:
        """`read` copies into the slot from position 0, one after another -> the positions written."""
        return self.layout.load_slot(self.runtime, self.session, slot, parts)

    def free(self, slot: int) -> None:
        self.layout.free(self.session, slot)

    def step(self, tokens, active: list[int]) -> StepOutput:
        """One decode step of the `active` slots; `tokens` (max(active) + 1,) holds each active
        slot's last token (the others' are ignored) -> logits (max(active) + 1 rows, or every
        slot's where the backend cannot view leading rows, 1, V)."""
        n = max(active) + 1 if self.runtime.row_views else self.session.batch
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        check_token_ids(tokens, self.runtime.dims.vocab_size)
        return self.layout.step_slots(self.runtime, self.session, tokens, active, n)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> "Slots":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
