"""A static cache's runs of several tokens a row through the decode graph, and what every layout does
alike (runtimes/cache_layouts.py builds the layouts on these): a prompt's runs into its row
(`prefill_row`), several prompts' first runs in one (`first_groups`, `prefill_first`), a verify run of
guesses (`verify`, `verify_rows`) and the `rewind` after it. The capacity, run and mask settings are
StaticLayout's.
"""

from __future__ import annotations

import numpy as np

from tk.models.spec import contract
from tk.runtimes.buffers import CacheBuffers
from tk.runtimes.errors import InputError
from tk.runtimes.session import Session, StepOutput


NARROW_STEP = 64  # a narrow mask's width is a multiple of this (or the capacity)
# the most tokens (padding included) of prompts' first runs in one run: batching short prompts reads the
# weights once for all (8 of 128 tokens: 3.1 ms a token together, 3.9 alone, the real 0.5B on 2 cores),
# long ones gain nothing and lose past ~2k tokens (7 of 450: 4.3 together, 3.6 alone)
GROUP_TOKENS = 1024


def prefill(rt, ids: np.ndarray, mask: np.ndarray) -> tuple[StepOutput, list]:
    """Run runtime `rt`'s prefill graph on a left-padded batch -> (its output, the present cache)."""
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": contract.position_ids_from_mask(mask)}
    return rt.run(contract.PREFILL, feeds, None, None)


def last_positions(mask: np.ndarray) -> np.ndarray:
    return mask.sum(-1, keepdims=True) - 1  # (B, 1): the last token's, a real one


class Layout:
    """What both layouts do alike: the cache as arrays, rows leaving, release."""

    def __init__(self, dims: contract.GraphDims, buffers: CacheBuffers):
        self.dims, self.buffers = dims, buffers
        self.kv = [kind == contract.KV for _, kind in dims.cache_kinds()]  # per cache tensor: positions, or a state

    def arrays(self, s: Session) -> list[np.ndarray]:
        """Keys and values over the session's positions; a recurrent layer's state as it is."""
        return [self.buffers.to_numpy(b)[:, :, : s.length].astype(np.float32) if kv
                else self.buffers.to_numpy(b).astype(np.float32) for b, kv in zip(s.cache, self.kv)]

    def held(self, s: Session) -> list[np.ndarray | None]:
        """Per cache tensor, which of `arrays`' (B, length) positions it holds (None: all of them)."""
        return [None] * len(s.cache)

    def keep(self, s: Session, rows: np.ndarray) -> None:
        s.cache = self.buffers.take(s.cache, rows)
        s.release_backend_state()  # whatever the backend bound points at the old buffers

    def release(self, s: Session) -> None:
        self.buffers.release(s.cache)


