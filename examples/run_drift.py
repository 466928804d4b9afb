"""How far a run of tokens' logits are from one-token steps' on an artifact: what a speculative
verify run (a run of tokens) computes against what plain decoding (a step a token) computes.

    python examples/run_drift.py ARTIFACT [ARTIFACT ...] [--tokens 24] [--at 4,8,16,23] [--float-compute]

For each artifact: decode `--tokens` greedy tokens after the `free` workload's prompt a step at a
time, then run each prefix of `--at` tokens as one run and print the largest |logit difference| at
its last position. The standard graphs that give no attention GEMM one row (Variant.pad_queries:
`--for serve`) give 0. The others differ by the kernels' rounding: about 1e-5 in float32, and with int8 compute
(int4/int8 exports on ONNX Runtime) a flipped rounding of a large activation moves the logits by far
more, so a near-tie can break differently in a verify run (README, "Speculative decoding").
`--float-compute` runs quantized exports with float compute (MatMulNBits accuracy level 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    from tk.toolkit.backends import BackendOptions, open_runtime
    from tk.toolkit.textgen import Tokenizer
    from tk.toolkit.tools.bench_speculative import workload_ids
    from tk.toolkit.verify.metrics import run_trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--at", default="4,8,16,23", help="prefix lengths (new tokens) run as one run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--float-compute", action="store_true")
    args = ap.parse_args()
    at = [int(a) for a in args.at.split(",")]
    if not at or max(at) >= args.tokens or min(at) < 1:
        ap.error(f"--at takes prefix lengths from 1 to --tokens - 1 ({args.tokens - 1})")
    options = BackendOptions(threads=args.threads, quant_compute="float" if args.float_compute else "int8")
    for art in args.artifacts:
        with open_runtime(art, "ort", options.for_runs("ort")) as rt:
            ids = workload_ids("free", Tokenizer.find(art), rt.dims.vocab_size)
            prompt = np.array([ids])
            steps = run_trace(rt, prompt, np.ones_like(prompt), args.tokens, keep_present=False)
            new = steps.tokens[0].tolist()
            drift = []
            for n in at:
                run = np.array([ids + new[:n]])
                one = run_trace(rt, run, np.ones_like(run), 1, keep_present=False)
                drift.append(float(np.abs(one.logits[0][0, -1] - steps.logits[n][0, -1]).max()))
        print(f"{art}: max |logit difference|, a run of tokens against steps, after "
              + ", ".join(f"{n}: {d:.2e}" for n, d in zip(at, drift)), flush=True)


if __name__ == "__main__":
    main()
