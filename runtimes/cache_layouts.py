"""How a session's KV cache grows, written once for every backend.

- `DynamicLayout` (tk export's default graphs): decode takes the past and returns a present one
  position longer; the mask grows by one real position per step.
- `StaticLayout` (`--kv-cache static --max-seq-len N`): the cache is N-position buffers that the
  decode graph writes in place at per-row `write_indices`; the prefill's present is copied into
  them once (or, where the runtime prefills through the decode graph, each row's prompt runs
  through it into its row), and the mask covers the whole buffer (0 beyond what is written). The
  same feed arrays are rewritten in place every step, so a backend may bind them once per
  session. A sliding layer's buffer may be a ring of fewer positions (dims.ring: position p at
  slot p % slots), written by the graph; a prefill's present is copied into it as such, and
  prompts that run through the decode graph go in runs of at most dims.max_run tokens. Its
  primitives (`allocate`, `write_present`, `prefill_row`, `decode`) also serve serving's `Slots`,
  one session whose rows requests take and leave. A narrow mask (dims.narrow_mask) is fed only as
  wide as the rows need, rounded up to NARROW_STEP. Its runs of several tokens a row (a prompt's, a
  batch of prompts' first ones, a verify run) are runtimes/cache_runs.py's `Runs`.

A layout is bound to its runtime's `CacheBuffers` (runtimes/buffers.py) when the runtime is
built; it runs graphs on the runtime a session runs on (`Session.runtime.run`). The backends own
the buffers; the layouts own the masks, positions, capacity guards and write indices.
"""

from __future__ import annotations

import numpy as np

from tk.models.spec import contract
from tk.models.spec.variant import Target
from tk.runtimes.buffers import CacheBuffers
from tk.runtimes.cache_runs import NARROW_STEP, Layout, Runs, last_positions, prefill  # noqa: F401 (prefill: slots')
from tk.runtimes.errors import InputError
from tk.runtimes.session import Session, StaticState, StepOutput


def slots_problem(dims: contract.GraphDims) -> str | None:
    """Why an artifact's graphs cannot hold serving's slots (None: they can)."""
    if dims.kv_capacity is None:
        return ("continuous batching needs a static-capacity cache: re-export with "
                "tk export MODEL -o OUT --for serve (or --for ort-cpu)")
    return None


class DynamicLayout(Layout):
    def start(self, rt, ids: np.ndarray, mask: np.ndarray, room: int) -> tuple[StepOutput, Session]:
        out, present = prefill(rt, ids, mask)
        B, T = mask.shape
        grown = np.ones((B, T + max(room, 1)), dtype=np.int64)  # grows as a view (no array per step)
        grown[:, :T] = mask
        return out, Session(rt, present, grown, last_positions(mask), T)

    def step(self, s: Session, tokens: np.ndarray) -> StepOutput:
        if s.length == s.mask.shape[1]:  # past the room reserved at start
            s.mask = np.concatenate([s.mask, np.ones_like(s.mask)], axis=1)
        s.length += 1
        s.positions += 1
        feeds = {"input_ids": tokens, "attention_mask": s.mask[:, : s.length], "position_ids": s.positions}
        out, s.cache = s.runtime.run(contract.DECODE, feeds, s.cache, s)
        return out


