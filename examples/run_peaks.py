"""What each kind of run a server makes holds while it runs: the peak RSS above the settled base.

    python examples/run_peaks.py ARTIFACT [--slots 16] [--guesses 8] [--prompt 512]

Opens the artifact's ONNX Runtime session as `tk serve` does (no arena, glibc's mmap threshold kept,
the heap trimmed before each run), fills `--slots` rows with 300-token prompts (shorter where the cache is), then runs once each:
a decode step of every row, a verify run of every row and of half of them (`--guesses` + 1 tokens a
row), a group of 4 prompts' first runs and one `--prompt`-token prompt alone. Each line is the base
RSS before the run and VmHWM's rise over it (reset through /proc/self/clear_refs): a soak's RSS
samples include whatever such run is in flight, so this is how far above its base a sample can land
(`examples/soak_serve.py`; README, "Memory"). Linux only.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 2 ** 20  # kB -> GiB
    raise SystemExit(f"/proc/self/status has no {key}: this measures on Linux only")


def _peak(label: str, run) -> None:
    from tk.runtimes.serving.heap import trim_heap

    trim_heap()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS:")
    run()
    print(f"{label:38s} base {base * 1024:8.1f} MiB, peak +{(_status('VmHWM:') - base) * 1024:.1f} MiB", flush=True)


def main() -> None:
    from tk.runtimes.serving.heap import fix_mmap_threshold
    from tk.runtimes.slots import Slots
    from tk.toolkit.backends import BackendOptions, open_runtime

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--guesses", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.slots < 8:
        ap.error("--slots must be at least 8 (a group of 4 prompts goes in rows the others left)")

    fix_mmap_threshold()
    opts = dataclasses.replace(BackendOptions(threads=args.threads, static_cache=True), arena=False)
    rng = np.random.default_rng(0)
    with open_runtime(args.artifact, "ort", opts.for_runs("ort")) as rt, Slots(rt, args.slots) as s:
        n, rows, V, cap = args.slots, list(range(args.slots)), rt.dims.vocab_size, rt.layout.capacity
        if args.prompt >= cap:
            ap.error(f"--prompt {args.prompt} leaves no room in the artifact's static cache of {cap}: pass a shorter one")
        fill, head = min(300, cap - args.guesses - 2), min(256, cap // 2)  # (a small artifact: shorter prompts)
        for b in rows:
            s.admit(b, rng.integers(1, V, size=fill).tolist())
        _peak(f"decode step, {n} rows", lambda: s.step(np.full(n, 7), rows))
        written = [s.written(b) for b in rows]
        for m in (n, n // 2):
            guesses = np.full((m, args.guesses + 1), 5)
            _peak(f"verify run, {m} rows x {args.guesses + 1}", lambda: s.verify_many(rows[:m], guesses))
            for b in rows[:m]:
                s.rewind(b, written[b])
        ids = [rng.integers(1, V, size=head) for _ in range(4)]
        for b in range(4):
            s.free(b)

        for b in range(4):
            s.begin(b, ids[b].tolist())
        if rt.layout.first_groups(rt, [0, 1, 2, 3], [head] * 4):
            _peak(f"4 prompts' first runs (4 x {head} tokens)", lambda: rt.layout.prefill_first(s.session, [0, 1, 2, 3], ids))
        else:
            print("4 prompts' first runs: one a run on this artifact (no group)")
        s.free(5)
        one = rng.integers(1, V, size=args.prompt).tolist()
        _peak(f"one {args.prompt}-token prompt", lambda: s.admit(5, one))


if __name__ == "__main__":
    main()
