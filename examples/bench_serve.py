"""Load benchmark of `tk serve`: N concurrent clients over a fixed mix of prompt and output lengths.

    python examples/bench_serve.py ARTIFACT [--concurrency 1,4,16] [--rounds 2] [--slots 16]
    python examples/bench_serve.py --url http://127.0.0.1:8000 --artifact ARTIFACT   # a server already up

Starts `tk serve ARTIFACT --port 0` (one process, 127.0.0.1) unless given --url, then for each
round runs every concurrency level over the same requests, in alternating order (1, 4, 16, then
16, 4, 1, ...): the machines are shared and noisy, so the ratio of each level to one-at-a-time
is taken within a round, and the median over rounds is reported. Each request streams (SSE) with
`return_token_ids`, greedy, `ignore_eos` (so its output length is the mix's); its tokens are
checked against `tk generate` of its prompt alone (generate_text on an ONNX Runtime session in
this process): a request lost or mixed up fails the run (exit 1). Reports requests/s, tokens/s,
time to first token and inter-token latency p50/p99 per level.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import numpy as np


PROMPT_LENS = (16, 48, 96, 160)
OUTPUT_LENS = (32, 64, 128, 96)


def mix(vocab: int, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n requests: (prompt ids, output length), lengths cycling through the two tables out of step."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, size=PROMPT_LENS[i % 4]).tolist(), OUTPUT_LENS[(i // 4 + i) % 4]) for i in range(n)]


def one(url: str, model: str, prompt: list[int], n: int) -> dict:
    """One streamed completion: its tokens, time to first token and the gaps between tokens."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        return {"error": f"{resp.status} {resp.read()[:200]!r}", "tokens": []}
    tokens, times = [], []
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        new = chunk["choices"][0].get("token_ids") or []
        tokens += new
        times += [time.perf_counter()] * len(new)
    conn.close()
    gaps = list(np.diff(times)) if len(times) > 1 else []
    return {"tokens": tokens, "ttft": times[0] - start if times else float("nan"), "gaps": gaps}


def level(url: str, model: str, requests, clients: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda r: one(url, model, *r), requests))
    wall = time.perf_counter() - start
    tokens = sum(len(r["tokens"]) for r in results)
    ttft = [r["ttft"] for r in results if "ttft" in r]
    gaps = [g for r in results for g in r.get("gaps", [])]
    pct = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"clients": clients, "wall_s": wall, "requests_per_s": len(results) / wall, "tokens_per_s": tokens / wall,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(gaps, 50),
            "itl_ms_p99": pct(gaps, 99), "results": results}


def solo_tokens(artifact: Path, requests) -> list[list[int]]:
    from tk.models.artifact import Manifest
    from tk.runtimes.generate import generate
    from tk.toolkit.backends import BackendOptions, open_runtime

    manifest = Manifest.read(artifact)
    with open_runtime(artifact, "ort", BackendOptions(static_cache=True)) as rt:
        return [generate(rt, [p], n, eos_ids=manifest.eos_token_ids, ignore_eos=True).rows[0].tokens
                for p, n in requests]


def start_server(artifact: Path, slots: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    tk = Path(sys.executable).parent / "tk"
    cmd = [str(tk), "serve", str(artifact), "--port", "0", "--slots", str(slots), "--model-name", "bench"]
    proc = subprocess.Popen(cmd + (["--threads", str(threads)] if threads else []), stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
    if not found:
        proc.kill()
        sys.exit(f"tk serve did not start: {line}{proc.stderr.read()}")
    threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()  # keep it drained
    return proc, found.group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path, nargs="?", help="A static-cache tk export (served unless --url)")
    ap.add_argument("--url", help="Benchmark this running server instead (give --artifact for the solo check)")
    ap.add_argument("--artifact", dest="artifact_opt", type=Path)
    ap.add_argument("--model", default="bench", help="The model name the server serves (with --url)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()
    artifact = args.artifact or args.artifact_opt
    if artifact is None:
        ap.error("give ARTIFACT (and --url to benchmark a server already running)")
    from tk.models.artifact import Manifest

    requests = mix(Manifest.read(artifact).dims.vocab_size, args.requests)
    solo = solo_tokens(artifact, requests)
    proc, url = (None, args.url) if args.url else start_server(artifact, args.slots, args.threads)
    model = args.model if args.url else "bench"
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: dict[int, list[dict]] = {c: [] for c in levels}
    bad = 0
    try:
        one(url, model, requests[0][0], 4)  # warm up
        for r in range(args.rounds):
            for c in (levels if r % 2 == 0 else levels[::-1]):
                run = level(url, model, requests, c)
                wrong = [i for i, (res, want) in enumerate(zip(run.pop("results"), solo)) if res["tokens"] != want]
                bad += len(wrong)
                run["mismatched"] = wrong
                runs[c].append(run)
                print(f"round {r} clients {c:3d}: {run['tokens_per_s']:8.1f} tokens/s  {run['requests_per_s']:6.2f} req/s  "
                      f"TTFT p50 {run['ttft_ms_p50']:7.1f} p99 {run['ttft_ms_p99']:7.1f} ms  "
                      f"ITL p50 {run['itl_ms_p50']:6.1f} p99 {run['itl_ms_p99']:6.1f} ms  mismatched {len(wrong)}",
                      flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    base = levels[0]
    summary = {}
    for c in levels:
        ratios = [run["tokens_per_s"] / b["tokens_per_s"] for run, b in zip(runs[c], runs[base])]
        summary[c] = {"tokens_per_s_ratio_to_%d" % base: statistics.median(ratios), "ratios": ratios,
                      **{k: statistics.median(run[k] for run in runs[c]) for k in runs[c][0] if k != "mismatched"}}
        print(f"clients {c:3d}: {summary[c]['tokens_per_s']:8.1f} tokens/s, x{summary[c]['tokens_per_s_ratio_to_%d' % base]:.2f} "
              f"of {base} client(s) (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"responses not equal to their solo run: {bad}")
    if args.report:
        args.report.write_text(json.dumps({"artifact": str(artifact), "requests": args.requests, "slots": args.slots,
                                           "levels": summary, "runs": runs, "mismatched": bad}, indent=2))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