class StaticLayout(Runs):
    """`decode_prefills` (the export's, dims.variant.decode_prefills: a decode graph that also prefills):
    every row's tokens sit from cache index 0, each row at its own length, never behind left
    padding (the graph reads no mask: contract.inputs), whichever graph prefilled them; `arrays`
    still shows the left-padded batch the caller gave."""

    def __init__(self, dims: contract.GraphDims, buffers: CacheBuffers):
        super().__init__(dims, buffers)
        self.capacity, self.decode_prefills, self.max_run = dims.kv_capacity, dims.variant.decode_prefills, dims.max_run
        self.narrow, self.keeps = dims.narrow_mask, dims.keeps_logits
        self.fused = dims.variant.target is Target.ORT  # (GroupQueryAttention: see verify)
        # where runs can be `paired`: the logits asked for kept, prompts from index 0, no recurrent state, runs of 2
        self.pairs = self.keeps and self.decode_prefills and all(self.kv) and (self.max_run or 2) >= 2
        # per cache tensor (contract order), a ring's slots or None
        self.rings = [None if dims.ring is None or kind != contract.KV else dims.ring[i] for i, kind in dims.cache_kinds()]
        past = set(dims.past_names())
        self.specs = [spec for spec in dims.inputs(contract.DECODE) if spec.name in past]  # the buffers' shapes

    def start(self, rt, ids: np.ndarray, mask: np.ndarray, room: int) -> tuple[StepOutput, Session]:
        B, T = ids.shape
        self.check_prompt(T)
        pads = (T - mask.sum(-1)).tolist()
        full = np.zeros((B, self.capacity), dtype=np.int64)
        if self.decode_prefills:  # row b's tokens at 0 .. its length - 1
            if not (mask == (np.arange(T) >= np.array(pads)[:, None])).all():
                raise InputError("prefill: the attention mask must be left padding (0s, then 1s) in every row")
            write = mask.sum(-1)
            full[np.arange(self.capacity) < write[:, None]] = 1
        else:
            write = np.full((B,), T, dtype=np.int64)
            full[:, :T] = mask
        positions = last_positions(mask)
        s = Session(rt, self.allocate(B), full, positions, T, self.state(full, positions, write))
        try:
            return self._prefill_batch(s, ids, mask, pads), s
        except BaseException:  # a failed prefill (a prompt beyond a TensorRT engine's profile) keeps no buffer
            s.close()
            raise

    def state(self, mask: np.ndarray, positions: np.ndarray, write: np.ndarray) -> StaticState:
        """A session's static state over these arrays, with the feeds this layout's decode graph takes."""
        return StaticState.over(mask, positions, write, self.keeps)

    def allocate(self, batch: int) -> list:
        """The cache buffers of `batch` rows, in contract order, as the decode graph's inputs are shaped:
        keys and values at the capacity (a ring's at its slots), a recurrent layer's state (zeros)."""
        out = []
        try:
            for spec in self.specs:
                out.append(self.buffers.alloc(contract.shape(spec, {contract.BATCH: batch}), spec.dtype))
        except BaseException:  # a failed allocation (out of device memory) keeps none of the others
            self.buffers.release(out)
            raise
        return out

    def write_present(self, cache: list, present: list, length: int, row: int | None = None,
                      src_row: int | None = None, start: int = 0) -> None:
        """Copy a prefill's present (positions start .. length - 1 of every row, or of row src_row into
        cache row `row`) into the cache buffers as cache indices 0 .. n - 1: a buffer's first positions,
        or in a ring index c at slot c % slots, for the last `slots` of them (two contiguous copies)."""
        n, copy = length - start, self.buffers.copy_positions
        for buf, src, slots in zip(cache, present, self.rings):
            if slots is None or n <= slots:
                copy(buf, src, n, row, src_row, start)
                continue
            first = n % slots  # the slot of the oldest index kept, n - slots
            copy(buf, src, slots - first, row, src_row, length - slots, first)
            if first:
                copy(buf, src, first, row, src_row, length - first, 0)

    def _prefill_batch(self, s: Session, ids: np.ndarray, mask: np.ndarray, pads: list[int]) -> StepOutput:
        if s.runtime.prefill_via == "decode":  # through the decode graph: first_groups' rows in a run each, the rest alone
            rows = [ids[b, p:] for b, p in enumerate(pads)]
            logits: list = [None] * len(rows)
            for group in self.first_groups(s.runtime, list(range(len(rows))), [len(r) for r in rows]):
                for b, row in zip(group, self.prefill_first(s, group, [rows[b] for b in group])):
                    logits[b] = row[None, None]
            for b, row in enumerate(rows):
                if logits[b] is None:  # (a copy: a backend may write the next run's logits where these are)
                    logits[b] = np.array(self.prefill_row(s, b, row[None]).logits[:, -1:], dtype=np.float32)
            return StepOutput(np.concatenate(logits))
        T = ids.shape[1]
        out, present = prefill(s.runtime, ids, mask)
        try:
            if self.decode_prefills:  # each row moves to the front of its cache row
                for b, p in enumerate(pads):
                    self.write_present(s.cache, present, T, row=b, src_row=b, start=p)
            else:
                self.write_present(s.cache, present, T)
        finally:
            self.buffers.release(present)
        return out

    def arrays(self, s: Session) -> list[np.ndarray]:
        """Each row's positions back where the caller's left-padded batch put them (a row prefilled
        through the decode graph sits from index 0; a ring's slots unrolled); positions a ring no
        longer holds are 0 (`held` says which)."""
        if not self.decode_prefills and self.ring_free:
            return super().arrays(s)
        out = []
        for buf, slots, kv in zip(s.cache, self.rings, self.kv):
            if not kv:  # a recurrent state: each row's, whichever graph prefilled it
                out.append(self.buffers.to_numpy(buf).astype(np.float32))
                continue
            host = self.buffers.to_numpy(buf)  # (B, its kv heads, positions, its head dim)
            a = np.zeros((s.batch, host.shape[1], s.length, host.shape[3]), np.float32)
            for b, w in enumerate(s.static.write.tolist()):
                p = np.arange(max(0, w - (slots or w)), w)  # the positions the row's buffer holds
                a[b][:, s.length - w + p] = host[b][:, p % slots if slots else p]
            out.append(a)
        return out

    def held(self, s: Session) -> list[np.ndarray | None]:
        out = []
        for slots in self.rings:
            if slots is None:
                out.append(None)
                continue
            since = s.length - np.minimum(s.static.write, slots)  # (B,): the oldest position each row holds
            out.append(np.arange(s.length) >= since[:, None])
        return out

    @property
    def ring_free(self) -> bool:
        return all(r is None for r in self.rings)

    def check_prompt(self, T: int) -> None:
        if T >= self.capacity:
            raise InputError(f"prefill: {T} tokens leave no room in the static cache of {self.capacity}; "
                             "export with a larger --max-seq-len")

    def step(self, s: Session, tokens: np.ndarray) -> StepOutput:
        if s.length >= self.capacity:  # (the longest row's length)
            raise InputError(f"decode: the static cache holds {self.capacity} positions and is full; "
                             "export with a larger --max-seq-len")
        if s.batch == 1 and self.paired(s) and (out := self.step_paired(s, 0, int(tokens[0, 0]))) is not None:
            return out  # (its rewind moved the length)
        out = self.decode(s, tokens, None, s.batch)
        s.length += 1
        return out

    def decode(self, s: Session, tokens: np.ndarray, rows: np.ndarray | None, n: int) -> StepOutput:
        """Decode the first `n` rows; of them, `rows` (None: all) advance (each at its own write
        index) and the others sit out: an empty slot writes its throwaway position 0 again and
        moves nothing. The feed arrays are written in place: they are the ones a backend bound."""
        st = s.static
        if rows is None:
            ids, positions, mask, write = st.views
            width = s.mask.shape[1]
            for b, token in enumerate(tokens.ravel().tolist()):
                ids[b] = token
                positions[b] += 1
                mask[b * width + write[b]] = 1
        else:
            st.feeds["input_ids"][: len(tokens)] = tokens
            s.positions[rows] += 1
            s.mask[rows, st.write[rows]] = 1
        feeds = st.feeds if n == s.batch else {k: v[:n] for k, v in st.feeds.items()}
        if self.narrow:  # the positions any of the n rows holds, this step's included
            width = self._width(int(st.write[:n].max()) + 1)
            mask = st.narrow.get(width)
            if mask is None:
                mask = st.narrow[width] = np.empty((s.batch, width), np.int64)
            np.copyto(mask[:n], s.mask[:n, :width])
            feeds = {**feeds, "attention_mask": mask[:n]}
        past = s.cache if n == s.batch else [self.buffers.leading(b, n) for b in s.cache]
        out, _ = s.runtime.run(contract.DECODE, feeds, past, s, in_place=True)
        if rows is None:
            for b in range(len(tokens)):
                write[b] += 1
        else:
            st.write[rows] += 1
        return out

    def keep(self, s: Session, rows: np.ndarray) -> None:
        super().keep(s, rows)
        s.static = self.state(s.mask, s.positions, s.static.write[rows])


def layout_for(dims: contract.GraphDims, buffers: CacheBuffers) -> DynamicLayout | StaticLayout:
    """The layout of the graphs of `dims`, over a runtime's buffers."""
    return StaticLayout(dims, buffers) if dims.kv_capacity is not None else DynamicLayout(dims, buffers)
