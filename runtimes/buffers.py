"""What a backend supplies to the cache layouts: its cache buffers, behind one public face.

A layout (runtimes/cache_layouts.py) is bound to a runtime's `CacheBuffers` when the runtime is
built, and asks it to allocate, copy, read, view, take and free buffers; it never looks inside
one. `CacheBuffers` itself holds the cache as numpy arrays; a backend whose cache lives elsewhere
(torch tensors, ONNX Runtime's device OrtValues, TensorRT's device memory) subclasses it in its
own module and overrides what differs. A subclass's state that exists only while its runtime is
loaded (a device, a CUDA stream) is set by the runtime's `_load` and put back by its `_unload`.
Imports nothing of runtimes.
"""

from __future__ import annotations

import numpy as np

from tk.models.spec.dtypes import DTYPES


def rows_of(row: int | None) -> slice:
    """The batch rows one copy touches: all (None), or that one."""
    return slice(None) if row is None else slice(row, row + 1)


class CacheBuffers:
    """A cache's (B, H, T, D) buffers as numpy arrays."""

    row_views = True  # `leading` views a buffer's first rows without a copy (else slots run every row)
    row_slices = True  # a buffer slices to any one row (`b[r:r + 1]`): numpy arrays and torch tensors

    def alloc(self, shape: tuple, dtype: str):
        """A zeroed buffer of `shape` and the contract's `dtype`."""
        return np.zeros(shape, dtype=DTYPES[dtype].numpy)

    def copy_positions(self, dst, src, count: int, dst_row: int | None = None, src_row: int | None = None,
                       src_at: int = 0, dst_at: int = 0) -> None:
        """Copy `count` positions of a (B, H, T, D) present tensor, from its position src_at, into a
        static buffer from its position dst_at: every row, or row src_row of src into row dst_row."""
        dst[rows_of(dst_row), :, dst_at:dst_at + count] = self.to_numpy(src)[rows_of(src_row), :, src_at:src_at + count]

    def read_positions(self, buf, row: int, start: int, end: int):
        """A copy of row `row`'s positions start .. end - 1 of a static buffer, (1, H, n, D), that
        `copy_positions` takes as its source (a prefix cache's block)."""
        return np.array(self.to_numpy(buf)[row:row + 1, :, start:end])

    def read_row(self, buf, row: int):
        """A copy of one batch row of a buffer (a recurrent state's, kept while its row sits a step out)."""
        return np.array(self.to_numpy(buf)[row])

    def write_row(self, buf, row: int, value=None) -> None:
        """Write `read_row`'s copy back into the row, or zeros (None: a recurrent state's start)."""
        buf[row] = 0 if value is None else value

    def leading(self, buf, n: int):
        """The first `n` batch rows of a buffer, sharing its memory."""
        return buf[:n]

    def to_numpy(self, buf) -> np.ndarray:
        return np.asarray(buf)

    def from_numpy(self, array: np.ndarray):
        return array

    def release(self, buffers: list | None) -> None:
        """Free buffers the backend must free itself (device memory without a finalizer)."""

    def take(self, buffers: list, rows: np.ndarray) -> list:
        """The given batch rows of a cache, as new buffers (a session's rows leaving); the old are released."""
        out = [self.from_numpy(np.ascontiguousarray(self.to_numpy(b)[rows])) for b in buffers]
        self.release(buffers)
        return out
