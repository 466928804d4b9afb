"""Folders that appear whole: what `tk export --force` and `tk triton --force` write is built in a
temporary sibling and moved into place, so a reader never sees half of one, and a failure leaves
the old folder as it was."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def move_into_place(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out`; an `out` that exists is renamed aside first (and put back if the move
    fails), and deleted only once the new one is in place."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)
