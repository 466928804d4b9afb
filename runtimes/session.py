"""A decode session: the rows of one batch on one runtime, their positions, mask and cache.

Every piece of a session's state is declared here (`__slots__`: nothing is attached from
outside): what both cache layouts keep (`rows`, `positions`, `mask`, `length`, `cache`), what the
static layout adds (`static`, a `StaticState`), and one place that is the backend's own
(`backend`: ONNX Runtime's IO bindings, TensorRT's spare cache buffers), which the backend frees
in `Runtime.release_session_state` and the session then forgets. The layouts
(runtimes/cache_layouts.py) build sessions; callers get them from `Runtime.start`. Imports
nothing of runtimes: base and the layouts both stand on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class StepOutput:
    logits: np.ndarray  # float32 (B, S or 1, V)
    hidden: list[np.ndarray] | None = None  # per layer (B, S, C) float32: debug exports only


@dataclass(slots=True)
class StaticState:
    """What a static-capacity session adds: each row's write index, and the decode graph's feeds,
    rewritten in place every step (so a backend may bind them once per session)."""

    write: np.ndarray  # (B,) int64: per row, the cache index its next token goes to
    feeds: dict[str, np.ndarray]  # the decode feeds; attention_mask, position_ids, write_indices are the session's
    views: tuple[memoryview, ...]  # flat int64 views of input_ids, positions, mask and write (the decode hot path)
    # a narrow mask's arrays, by width (contract.inputs' narrow_mask): the mask's first columns, copied in
    # before each step; the same array for each width and batch, so a backend may bind it once
    narrow: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def over(cls, mask: np.ndarray, positions: np.ndarray, write: np.ndarray, keep: bool = False) -> "StaticState":
        """`keep`: the decode graph takes logits_to_keep (contract.inputs), [0] for a step of one token."""
        feeds = {"input_ids": np.zeros((len(write), 1), np.int64), "attention_mask": mask,
                 "position_ids": positions, "write_indices": write,
                 **({"logits_to_keep": np.zeros(1, np.int64)} if keep else {})}
        # a step where every row advances updates these one element at a time, ~18 us cheaper than
        # numpy calls right after a step (whose weights have just left the CPU's caches), 55M model
        views = tuple(memoryview(a).cast("B").cast("q") for a in (feeds["input_ids"], positions, mask, write))
        return cls(write, feeds, views)


class Session:
    """One batch being decoded on one runtime.

    `rows` are the caller's ids of the rows still in the session (0..B-1 at start); `positions`
    (B, 1) each row's last position id; `mask` (B, width) the attention mask, wider than `length`
    where the layout reserved room; `length` the cache positions written (the same for every row
    of one prefill: left padding fills the gap). Close it (or use `with`) to release device buffers.
    """

    __slots__ = ("runtime", "cache", "rows", "positions", "mask", "length", "static", "backend")

    def __init__(self, runtime, cache: list, mask: np.ndarray, positions: np.ndarray, length: int,
                 static: StaticState | None = None):
        self.runtime = runtime  # the tk.runtimes.base.Runtime that runs it (its graphs, its layout)
        self.cache = cache  # the layout's buffers, in contract order (numpy, OrtValues, device buffers)
        self.rows = list(range(mask.shape[0]))
        self.positions = positions
        self.mask = mask
        self.length = length
        self.static = static  # a static-capacity cache's (runtimes/cache_layouts.StaticLayout)
        self.backend: Any = None  # the backend's own, freed by Runtime.release_session_state

    @property
    def batch(self) -> int:
        return len(self.rows)

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (indices into `rows`, in order): finished rows stop being computed."""
        if list(rows) == list(range(self.batch)):
            return
        idx = np.asarray(rows, dtype=np.int64)
        self.rows = [self.rows[i] for i in rows]
        self.positions = self.positions[idx]
        self.mask = self.mask[idx]
        self.runtime.layout.keep(self, idx)

    def release_backend_state(self) -> None:
        """The backend frees what it keeps for this session (it points at buffers about to change)."""
        self.runtime.release_session_state(self)
        self.backend = None

    def close(self) -> None:
        if self.cache is not None:
            self.runtime.layout.release(self)
            self.cache = None
        self.release_backend_state()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
