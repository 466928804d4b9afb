"""How a session's KV cache grows, written once for every backend.

- `DynamicLayout` (tk export's default graphs): decode takes the past and returns a present one
  position longer; the mask grows by one real position per step.
- `StaticLayout` (`--kv-cache static --max-seq-len N`): the cache is N-position buffers that the
  decode graph writes in place at per-row `write_indices`; the prefill's present is copied into
  them once (or, where the decode graph also prefills, each row's prompt runs through it into its
  row, unpadded), and the mask covers the whole buffer (0 beyond what is written). The same feed
  arrays are rewritten in place every step, so a backend may bind them once per session. Its
  slots (`open_slots`, `admit`, `step_slots`, `free`) are one session whose rows requests take
  and leave, each at its own length: the continuous batching of runtimes/batching.py.

Backends supply the buffers (`Runtime._alloc_cache`, `_write_prefix`, `_take`, `_release`,
`_to_numpy`); the layouts own the masks, positions, capacity guards and write indices.
"""

from __future__ import annotations

import numpy as np

from tk.models import contract
from tk.runtimes.base import InputError, Runtime, Session, StepOutput


def _prefill(rt: Runtime, ids: np.ndarray, mask: np.ndarray) -> tuple[StepOutput, list]:
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": contract.position_ids_from_mask(mask)}
    return rt._run(contract.PREFILL, feeds, None, None)


class _Layout:
    """What both layouts do alike: the cache as arrays, rows leaving, release."""

    def arrays(self, rt: Runtime, s: Session) -> list[np.ndarray]:
        return [rt._to_numpy(b)[:, :, : s.length].astype(np.float32) for b in s.cache]

    def keep(self, rt: Runtime, s: Session, rows: np.ndarray) -> None:
        s.cache = rt._take(s.cache, rows)
        rt._release_session(s)
        s.state.clear()  # whatever the backend bound points at the old buffers

    def release(self, rt: Runtime, s: Session) -> None:
        rt._release(s.cache)


class DynamicLayout(_Layout):
    def start(self, rt: Runtime, ids: np.ndarray, mask: np.ndarray, room: int) -> tuple[StepOutput, Session]:
        out, present = _prefill(rt, ids, mask)
        return out, Session(rt, present, mask, room)

    def step(self, rt: Runtime, s: Session, tokens: np.ndarray) -> StepOutput:
        if s.length == s.mask.shape[1]:  # past the room reserved at start
            s.mask = np.concatenate([s.mask, np.ones_like(s.mask)], axis=1)
        s.length += 1
        s.positions += 1
        feeds = {"input_ids": tokens, "attention_mask": s.mask[:, : s.length], "position_ids": s.positions}
        out, s.cache = rt._run(contract.DECODE, feeds, s.cache, s)
        return out