class Runs(Layout):
    """A static cache's runs of several tokens a row at its write index, through the decode graph: a
    prompt's (`prefill_row`), prompts' first runs together (`first_groups`, `prefill_first`), a verify
    run of guesses (`verify`, `verify_rows`) and the `rewind` after it (the capacity, run and mask
    settings are StaticLayout's)."""

    def prefill_row(self, s: Session, row: int, ids: np.ndarray, every: bool = False, at: int = 0) -> StepOutput:
        """Prefill one row's tokens (1, L), the row's positions at .. at + L - 1, through the decode
        graph (it takes a run of new tokens: contract.inputs' decode_prefills) into row `row` of the
        cache, in runs of at most max_run tokens (the row's mask is already 1 on them). With `every`,
        every position's logits (1, L, V): each run's, where the graph takes logits_to_keep, else one
        token per run (the decode graph returns a run's last). Where runs are `paired`, a run whose
        logits are read keeps two positions at least (the head's GEMM never has one row), and a run of
        one token takes a copy of it after it, as `step_paired` does."""
        L = ids.shape[1]
        run = 1 if every and not self.keeps else self.max_run or L
        rows = [b[row:row + 1] for b in s.cache]
        paired = self.paired(s)
        logits = []
        for start in range(0, L, run):
            end = min(L, start + run)
            n, pair = end - start, paired and (every or end == L)
            m = n + (pair and n == 1 and at + end < self.capacity)  # the copy writes at + end, which the next run writes again
            tokens = ids[:, start:end] if m == n else np.repeat(ids[:, start:end], 2, axis=1)
            if every and self.keeps:
                keep = {"logits_to_keep": np.arange(m)}
            else:
                keep = {"logits_to_keep": np.arange(m - 2, m)} if pair and m > 1 else self._keep_last(n)
            feeds = {"input_ids": tokens, "attention_mask": s.mask[row:row + 1, :self._width(at + start + m)],
                     "position_ids": np.arange(at + start, at + start + m, dtype=np.int64)[None],
                     "write_indices": np.full(1, at + start, np.int64), **keep}
            out, _ = s.runtime.run(contract.DECODE, feeds, rows, None, in_place=True)
            if every:  # a copy: a backend may write the next run's logits into the same buffer
                logits.append(np.array(out.logits[:, :n] if self.keeps else out.logits[:, -1:], dtype=np.float32))
            elif pair and m > 1:  # of the two kept (m - 2, m - 1), the last token's (n - 1)
                out = StepOutput(out.logits[:, n - m + 1:n - m + 2], out.hidden)
        return StepOutput(np.concatenate(logits, axis=1)) if every else out

    def paired(self, s: Session) -> bool:
        """Whether a run of one position goes as two here (Runtime.lone_row_apart: on such a CPU one row
        alone takes a kernel of its own), where the layout can (StaticLayout.pairs: the graph keeps the
        positions asked for, takes runs of two, and no layer carries a state that a copy would advance)."""
        return self.pairs and s.runtime.lone_row_apart

    def step_paired(self, s: Session, row: int, token: int) -> StepOutput | None:
        """A one-token step of a row that decodes alone, where runs are `paired`: the token and a copy of it
        after it in one run (causal: the token never sees its copy), the copy's position taken back
        (`rewind`) for the next step to write again -> the token's logits (1, 1, V), the bits a verify
        run or a batch computes for it. None where the copy has no room (the cache's last position)."""
        w = int(s.static.write[row])
        if w + 2 > self.capacity:
            return None
        logits = self.verify(s, np.full((1, 2), token, np.int64), row)
        self.rewind(s, [w + 1], [row])
        return StepOutput(logits[:, :1])

    def first_groups(self, rt, slots: list[int], ends: list[int]) -> list[list[int]]:
        """Which of these rows' prompts' first runs (positions 0 .. ends[i] - 1) go in one run, in groups
        of two or more (`prefill_first`; the others go alone, `prefill_row` or the prefill graph): through
        the prefill graph any rows, left-padded; through the decode graph (rt.prefill_via "decode": the
        fused one's GroupQueryAttention takes a first prompt's batch, a mask as wide as the run) adjacent rows,
        one view of the buffers. None of a hybrid's (padding would reach its recurrent state) or of a cache
        with rings; a group pads at most a quarter of its tokens and runs at most GROUP_TOKENS."""
        via_decode = rt.prefill_via == "decode"
        if len(slots) < 2 or not all(self.kv) or not self.ring_free or (
                via_decode and not (self.narrow and rt.row_slices)):
            return []
        groups: list[list[tuple[int, int]]] = []
        for slot, end in sorted(zip(slots, ends)):
            g = groups[-1] if groups else []
            joined = g + [(slot, end)]
            longest = max(e for _, e in joined)
            if g and (not via_decode or (slot == g[-1][0] + 1 and (self.keeps or end == g[0][1])
                                    and (self.max_run is None or longest <= self.max_run))) \
                    and len(joined) * longest <= min(1.25 * sum(e for _, e in joined), GROUP_TOKENS):
                g.append((slot, end))
            else:
                groups.append([(slot, end)])
        return [[slot for slot, _ in g] for g in groups if len(g) > 1]

    def prefill_first(self, s: Session, slots: list[int], ids: list[np.ndarray]) -> np.ndarray:
        """A group of `first_groups`: row slots[i] takes the tokens ids[i] (1-D) from cache index 0, in
        one run -> each row's last token's logits (len(slots), V), a copy. Through the decode graph
        each row's tokens then padding, which it writes past its tokens (causal: they never see it),
        where its next run writes again; through the prefill graph left-padded, each row's present moved
        to the front of its row."""
        rt, m, ends = s.runtime, len(slots), [len(t) for t in ids]
        S = max(ends)
        batch = np.zeros((m, S), dtype=np.int64)
        if rt.prefill_via == "decode":
            for i, t in enumerate(ids):
                batch[i, :len(t)] = t
            keep = sorted(set(n - 1 for n in ends))
            feeds = {"input_ids": batch, "attention_mask": np.ones((m, S), np.int64),
                     "position_ids": np.tile(np.arange(S, dtype=np.int64), (m, 1)),
                     "write_indices": np.zeros(m, np.int64),
                     **({"logits_to_keep": np.asarray(keep, np.int64)} if self.keeps else {})}
            rows = [b[slots[0]:slots[0] + m] for b in s.cache]
            out, _ = rt.run(contract.DECODE, feeds, rows, None, in_place=True)
            at = [keep.index(n - 1) for n in ends] if self.keeps else -1
            return np.asarray(out.logits[np.arange(m), at], np.float32)
        mask = np.zeros((m, S), dtype=np.int64)
        for i, t in enumerate(ids):
            batch[i, S - len(t):], mask[i, S - len(t):] = t, 1
        out, present = prefill(rt, batch, mask)
        try:
            for i, (slot, n) in enumerate(zip(slots, ends)):
                self.write_present(s.cache, present, S, row=slot, src_row=i, start=S - n)
        finally:
            self.buffers.release(present)
        return np.array(out.logits[:, -1], dtype=np.float32)

    def _keep_last(self, n: int) -> dict[str, np.ndarray]:
        """The logits_to_keep feed of a run of `n` tokens that wants its last one's logits (none where
        the graph takes no such input)."""
        return {"logits_to_keep": np.full(1, n - 1, np.int64)} if self.keeps else {}

    def _width(self, needed: int) -> int:
        """The attention_mask's width for a step that needs `needed` positions: all of the cache, or
        with a narrow mask (contract.inputs) that many rounded up to NARROW_STEP (fewer shapes to bind)."""
        return min(self.capacity, -(-needed // NARROW_STEP) * NARROW_STEP) if self.narrow else self.capacity

    def verify(self, s: Session, tokens: np.ndarray, row: int | None = None) -> np.ndarray:
        """Run `tokens` (B, n), each row's next n tokens (its last kept token, then what a proposer
        guessed), at each row's write index in one decode run -> each position's logits (B, n, V), a
        copy; with `row`, that row of the session alone ((1, n) tokens). The run writes n positions
        per row and moves nothing: `rewind` then says how many of them each row keeps, and what it
        does not keep is never attended (its mask goes back to 0; a ring's slots hold window + run - 1
        positions, so what a rejected run wrote there is older than any later query's window:
        contract.ring_sizes)."""
        n, g = tokens.shape[1], slice(None) if row is None else slice(row, row + 1)
        write = s.static.write[g].copy()
        if int(write.max()) + n > self.capacity:
            raise InputError(f"verify: {n} tokens past a row's {int(write.max())} do not fit the static cache of "
                             f"{self.capacity} positions; export with a larger --max-seq-len")
        if self.max_run is not None and n > self.max_run:
            raise InputError(f"verify: {n} tokens per row; this decode graph takes at most {self.max_run} a run")
        if row is None and self.fused and s.batch > 1:  # GroupQueryAttention: a run over a past, one row a batch
            return np.concatenate([self.verify(s, tokens[b:b + 1], b) for b in range(s.batch)])
        for b, w in zip(range(s.batch)[g], write.tolist()):
            s.mask[b, w:w + n] = 1
        feeds = {"input_ids": np.ascontiguousarray(tokens, dtype=np.int64),
                 "attention_mask": s.mask[g, :self._width(int(write.max()) + n)],
                 "position_ids": write[:, None] + np.arange(n), "write_indices": write,
                 **({"logits_to_keep": np.arange(n)} if self.keeps else {})}
        cache = s.cache if row is None else [b[g] for b in s.cache]
        out, _ = s.runtime.run(contract.DECODE, feeds, cache, None, in_place=True)
        return np.array(out.logits, dtype=np.float32)

    def verify_rows(self, s: Session, rows: list[int], tokens: np.ndarray) -> np.ndarray | None:
        """Verify runs of several of a session's rows in one run of its leading max(rows) + 1 rows
        (tokens (len(rows), n)) -> each position's logits (len(rows), n, V); None where one run cannot
        (the fused graph's attention takes a run over a past one row a batch, or a row that sits it out
        has no room past its write index). A row that sits the run out writes n positions from its
        write index that its mask does not show and its next run writes again (a ring holds a run's
        worth more than its window: contract.ring_sizes), and its logits are not read."""
        m, n = max(rows) + 1, tokens.shape[1]
        write = s.static.write[:m].copy()
        if self.fused or int(write.max()) + n > self.capacity or (self.max_run is not None and n > self.max_run):
            return None
        ids = np.zeros((m, n), dtype=np.int64)
        ids[rows] = tokens
        for b, w in zip(rows, write[rows].tolist()):
            s.mask[b, w:w + n] = 1
        feeds = {"input_ids": ids, "attention_mask": s.mask[:m, :self._width(int(write.max()) + n)],
                 "position_ids": write[:, None] + np.arange(n), "write_indices": write,
                 **({"logits_to_keep": np.arange(n)} if self.keeps else {})}
        cache = s.cache if m == s.batch else [self.buffers.leading(b, m) for b in s.cache]
        out, _ = s.runtime.run(contract.DECODE, feeds, cache, None, in_place=True)
        return np.asarray(out.logits[rows], dtype=np.float32)  # (the row pick copies once: no second copy)

    def rewind(self, s: Session, lengths, rows=None) -> None:
        """Each row (of `rows`, default all) keeps the first `lengths[i]` positions of its cache (at
        most what its last run wrote): its write index moves there, its mask ends there and its last
        position is the one before. A row's tokens sit from cache index 0 (decode_prefills), so its
        position is its index."""
        st = s.static
        for b, n in zip(range(s.batch) if rows is None else rows, (int(x) for x in lengths)):
            s.mask[b, :n] = 1  # (a row may move back and forth: serving keeps one guess at a time)
            s.mask[b, n:] = 0
            st.write[b] = n
            s.positions[b] = n - 1
        s.length = int(st.write.max())
