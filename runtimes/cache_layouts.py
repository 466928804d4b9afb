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
  prompts that run through the decode graph go in runs of at most dims.max_run tokens. Its rows
  can also be slots, one session whose rows requests take and leave, each at its own length
  (`open_slots`, `begin`, `prefill_slot` a chunk at a time, `read_slot`/`load_slot` for cached
  prefixes, `step_slots`, `free`; serving's runtimes/serving/slots.py). A narrow mask (dims.narrow_mask)
  is fed only as wide as the rows need, rounded up to NARROW_STEP.

The layouts' `rt` is the session's runtime (tk.runtimes.base.Runtime, which imports this
module): backends supply the buffers (`_alloc_cache`, `_copy_positions`, `_take`, `_release`,
`_to_numpy`, `_leading`); the layouts own the masks, positions, capacity guards and write indices.
"""

from __future__ import annotations

import numpy as np

from tk.models.spec import contract
from tk.runtimes.errors import InputError
from tk.runtimes.session import Session, StaticState, StepOutput


NARROW_STEP = 64  # a narrow mask's width is a multiple of this (or the capacity)


def slots_problem(dims: contract.GraphDims) -> str | None:
    """Why an artifact's graphs cannot hold serving's slots (None: they can)."""
    if dims.kv_capacity is None:
        return ("continuous batching needs a static-capacity cache: re-export with "
                "tk export MODEL -o OUT --for serve (or --for ort-cpu)")
    return None


def _prefill(rt, ids: np.ndarray, mask: np.ndarray) -> tuple[StepOutput, list]:
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": contract.position_ids_from_mask(mask)}
    return rt._run(contract.PREFILL, feeds, None, None)


def _last_positions(mask: np.ndarray) -> np.ndarray:
    return mask.sum(-1, keepdims=True) - 1  # (B, 1): the last token's, a real one


class _Layout:
    """What both layouts do alike: the cache as arrays, rows leaving, release."""

    def arrays(self, rt, s: Session) -> list[np.ndarray]:
        return [rt._to_numpy(b)[:, :, : s.length].astype(np.float32) for b in s.cache]

    def held(self, rt, s: Session) -> list[np.ndarray | None]:
        """Per cache tensor, which of `arrays`' (B, length) positions it holds (None: all of them)."""
        return [None] * len(s.cache)

    def keep(self, rt, s: Session, rows: np.ndarray) -> None:
        s.cache = rt._take(s.cache, rows)
        s.release_backend_state()  # whatever the backend bound points at the old buffers

    def release(self, rt, s: Session) -> None:
        rt._release(s.cache)


class DynamicLayout(_Layout):
    def start(self, rt, ids: np.ndarray, mask: np.ndarray, room: int) -> tuple[StepOutput, Session]:
        out, present = _prefill(rt, ids, mask)
        B, T = mask.shape
        grown = np.ones((B, T + max(room, 1)), dtype=np.int64)  # grows as a view (no array per step)
        grown[:, :T] = mask
        return out, Session(rt, present, grown, _last_positions(mask), T)

    def step(self, rt, s: Session, tokens: np.ndarray) -> StepOutput:
        if s.length == s.mask.shape[1]:  # past the room reserved at start
            s.mask = np.concatenate([s.mask, np.ones_like(s.mask)], axis=1)
        s.length += 1
        s.positions += 1
        feeds = {"input_ids": tokens, "attention_mask": s.mask[:, : s.length], "position_ids": s.positions}
        out, s.cache = rt._run(contract.DECODE, feeds, s.cache, s)
        return out


class StaticLayout(_Layout):
    """`decode_prefills` (the export's, dims.decode_prefills: a decode graph that also prefills):
    every row's tokens sit from cache index 0, each row at its own length, never behind left
    padding (the graph reads no mask: contract.inputs), whichever graph prefilled them; `arrays`
    still shows the left-padded batch the caller gave."""

    def __init__(self, dims: contract.GraphDims):
        self.capacity, self.decode_prefills, self.max_run = dims.kv_capacity, dims.decode_prefills, dims.max_run
        self.narrow = dims.narrow_mask
        # per cache tensor (contract order), a ring's slots or None
        self.rings = [None if dims.ring is None else dims.ring[i] for i in range(dims.num_layers) for _ in "kv"]

    def start(self, rt, ids: np.ndarray, mask: np.ndarray, room: int) -> tuple[StepOutput, Session]:
        B, T = ids.shape
        self._check_prompt(T)
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
        positions = _last_positions(mask)
        s = Session(rt, self._buffers(rt, B), full, positions, T, StaticState.over(full, positions, write))
        try:
            return self._prefill_batch(rt, s, ids, mask, pads), s
        except BaseException:  # a failed prefill (a prompt beyond a TensorRT engine's profile) keeps no buffer
            s.close()
            raise

    def _buffers(self, rt, batch: int) -> list:
        d = rt.dims
        return [rt._alloc_cache((batch, d.num_kv_heads, n, d.head_dim), d.kv_dtype) for n in d.capacities() for _ in "kv"]

    def _write_present(self, rt, cache: list, present: list, length: int, row: int | None = None,
                       src_row: int | None = None, start: int = 0) -> None:
        """Copy a prefill's present (positions start .. length - 1 of every row, or of row src_row into
        cache row `row`) into the cache buffers as cache indices 0 .. n - 1: a buffer's first positions,
        or in a ring index c at slot c % slots, for the last `slots` of them (two contiguous copies)."""
        n = length - start
        for buf, src, slots in zip(cache, present, self.rings):
            if slots is None or n <= slots:
                rt._copy_positions(buf, src, n, row, src_row, start)
                continue
            first = n % slots  # the slot of the oldest index kept, n - slots
            rt._copy_positions(buf, src, slots - first, row, src_row, length - slots, first)
            if first:
                rt._copy_positions(buf, src, first, row, src_row, length - first, 0)

    def _prefill_batch(self, rt, s: Session, ids: np.ndarray, mask: np.ndarray, pads: list[int]) -> StepOutput:
        if rt.prefill_via == "decode":  # each row's tokens alone, through the decode graph
            return StepOutput(np.concatenate([self._prefill_row(rt, s, b, ids[b:b + 1, p:]).logits
                                              for b, p in enumerate(pads)]))
        T = ids.shape[1]
        out, present = _prefill(rt, ids, mask)
        try:
            if self.decode_prefills:  # each row moves to the front of its cache row
                for b, p in enumerate(pads):
                    self._write_present(rt, s.cache, present, T, row=b, src_row=b, start=p)
            else:
                self._write_present(rt, s.cache, present, T)
        finally:
            rt._release(present)
        return out

    def arrays(self, rt, s: Session) -> list[np.ndarray]:
        """Each row's positions back where the caller's left-padded batch put them (a row prefilled
        through the decode graph sits from index 0; a ring's slots unrolled); positions a ring no
        longer holds are 0 (`held` says which)."""
        if not self.decode_prefills and self.ring_free:
            return super().arrays(rt, s)
        out = []
        for buf, slots in zip(s.cache, self.rings):
            host, a = rt._to_numpy(buf), np.zeros((s.batch, rt.dims.num_kv_heads, s.length, rt.dims.head_dim), np.float32)
            for b, w in enumerate(s.static.write.tolist()):
                p = np.arange(max(0, w - (slots or w)), w)  # the positions the row's buffer holds
                a[b][:, s.length - w + p] = host[b][:, p % slots if slots else p]
            out.append(a)
        return out

    def held(self, rt, s: Session) -> list[np.ndarray | None]:
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

    def _check_prompt(self, T: int) -> None:
        if T >= self.capacity:
            raise InputError(f"prefill: {T} tokens leave no room in the static cache of {self.capacity}; "
                             "export with a larger --max-seq-len")

    def _prefill_row(self, rt, s: Session, row: int, ids: np.ndarray, every: bool = False, at: int = 0) -> StepOutput:
        """Prefill one row's tokens (1, L), the row's positions at .. at + L - 1, through the decode
        graph (it takes a run of new tokens: contract.inputs' decode_prefills) into row `row` of the
        cache, in runs of at most max_run tokens (the row's mask is already 1 on them). With `every`,
        one token per run, to return every position's logits (1, L, V): the decode graph returns a run's last."""
        L, run = ids.shape[1], 1 if every else self.max_run or ids.shape[1]
        rows = [b[row:row + 1] for b in s.cache]
        logits = []
        for start in range(0, L, run):
            end = min(L, start + run)
            feeds = {"input_ids": ids[:, start:end], "attention_mask": s.mask[row:row + 1, :self._width(at + end)],
                     "position_ids": np.arange(at + start, at + end, dtype=np.int64)[None],
                     "write_indices": np.full(1, at + start, np.int64)}
            out, _ = rt._run(contract.DECODE, feeds, rows, None, in_place=True)
            if every:  # a copy: a backend may write the next run's logits into the same buffer
                logits.append(np.array(out.logits[:, -1:], dtype=np.float32))
        return StepOutput(np.concatenate(logits, axis=1)) if every else out

    def step(self, rt, s: Session, tokens: np.ndarray) -> StepOutput:
        if s.length >= self.capacity:  # (the longest row's length)
            raise InputError(f"decode: the static cache holds {self.capacity} positions and is full; "
                             "export with a larger --max-seq-len")
        out = self._decode(rt, s, tokens, None, s.batch)
        s.length += 1
        return out

    def _width(self, needed: int) -> int:
        """The attention_mask's width for a step that needs `needed` positions: all of the cache, or
        with a narrow mask (contract.inputs) that many rounded up to NARROW_STEP (fewer shapes to bind)."""
        return min(self.capacity, -(-needed // NARROW_STEP) * NARROW_STEP) if self.narrow else self.capacity

    def _decode(self, rt, s: Session, tokens: np.ndarray, rows: np.ndarray | None, n: int) -> StepOutput:
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
        past = s.cache if n == s.batch else [rt._leading(b, n) for b in s.cache]
        out, _ = rt._run(contract.DECODE, feeds, past, s, in_place=True)
        if rows is None:
            for b in range(len(tokens)):
                write[b] += 1
        else:
            st.write[rows] += 1
        return out

    def keep(self, rt, s: Session, rows: np.ndarray) -> None:
        super().keep(rt, s, rows)
        s.static = StaticState.over(s.mask, s.positions, s.static.write[rows])

    # --- slots: one session whose rows requests take and leave (runtimes/serving/slots.py) ---

    def open_slots(self, rt, count: int) -> Session:
        """An empty session of `count` slots, each a row of the capacity buffers (the session's
        `length` means nothing here: each row's is its write index)."""
        mask = np.zeros((count, self.capacity), dtype=np.int64)
        positions, write = np.zeros((count, 1), dtype=np.int64), np.zeros((count,), dtype=np.int64)
        s = Session(rt, self._buffers(rt, count), mask, positions, 0, StaticState.over(mask, positions, write))
        for slot in range(count):
            self.free(s, slot)
        return s

    def begin(self, s: Session, slot: int, length: int) -> None:
        """A prompt of `length` tokens takes the free row `slot`: its mask covers them (a chunk's
        queries see only what is written before them: the causal mask), and until the prompt is in,
        a decode step the row sits out writes its throwaway position at the next chunk's start
        (`write`), which that chunk writes again (in a ring too)."""
        self._check_prompt(length)
        s.mask[slot] = 0
        s.mask[slot, :length] = 1
        s.positions[slot] = 0
        s.static.write[slot] = 0

    def prefill_slot(self, rt, s: Session, slot: int, ids: np.ndarray, start: int, end: int,
                     every: bool = False) -> StepOutput:
        """Prefill prompt positions start .. end - 1 of row `slot` (`ids`: the whole prompt, (1, T);
        positions 0 .. start - 1 are in already) -> the last position's logits, or with `every` each
        one's (1, end - start, V). A prompt's first chunk runs through the prefill graph where the
        runtime prefills so (the prompt alone: what `tk generate` of it computes), the rest through
        the decode graph (`_prefill_row`, which needs a row of a buffer: Runtime.row_slices), one
        token per run where `every` needs each position's logits and the prefill graph cannot give them."""
        T = ids.shape[1]
        if start == 0 and rt.prefill_via == "prefill" and (rt.all_prefill_logits or not every):
            out, present = _prefill(rt, ids[:, :end], np.ones((1, end), dtype=np.int64))
            try:
                self._write_present(rt, s.cache, present, end, row=slot)
            finally:
                rt._release(present)
        else:
            out = self._prefill_row(rt, s, slot, ids[:, start:end], every, at=start)
        s.static.write[slot] = end
        if end == T:  # the prompt is in: the row decodes from its last position
            s.positions[slot] = T - 1
        return out

    def read_slot(self, rt, s: Session, slot: int, start: int, end: int) -> list:
        """Row `slot`'s cache positions start .. end - 1, a copy per cache tensor ((1, H, n, D) each,
        in the backend's own kind of array) that `load_slot` takes back."""
        return [rt._read_positions(b, slot, start, end) for b in s.cache]

    def load_slot(self, rt, s: Session, slot: int, parts: list[list]) -> int:
        """Copy `read_slot` copies, one after another from position 0, into row `slot` (a prompt's
        cached prefix) -> the positions written."""
        at = 0
        for part in parts:
            n = part[0].shape[2]
            for buf, src in zip(s.cache, part):
                rt._copy_positions(buf, src, n, dst_row=slot, src_row=0, dst_at=at)
            at += n
        s.static.write[slot] = at
        return at

    @staticmethod
    def free(s: Session, slot: int) -> None:
        """An empty slot: one visible position (0), so that its throwaway row computes no NaN."""
        s.mask[slot] = 0
        s.mask[slot, 0] = 1
        s.positions[slot] = 0
        s.static.write[slot] = 0

    def step_slots(self, rt, s: Session, tokens: np.ndarray, active: list[int], n: int) -> StepOutput:
        """One decode step of the `active` slots (each at its own length) over the first `n` rows
        (the rows past the last active one are not computed where the backend can view rows)."""
        rows = np.asarray(active, dtype=np.int64)
        if s.static.write[rows].max() >= self.capacity:
            raise InputError(f"decode: a slot's static cache of {self.capacity} positions is full")
        return self._decode(rt, s, tokens, rows, n)


def layout_for(dims: contract.GraphDims) -> DynamicLayout | StaticLayout:
    return StaticLayout(dims) if dims.kv_capacity is not None else DynamicLayout()
