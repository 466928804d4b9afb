"""runtimes/backends/hugepages.py: memory that appeared after a snapshot is put on 2-MiB pages, as the
kernel itself reports (smaps), and memory that was there before is left alone."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from tk.runtimes.backends import hugepages


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (smaps). madvise splits
    a mapping at the 2-MiB boundaries it was given, so ask about an address inside them."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _thp_mode() -> str:
    try:
        return hugepages.THP_MODE.read_text()
    except OSError:
        return "[never]"


def _private_block(mib: int):
    """Anonymous private memory with every page written; numpy is not used, since it asks for huge
    pages on large arrays by itself. -> (mapping, address)."""
    block = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.write(b"\x01" * (mib << 20))
    return block, ctypes.addressof(ctypes.c_char.from_buffer(block))


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.skipif("[never]" in _thp_mode(), reason="needs Linux with transparent huge pages (madvise or always)")
@pytest.mark.skipif(_kernel() < (6, 1), reason="needs Linux 6.1 or later (MADV_COLLAPSE)")
def test_new_memory_goes_on_huge_pages_and_old_memory_is_left_alone():
    old, old_at = _private_block(8)  # mapped before the snapshot
    before = hugepages.anonymous_regions()
    new, new_at = _private_block(32)  # mapped after it
    regions = hugepages.mapped_since(before, hugepages.anonymous_regions())
    assert any(lo <= new_at < hi for lo, hi in regions)
    assert not any(lo <= old_at < hi for lo, hi in regions)
    assert hugepages.back_with_huge_pages(regions) >= 30 << 20
    assert _anon_huge_kib(new_at + (16 << 20)) >= 28 << 10  # the kernel backs the new block with huge pages
    if "[madvise]" in _thp_mode():
        assert _anon_huge_kib(old_at + (4 << 20)) == 0  # not asked for: still ordinary pages
    assert new[: 1 << 20] == b"\x01" * (1 << 20) and new[-1] == 1  # and the data is intact
    old.close()
    new.close()


def test_mapped_since_subtracts_what_was_mapped_before():
    before = {(100, 200), (300, 400)}
    assert hugepages.mapped_since(before, {(100, 200)}) == []
    assert hugepages.mapped_since(before, {(50, 450)}) == [(50, 100), (200, 300), (400, 450)]  # merged mappings
    assert hugepages.mapped_since(before, {(300, 500), (600, 700)}) == [(400, 500), (600, 700)]  # grown, new


def test_nothing_to_do_is_quiet():
    assert hugepages.back_with_huge_pages(set()) == 0
    assert hugepages.back_with_huge_pages({(4096, 8192)}) == 0  # smaller than one huge page


@pytest.mark.parametrize("wanted", [True, False])
def test_ort_runtime_asks_only_for_what_its_sessions_mapped(tiny_artifact, monkeypatch, wanted):
    from tk.runtimes.backends.ort import OrtRuntime

    asked = []
    monkeypatch.setattr(hugepages, "back_with_huge_pages", lambda regions: asked.append(regions) or 0)
    with OrtRuntime(tiny_artifact, huge_pages=wanted) as rt:
        assert rt.huge_page_bytes == 0
    assert len(asked) == int(wanted)  # once, after both sessions exist
    assert all(start < end for start, end in (asked[0] if wanted else []))
