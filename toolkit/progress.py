"""What long work (export, eval, engine builds, bench) tells its caller while it runs: the step it is
on (`step("quantize")`), notes (one line of what was done, as the pipeline always said), and
measured tasks (`task("quantize", total, "B")`, advanced as units are done) that a terminal shows
with a rate and an estimate.

The pipeline takes a `Progress` or any plain `str` callable (`said.append`, `print`): `Progress.of`
wraps the latter so that notes reach it and steps and tasks say nothing. `StderrProgress` is what
the CLI shows: on a terminal, tqdm bars (imported only there: the library is the CLI's); anywhere
else, one plain line per step and one per finished task, no bars and no carriage returns. All of it
goes to stderr, so a command's stdout (`--json`) stays its result.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


class Task:
    """One measured piece of work of `total` units (`unit`: "B" for bytes) and, optionally, `items`
    things (tensors, windows) whose count is shown beside it. `advance` may be called from another
    thread (the weights writer's); a context manager, so a failure ends it too."""

    def __init__(self, name: str, total: float, unit: str = "it", items: int | None = None, item: str = ""):
        self.name, self.total, self.unit, self.items, self.item = name, total, unit, items, item
        self.done, self.items_done = 0, 0
        self.start = self.last = time.perf_counter()

    def advance(self, n: float = 1, items: int = 0) -> None:
        self.done += n
        self.items_done += items
        self.last = time.perf_counter()

    def close(self, failed: bool = False) -> None:
        pass

    def summary(self) -> str:
        """'quantize: 40 tensors, 12.3 MiB in 1.2 s (10.2 MiB/s)': the time to the last unit, not to the
        end of the caller's block (the weights writer finishes while tracing goes on)."""
        seconds = max(self.last - self.start, 1e-9)
        what = f"{self.items_done} {self.item}, " if self.items is not None else ""
        return f"{self.name}: {what}{amount(self.done, self.unit)} in {seconds:.1f} s " \
               f"({amount(self.done / seconds, self.unit)}/s)"

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(failed=kind is not None)


class Progress:
    """Reports nothing but notes, which go to `note`; subclasses show steps and tasks."""

    def __init__(self, note: Callable[[str], None] | None = None):
        self._note = note or (lambda msg: None)

    @classmethod
    def of(cls, progress: "Progress | Callable[[str], None] | None") -> "Progress":
        return progress if isinstance(progress, Progress) else cls(progress)

    def __call__(self, msg: str) -> None:
        self._note(msg)

    def step(self, name: str) -> None:
        """The work's next step begins (export: load, trace, quantize or weights, write, validate)."""

    def task(self, name: str, total: float, unit: str = "it", items: int | None = None, item: str = "") -> Task:
        return Task(name, total, unit, items, item)


class StderrProgress(Progress):
    """The CLI's: tqdm bars on a terminal, plain lines elsewhere (`bars` says which; default: whether
    stderr is a terminal). A step is a line of its own, `[name]`; notes are indented under it as `tk export`
    always printed them."""

    def __init__(self, stream: TextIO | None = None, bars: bool | None = None):
        self.stream = stream or sys.stderr
        self.bars = self.stream.isatty() if bars is None else bars
        super().__init__(self._note_line)

    def _line(self, text: str) -> None:
        if self.bars:  # above the bars, which tqdm redraws below them
            from tqdm import tqdm

            tqdm.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def _note_line(self, msg: str) -> None:
        self._line(f"  {msg}")

    def step(self, name: str) -> None:
        self._line(f"[{name}]")

    def task(self, name: str, total: float, unit: str = "it", items: int | None = None, item: str = "") -> Task:
        return _Bar(self, name, total, unit, items, item) if self.bars else _Line(self, name, total, unit, items, item)


class _Line(Task):
    """Without a terminal: one line when the task ends, none while it runs."""

    def __init__(self, out: StderrProgress, *args):
        super().__init__(*args)
        self.out = out

    def close(self, failed: bool = False) -> None:
        if not failed:
            self.out(self.summary())


class _Bar(Task):
    """On a terminal: a tqdm bar with rate and estimate (bytes in KiB/MiB/GiB), the items done beside it."""

    def __init__(self, out: StderrProgress, *args):
        super().__init__(*args)
        from tqdm import tqdm

        binary = self.unit == "B"
        self.bar = tqdm(total=self.total, desc=f"  {self.name}", unit=self.unit, unit_scale=binary,
                        unit_divisor=1024 if binary else 1000, file=out.stream, dynamic_ncols=True, leave=True)

    def advance(self, n: float = 1, items: int = 0) -> None:
        super().advance(n, items)
        if self.items is not None and items:
            self.bar.set_postfix_str(f"{self.items_done}/{self.items} {self.item}", refresh=False)
        self.bar.update(n)
        if self.done >= self.total:  # frozen at its own time: a writer ends before the block around it
            self.bar.close()

    def close(self, failed: bool = False) -> None:
        self.bar.close()


def amount(n: float, unit: str) -> str:
    """12.3 MiB for bytes, else '40 windows'-style counts ('1.5 it' for fractions)."""
    if unit == "B":
        for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if n >= size:
                return f"{n / size:,.1f} {name}"
        return f"{n:,.0f} B"
    return f"{n:,.0f} {unit}" if n >= 100 or float(n).is_integer() else f"{n:.1f} {unit}"
