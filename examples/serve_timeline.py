"""What each step of `tk serve` ran and what it cost: a timeline of the batcher's steps, and its sums.

    python examples/serve_timeline.py record OUT.jsonl -- serve ARTIFACT --slots 8 --port 8000 --lookup
    python examples/serve_timeline.py summary OUT.jsonl

`record` runs tk's CLI (the arguments after `--`) in this process with every batcher step written to
OUT.jsonl as it ends: one JSON object a step with its start (`t`, seconds since the server began),
its wall time (`dt`), the slots that decode plainly (`decode`), verify guesses (`verify`: slot and
guesses) and prefill (`prefill`: slot and tokens), and each run it made (`runs`: tokens, seconds, and
kind: `p` a prompt chunk, `d` a plain decode, `v` a verify). bench_serve.py takes it as a `--server`
command (`NAME=python examples/serve_timeline.py record OUT -- serve ARTIFACT ... --port {port}`).
`summary` prints, per kind of run, the runs, their tokens and seconds and the milliseconds a token,
and the steps' wall time against the runs' (what the batcher's Python and waits add): where the
time of a load benchmark went (README, "Serving": the copy workload at the float32 roof).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

KINDS = {"p": "prompt chunks", "d": "plain decode", "v": "verify"}


def install(path: Path) -> None:
    """Wrap the batcher's step (runtimes/serving/stepping.py: Steps.run) to write the timeline to `path`."""
    from tk.runtimes.serving import stepping

    out, start, run = open(path, "w", buffering=1), time.perf_counter(), stepping.Steps.run  # noqa: SIM115

    def timed_run(self, plan):
        runs, timed = [], self._timed

        def timing(tokens, fn, prompt=False, decode=False):
            tick = time.perf_counter()
            try:
                return timed(tokens, fn, prompt, decode)
            finally:
                runs.append([tokens, round(time.perf_counter() - tick, 5), "p" if prompt else "d" if decode else "v"])
        self._timed = timing
        tick = time.perf_counter()
        try:
            run(self, plan)
        finally:
            del self._timed  # (the class's own again)
            out.write(json.dumps({"t": round(tick - start, 4), "dt": round(time.perf_counter() - tick, 5),
                                  "decode": [s.slot for s in plan.decode],
                                  "verify": [[g.seq.slot, g.k] for g in plan.verify],
                                  "prefill": [[c.seq.slot, c.end - c.start] for c in plan.prefill],
                                  "runs": runs}) + "\n")

    stepping.Steps.run = timed_run


def summary(path: Path) -> dict:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = {"steps": len(steps), "wall_s": sum(s["dt"] for s in steps)}
    for kind, name in KINDS.items():
        runs = [r for s in steps for r in s["runs"] if r[2] == kind]
        tokens, seconds = sum(r[0] for r in runs), sum(r[1] for r in runs)
        out[name] = {"runs": len(runs), "tokens": tokens, "s": round(seconds, 3),
                     "ms_per_token": round(1e3 * seconds / tokens, 3) if tokens else None}
    out["outside_runs_s"] = round(out["wall_s"] - sum(out[n]["s"] for n in KINDS.values()), 3)
    out["wall_s"] = round(out["wall_s"], 3)
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("record", "summary"))
    ap.add_argument("timeline", type=Path)
    ap.add_argument("tk", nargs=argparse.REMAINDER, help="record: -- then tk's arguments")
    args = ap.parse_args(argv)
    if args.mode == "summary":
        if not args.timeline.is_file():
            ap.error(f"no timeline at {args.timeline}: record one first")
        print(json.dumps(summary(args.timeline), indent=1))
        return
    rest = args.tk[1:] if args.tk[:1] == ["--"] else args.tk
    if not rest:
        ap.error("record takes tk's arguments after --, e.g. -- serve ARTIFACT --port 8000")
    install(args.timeline)
    from tk.toolkit.cli.main import entry

    sys.argv = ["tk", *rest]
    entry()


if __name__ == "__main__":
    main(sys.argv[1:])
