"""The C heap of a long-running server (glibc; elsewhere nothing): what is freed goes back to the system.

A server's runs allocate and free their intermediate tensors at every shape its requests bring
(ONNX Runtime runs without its arena there), and glibc keeps what was freed, so the process's RSS
would follow the largest mix it has seen, not what it holds (examples/soak_serve.py). Two settings:
- `trim_heap`: malloc_trim gives the heap's free pages back (the batcher calls it whenever it is idle
  and every `TRIM_EVERY_S` while busy; about a millisecond);
- `fix_mmap_threshold`: glibc raises its mmap threshold to the size of every mmapped block freed (up
  to 32 MiB), after which a server's large tensors (logits, activations, prefix-cache blocks) land on
  the heap, where one live neighbour keeps their pages; fixed at 128 KiB (glibc's default), they are
  mapped and unmapped whole. On the real 0.5B (int4 `--for serve`, `--lookup`, 30-minute soaks):
  RSS 1.058x minute 10's at worst and its per-minute medians +1.5% over the last 20 minutes without;
  1.042x and +0.4% with, and 0.1 GiB lower. A 16-row decode step and an 8 x 9 verify run cost the same
  either way (178 and 176 ms, 747 and 754 ms).
"""

from __future__ import annotations

import functools
import os

TRIM_EVERY_S = 10.0  # while busy, the batcher gives the C heap's freed memory back this often (and whenever idle)
MMAP_THRESHOLD = 128 * 1024  # glibc's default, kept: a block this large or larger is mapped on its own
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def trim_heap() -> None:
    """Give the C heap's freed pages back to the system."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at MMAP_THRESHOLD from now on, in this process, unless the environment
    sets one (MALLOC_MMAP_THRESHOLD_, or glibc.malloc.mmap_threshold in GLIBC_TUNABLES: the user's
    choice stands) -> whether this call set it."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018: glibc's, or not glibc
        return libc
    except (OSError, AttributeError):
        return None