class StaticLayout(_Layout):
    """`unpadded` (a decode graph that also prefills, dims.decode_prefills): every row's tokens sit
    from cache index 0, each row at its own length, never behind left padding (the graph reads
    no mask: contract.inputs); `arrays` still shows the left-padded batch the caller gave."""

    def __init__(self, capacity: int, unpadded: bool = False):
        self.capacity, self.unpadded = capacity, unpadded

    def start(self, rt: Runtime, ids: np.ndarray, mask: np.ndarray, room: int) -> tuple[StepOutput, Session]:
        B, T = ids.shape
        self._check_prompt(T)
        d = rt.dims
        buffers = [rt._alloc_cache((B, d.num_kv_heads, self.capacity, d.head_dim), d.kv_dtype)
                   for _ in range(2 * d.num_layers)]
        s = Session(rt, buffers, mask, 0)
        s.mask = np.zeros((B, self.capacity), dtype=np.int64)
        pads = (T - mask.sum(-1)).tolist()
        if self.unpadded:  # row b's tokens at 0 .. its length - 1
            if not (mask == (np.arange(T) >= np.array(pads)[:, None])).all():
                raise InputError("prefill: the attention mask must be left padding (0s, then 1s) in every row")
            s.write = mask.sum(-1)  # per row: the cache index its next token goes to
            s.mask[np.arange(self.capacity) < s.write[:, None]] = 1
        else:
            s.write = np.full((B,), T, dtype=np.int64)
            s.mask[:, :T] = mask
        if rt.prefills_in_decode:  # each row's tokens alone, through the decode graph
            out = StepOutput(np.concatenate([self._prefill_row(rt, s, b, ids[b:b + 1, p:]).logits
                                             for b, p in enumerate(pads)]))
        else:
            out, present = _prefill(rt, ids, mask)
            for buf, src in zip(buffers, present):
                if self.unpadded:  # each row moves to the front of its cache row
                    host = rt._to_numpy(src)
                    for b, p in enumerate(pads):
                        rt._write_prefix(buf, host[b:b + 1, :, p:], T - p, row=b)
                else:
                    rt._write_prefix(buf, src, T)
            rt._release(present)
        self._feeds(s)
        return out, s

    def arrays(self, rt: Runtime, s: Session) -> list[np.ndarray]:
        if not self.unpadded:
            return super().arrays(rt, s)
        out = []
        for buf in s.cache:
            host, a = rt._to_numpy(buf), np.zeros((s.batch, rt.dims.num_kv_heads, s.length, rt.dims.head_dim), np.float32)
            for b, w in enumerate(s.write.tolist()):  # row b's tokens, back where its left padding put them
                a[b, :, s.length - w:] = host[b, :, :w]
            out.append(a)
        return out

    def _check_prompt(self, T: int) -> None:
        if T >= self.capacity:
            raise InputError(f"prefill: {T} tokens leave no room in the static cache of {self.capacity}; "
                             "export with a larger --max-seq-len")

    @staticmethod
    def _prefill_row(rt: Runtime, s: Session, row: int, ids: np.ndarray) -> StepOutput:
        """Prefill one row's tokens (1, L) through the decode graph (it takes a run of new tokens:
        contract.inputs' decode_prefills) into row `row` of the cache, from index 0 (the row's
        mask is already 1 on 0 .. L - 1)."""
        L = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": s.mask[row:row + 1],
                 "position_ids": np.arange(L, dtype=np.int64)[None], "write_indices": np.zeros(1, np.int64)}
        out, _ = rt._run(contract.DECODE, feeds, [b[row:row + 1] for b in s.cache], None, in_place=True)
        return out

    @staticmethod
    def _feeds(s: Session) -> None:
        s.feeds = {"input_ids": np.zeros((s.batch, 1), np.int64), "attention_mask": s.mask,
                   "position_ids": s.positions, "write_indices": s.write}
        # flat int64 views of the same arrays: a step where every row advances updates them one
        # element at a time, ~18 us cheaper than numpy calls right after a step (whose weights
        # have just left the CPU's caches) on the 55M model
        s.views = tuple(memoryview(a).cast("B").cast("q") for a in (s.feeds["input_ids"], s.positions, s.mask, s.write))

    def step(self, rt: Runtime, s: Session, tokens: np.ndarray) -> StepOutput:
        if s.length >= self.capacity:  # (the longest row's length)
            raise InputError(f"decode: the static cache holds {self.capacity} positions and is full; "
                             "export with a larger --max-seq-len")
        out = self._decode(rt, s, tokens, None, s.batch)
        s.length += 1
        return out

    @staticmethod
    def _decode(rt: Runtime, s: Session, tokens: np.ndarray, rows: np.ndarray | None, n: int) -> StepOutput:
        """Decode the first `n` rows; of them, `rows` (None: all) advance (each at its own write
        index) and the others sit out: an empty slot writes its throwaway position 0 again and
        moves nothing. The feed arrays are written in place: they are the ones a backend bound."""
        if rows is None:
            ids, positions, mask, write = s.views
            width = s.mask.shape[1]
            for b, token in enumerate(tokens.ravel().tolist()):
                ids[b] = token
                positions[b] += 1
                mask[b * width + write[b]] = 1
        else:
            s.feeds["input_ids"][: len(tokens)] = tokens
            s.positions[rows] += 1
            s.mask[rows, s.write[rows]] = 1
        feeds = s.feeds if n == s.batch else {k: v[:n] for k, v in s.feeds.items()}
        past = s.cache if n == s.batch else [rt._leading(b, n) for b in s.cache]
        out, _ = rt._run(contract.DECODE, feeds, past, s, in_place=True)
        if rows is None:
            for b in range(len(tokens)):
                write[b] += 1
        else:
            s.write[rows] += 1
        return out

    def keep(self, rt: Runtime, s: Session, rows: np.ndarray) -> None:
        super().keep(rt, s, rows)
        s.write = s.write[rows]
        self._feeds(s)

    # --- slots: one session whose rows requests take and leave (runtimes/batching.py) ---

    def open_slots(self, rt: Runtime, count: int) -> Session:
        """An empty session of `count` slots, each a row of the capacity buffers."""
        d = rt.dims
        buffers = [rt._alloc_cache((count, d.num_kv_heads, self.capacity, d.head_dim), d.kv_dtype)
                   for _ in range(2 * d.num_layers)]
        s = Session(rt, buffers, np.ones((count, 1), np.int64), 0)
        s.mask = np.zeros((count, self.capacity), dtype=np.int64)
        s.write = np.zeros((count,), dtype=np.int64)
        for slot in range(count):
            self.free(s, slot)
        self._feeds(s)
        return s

    def admit(self, rt: Runtime, s: Session, slot: int, ids: np.ndarray) -> StepOutput:
        """Prefill one prompt (1, T) alone, as `tk generate` of it would, into row `slot`."""
        T = ids.shape[1]
        self._check_prompt(T)
        s.mask[slot] = 0
        s.mask[slot, :T] = 1
        s.positions[slot] = T - 1
        s.write[slot] = T
        if rt.prefills_in_decode:
            return self._prefill_row(rt, s, slot, ids)
        out, present = _prefill(rt, ids, np.ones_like(ids))
        for buf, src in zip(s.cache, present):
            rt._write_prefix(buf, src, T, row=slot)
        rt._release(present)
        return out

    @staticmethod
    def free(s: Session, slot: int) -> None:
        """An empty slot: one visible position (0), so that its throwaway row computes no NaN."""
        s.mask[slot] = 0
        s.mask[slot, 0] = 1
        s.positions[slot] = 0
        s.write[slot] = 0

    def step_slots(self, rt: Runtime, s: Session, tokens: np.ndarray, active: list[int], n: int) -> StepOutput:
        """One decode step of the `active` slots (each at its own length) over the first `n` rows
        (the rows past the last active one are not computed where the backend can view rows)."""
        rows = np.asarray(active, dtype=np.int64)
        if s.write[rows].max() >= self.capacity:
            raise InputError(f"decode: a slot's static cache of {self.capacity} positions is full")
        return self._decode(rt, s, tokens, rows, n)


def layout_for(dims: contract.GraphDims) -> DynamicLayout | StaticLayout:
    return StaticLayout(dims.kv_capacity, dims.decode_prefills) if dims.kv_capacity is not None else DynamicLayout()
