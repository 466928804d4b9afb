"""The families issue's benchmarks: a mixture of experts against a dense model of the same active
parameters, and a Gemma-3-style model at long context against short.

Writes the presets (models/fixtures/presets.py) `small` (55M, dense), `small-moe` (Mixtral-style, 8 experts of
half small's FFN, top 2: small's active parameters, 106M in all) and `small-gemma3` (12 layers, 5
sliding with a window of 512 to 1 global), plus a control: `small-gemma3` with every layer global.
Exports each `--for ort-cpu` (the fastest CPU graphs; the Gemma ones with a static cache of 4,608
positions, so a sliding layer's cache is a ring of 512 + 127 slots) and runs `tk bench` on them,
alternating the contenders round by round (the machine is shared: compare only within a round):

- MoE: batch-1 decode ms/token of small-moe over small's (prompt 128, 128 new tokens); the goal is
  at most 1.5x.
- Gemma: decode ms/token after 4,096 past positions against after 512. The goal: no slower than at
  512 plus the global layers' share, where that share is measured on the all-global control:
  t(4096) <= t(512) + (global layers / layers) * (t_all(4096) - t_all(512)).
- Memory: each export's static cache bytes from `tk inspect` (rings against the control's full
  buffers), and the RSS a session at 4,096 positions gives back when it closes: its cache buffers (in
  a process of its own whose allocator maps every large buffer, MALLOC_MMAP_THRESHOLD_, so that a freed
  buffer leaves RSS; ONNX Runtime's arena keeps what it grew).

    python examples/bench_families.py --work /tmp/families --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CAPACITY = 4608  # 4,096 past positions, 64 new tokens, and room


def sh(*args) -> str:
    out = subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True)
    return out.stdout


def prepare(work: Path) -> dict[str, Path]:
    """name -> artifact (written and exported once; kept between runs of this script)."""
    from tk.models.fixtures.presets import write_preset

    models = {"small": ("small", {}), "small-moe": ("small-moe", {}), "small-gemma3": ("small-gemma3", {}),
              "all-global": ("small-gemma3", {"sliding_window_pattern": 1})}  # (i + 1) % 1 == 0: every layer global
    artifacts = {}
    for name, (preset, changes) in models.items():
        ckpt, art = work / f"{name}-ckpt", work / f"{name}-ort-cpu"
        if not (ckpt / "config.json").is_file():
            write_preset(preset, ckpt, **changes)
        if not (art / "manifest.json").is_file():
            capacity = ["--max-seq-len", CAPACITY] if preset == "small-gemma3" else []
            sh("tk", "export", ckpt, "-o", art, "--for", "ort-cpu", "--no-validate", *capacity)
        artifacts[name] = art
    return artifacts


RSS_PROBE = """
import os, sys
import numpy as np
from tk.runtimes.backends.ort import OrtRuntime

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

with OrtRuntime(sys.argv[1], threads=2) as rt:
    ids = (np.arange(4096) % (rt.dims.vocab_size - 2) + 2)[None]
    out, session = rt.start(ids, np.ones_like(ids))
    with session:
        for _ in range(8):
            rt.step(session, [5])
        held = rss()
    print(held - rss())
"""


def session_rss(artifact: Path) -> int:
    """The RSS a session at 4,096 positions (+ 8 decode steps) gives back when it closes: its cache."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # a freed large buffer is unmapped at once
    return int(subprocess.run([sys.executable, "-c", RSS_PROBE, str(artifact)], check=True, capture_output=True,
                              text=True, env=env).stdout.strip())


def bench(artifact: Path, prompt: int, new: int, threads: int) -> dict:
    """One `tk bench` run (2 repeats) -> its ort report."""
    report = artifact.parent / f"bench-{artifact.name}-{prompt}.json"
    sh("tk", "bench", artifact, "--backends", "ort", "--threads", threads, "--prompt-len", prompt,
       "--new-tokens", new, "--repeats", 2, "--report", report)
    return json.loads(report.read_text())["backends"]["ort"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    arts = prepare(args.work)

    memory = {}
    for name in ("small-gemma3", "all-global"):
        plan = json.loads(sh("tk", "inspect", arts[name], "--json"))["memory"]
        memory[name] = {"kv_bytes": plan["kv_bytes"], "positions": plan["kv_positions"],
                        "session_rss_growth_at_4096": session_rss(arts[name])}

    moe, gemma = [], []
    runs = [("small", 128, 128), ("small-moe", 128, 128), ("small-gemma3", 512, 64), ("small-gemma3", 4096, 64),
            ("all-global", 512, 64), ("all-global", 4096, 64)]
    for r in range(args.rounds):
        t = {}
        for name, prompt, new in runs if r % 2 == 0 else runs[::-1]:  # alternate the order round by round
            rep = bench(arts[name], prompt, new, args.threads)
            t[(name, prompt)] = rep["decode_ms_per_token"]["median"]
        moe.append(t[("small-moe", 128)] / t[("small", 128)])
        share = 2 / 12 * (t[("all-global", 4096)] - t[("all-global", 512)])  # 2 global layers of 12
        gemma.append({"t512": t[("small-gemma3", 512)], "t4096": t[("small-gemma3", 4096)], "share": share,
                      "ratio_to_bound": t[("small-gemma3", 4096)] / (t[("small-gemma3", 512)] + share)})
        print(f"round {r + 1}: " + ", ".join(f"{n}@{p} {v:.2f} ms" for (n, p), v in sorted(t.items())), file=sys.stderr)

    result = {
        "moe_over_dense_decode": {"per_round": moe, "median": statistics.median(moe), "goal": "<= 1.5"},
        "gemma_long_context": {"per_round": gemma,
                               "median_ratio_to_bound": statistics.median(g["ratio_to_bound"] for g in gemma),
                               "goal": "<= 1 (t(4096) <= t(512) + the global layers' share)"},
        "static_cache": memory,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
