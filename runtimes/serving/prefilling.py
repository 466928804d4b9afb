"""The batcher's prompt chunks, a part of its `Steps` (runtimes/serving/stepping.py): the first chunks
of prompts that came in together go in one run where the graphs allow (StaticLayout.first_groups:
through the prefill graph, or the fused decode graph's first prompt over adjacent slots), the others
alone; each chunk then feeds the prefix store, and a prompt's last gives its request its first token.
"""

from __future__ import annotations

from tk.runtimes.serving.scheduler import Chunk, State


class Prefilling:
    """Steps' prompt chunks (it holds `running`, `slots`, `store` and the run, take and fail helpers)."""

    def prefill(self, chunks: list[Chunk]) -> None:
        groups = self._first_groups([c for c in chunks if c.seq.state is State.PREFILL])
        for group in groups:
            self._prefill_first(group)
        grouped = {id(c) for g in groups for c in g}
        for chunk in chunks:
            if chunk.seq.state is State.PREFILL and id(chunk) not in grouped:  # (not failed this step)
                self._prefill(chunk)

    def _first_groups(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """The prompts' first chunks that go in one run (StaticLayout.first_groups): those that need no
        logits but their last position's."""
        first = {c.seq.slot: c for c in chunks
                 if c.start == 0 and self.running[c.seq.slot].request.prompt_logprobs is None}
        if len(first) < 2:
            return []
        slots = sorted(first)
        return [[first[s] for s in g] for g in self.slots.layout.first_groups(self.runtime, slots,
                                                                               [first[s].end for s in slots])]

    def _prefill_first(self, group: list[Chunk]) -> None:
        """A group of first chunks in one run; each its own after that (the prefix store, its first token)."""
        rs = [self.running[c.seq.slot] for c in group]
        try:
            logits = self._timed(sum(c.end for c in group), lambda: self.slots.prefill_first(
                [c.seq.slot for c in group], [r.ids for r in rs], [c.end for c in group]), prompt=True)
        except Exception as e:  # noqa: BLE001
            return self.fail([c.seq for c in group], e)
        for c, r, row in zip(group, rs, logits):
            self._ran(c, r)
            if c.last:
                self._take(c.seq.slot, lambda r, row=row: r.row.take(row[None]))

    def _prefill(self, chunk: Chunk) -> None:
        seq = chunk.seq
        r = self.running[seq.slot]
        every = r.request.prompt_logprobs is not None
        try:
            out = self._timed(chunk.end - chunk.start,
                              lambda: self.slots.prefill(seq.slot, r.ids, chunk.start, chunk.end, every), prompt=True)
            self._ran(chunk, r)
            if every and (scores := r.row.score_prompt(out.logits[0], chunk.last)) is not None:
                r.request.prompt_scores = scores
        except Exception as e:  # noqa: BLE001
            return self.fail([seq], e)
        if chunk.last:
            self._take(seq.slot, lambda r: r.row.take(out.logits[:, -1]))

    def _ran(self, chunk: Chunk, r) -> None:
        """A chunk of request `r` (its Occupant) is in its slot: the scheduler and the prefix store hear of it."""
        self.advanced(chunk)
        self.prefill_tokens += chunk.end - chunk.start
        if self.store is not None:
            self.store.prompt(r, chunk.end)
