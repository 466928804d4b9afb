"""How decode time per token grows with the past: prefill P tokens, time the next N decode steps,
for each P, alternated over repeats, medians. The performance target: at most +15% from 128 to 1024.

    python examples/decode_growth.py ARTIFACT [ARTIFACT ...] [--past 128 1024] [--steps 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from tk.runtimes.decoding.generate import generate
from tk.runtimes.backends.ort import OrtRuntime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--past", nargs="+", type=int, default=[128, 1024])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    runtimes = {a: OrtRuntime(a, threads=args.threads, prepack=True).activate() for a in args.artifacts}
    rng = np.random.default_rng(0)
    prompts = {p: rng.integers(0, next(iter(runtimes.values())).dims.vocab_size, p).tolist() for p in args.past}
    times = {(a, p): [] for a in runtimes for p in args.past}
    for rt in runtimes.values():
        generate(rt, [prompts[args.past[0]]], 8, ignore_eos=True)  # warm-up
    for _ in range(args.repeats):
        for a, rt in runtimes.items():
            for p in args.past:
                times[(a, p)].append(generate(rt, [prompts[p]], args.steps, ignore_eos=True).decode_ms_per_token)
    for a in runtimes:
        med = {p: statistics.median(times[(a, p)]) for p in args.past}
        cells = "  ".join(f"past {p}: {m:.2f} ms" for p, m in med.items())
        growth = med[args.past[-1]] / med[args.past[0]] - 1
        print(f"{a}: {cells}  growth {100 * growth:+.1f}%")


if __name__ == "__main__":
    main()
