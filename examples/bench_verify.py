"""What a speculative verify run costs on ONNX Runtime: decode runs of n tokens per row (a verify
run: the last kept token and n-1 guesses) over a prompt, with the weights prepacked and as the
artifact's memory map, alternated in one process, each run rewound so every run starts from the
same cache. Why `tk generate --lookup/--draft` and `tk bench --workloads` prepack (README,
"Speculative decoding").

    python examples/bench_verify.py ARTIFACT [--prompt-len 256] [--runs 1,2,5,9] [--repeats 5] [--threads 2]

ARTIFACT: a static-cache export whose decode graph verifies runs (`tk export CKPT -o ART --for ort-cpu`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tk.runtimes.backends.ort import OrtRuntime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--runs", default="1,2,5,9", help="comma-separated tokens per verify run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    runs = [int(n) for n in args.runs.split(",")]
    rng = np.random.default_rng(0)
    runtimes = {packed: OrtRuntime(args.artifact, threads=args.threads, prepack=packed).activate()
                for packed in (True, False)}
    vocab = runtimes[True].dims.vocab_size
    prompt = rng.integers(0, vocab, (1, args.prompt_len))
    sessions = {packed: rt.start(prompt, np.ones_like(prompt), room=max(runs))[1] for packed, rt in runtimes.items()}
    times = {(p, n): [] for p in runtimes for n in runs}
    for _ in range(args.repeats + 1):  # the first round warms both up and is dropped
        for n in runs:
            for packed, rt in runtimes.items():
                tokens = rng.integers(0, vocab, (1, n))
                start = time.perf_counter()
                rt.verify(sessions[packed], tokens)
                times[packed, n].append(time.perf_counter() - start)
                rt.rewind(sessions[packed], [args.prompt_len])
    print(f"{args.artifact}: decode runs of n tokens after a {args.prompt_len}-token prompt, "
          f"{args.threads} threads, median of {args.repeats} (ms)")
    print(f"{'n':>3} {'packed':>9} {'unpacked':>9} {'unpacked/packed':>16}")
    for n in runs:
        p, u = (1e3 * statistics.median(times[k, n][1:]) for k in (True, False))
        print(f"{n:>3} {p:9.1f} {u:9.1f} {u / p:15.2f}x")
    for packed, rt in runtimes.items():
        sessions[packed].close()
        rt.deactivate()


if __name__ == "__main__":
    main()
