"""Load benchmark of OpenAI-compatible servers (tk serve, llama.cpp's llama-server, ...), side by side.

    python examples/bench_serve.py ARTIFACT                        # tk serve ARTIFACT, the mixed workload
    python examples/bench_serve.py ARTIFACT --workload shared-prefix \\
        --server "cache=tk serve ARTIFACT --slots 16 --port {port}" \\
        --server "no-cache=tk serve ARTIFACT --slots 16 --port {port} --no-prefix-cache"
    python examples/bench_serve.py ARTIFACT --workload mix --concurrency 16 \\
        --server "tk=tk serve ARTIFACT --slots 16 --port {port}" \\
        --server "llama=llama-server -m F32.gguf -t 2 -np 16 -c 32768 -cb --port {port}" \\
        --server "other=http://127.0.0.1:8080"                    # a server already up

Each `--server NAME=SPEC` is a URL of a running server or a command holding `{port}` (started here
on a free port of 127.0.0.1, ready when GET /health answers 200, stopped at the end); without
one, `tk serve ARTIFACT` is benchmarked. Every request is a streamed (SSE) /v1/completions of
token ids, greedy, `ignore_eos`, so its output length is the workload's on every server. The
servers run in alternating order round after round (the machines are shared and noisy: compare
within a round; the median over rounds is reported). Each round and client count gets prompts of
its own (the same lengths), so no server's prompt cache serves one run from another. Workloads:

- `mix`: prompts of 16..160 tokens, outputs of 32..128, at each `--concurrency` level.
- `streams`: prompts of 32 tokens, 64 new tokens each, at each `--concurrency` level.
- `copy`: answers that copy their prompts (about 1,500 characters of one of tk's modules, then "# The
  same module, copied exactly:" and its first 200 characters, tokenized by the artifact's tokenizer),
  160 new tokens each: where prompt lookup pays (`tk serve --lookup`, `llama-server --spec-type
  ngram-simple`).
- `shared-prefix`: `--requests` (32) prompts that start with the same 400-token system prompt (a
  new one each round, so a round never reuses the last one's cache), 16 clients; the tk server's
  prefix cache hit rate is read from its /metrics.
- `long-prompt`: 8 streams decode; once each has 16 tokens a 1,500-token prompt arrives. Reports
  the streams' longest inter-token gap over their median one (chunked prefill keeps it small).

A server that returns each token's id (tk's `return_token_ids`) has its tokens checked against
`tk generate` of each prompt alone (ONNX Runtime in this process, on the artifact its `tk serve`
command names, else on ARTIFACT, computing as its `--quant-compute` says): a request lost or mixed up fails
the run (exit 1). Other servers' tokens are counted, one per streamed chunk.
Reports requests/s, tokens/s, time to first token and inter-token latency p50/p99.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

PROMPT_LENS = (16, 48, 96, 160)
OUTPUT_LENS = (32, 64, 128, 96)
SYSTEM, LONG, STREAMS = 400, 1500, 8


def mix(vocab: int, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n requests: (prompt ids, output length), lengths cycling through the two tables out of step."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, size=PROMPT_LENS[i % 4]).tolist(), OUTPUT_LENS[(i // 4 + i) % 4]) for i in range(n)]


def shared_prefix(vocab: int, n: int, seed: int = 0, outputs: int = 32) -> list[tuple[list[int], int]]:
    """n prompts: one SYSTEM-token system prompt, then each its own 16..64 tokens."""
    rng = np.random.default_rng(1000 + seed)
    system = rng.integers(3, vocab, size=SYSTEM).tolist()
    return [(system + rng.integers(3, vocab, size=int(rng.integers(16, 65))).tolist(), outputs) for _ in range(n)]


def long_prompt(vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """STREAMS streams (64-token prompts, 160 tokens each), then the long prompt (LONG tokens, 16 out)."""
    rng = np.random.default_rng(2000 + seed)
    return [(rng.integers(3, vocab, size=64).tolist(), 160) for _ in range(STREAMS)] + \
        [(rng.integers(3, vocab, size=LONG).tolist(), 16)]


def streams(vocab: int, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n streams of 64 new tokens each after prompts of 32 token ids."""
    rng = np.random.default_rng(3000 + seed)
    return [(rng.integers(3, vocab, size=32).tolist(), 64) for _ in range(n)]


def copying(artifact: Path, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n prompts whose answers copy them (tk bench's code-edit workload, a module each): 1,500 characters
    of one of tk's modules (from an offset of the round's own), then "# The same module, copied exactly:" and its first 200
    characters; 160 new tokens each. Token ids through the artifact's tokenizer."""
    import inspect

    from tk.runtimes import slots as m7
    from tk.runtimes.decoding import generate as m3, logits as m2, row as m4, rows as m1, sampling as m0, speculative as m5
    from tk.runtimes.serving import scheduler as m6
    from tk.toolkit.textgen import Tokenizer

    tok, modules = Tokenizer(artifact), [m0, m1, m2, m3, m4, m5, m6, m7]
    out = []
    for i in range(n):  # each round its own slice of the module (no server's prompt cache serves another round)
        text = inspect.getsource(modules[i % len(modules)])
        at = (seed * 97 + i * 31) % max(1, len(text) - 1500)
        source = text[at:at + 1500]
        out.append((tok.encode(f"{source}\n\n# The same module, copied exactly:\n{source[:200]}"), 160))
    return out


def one(url: str, model: str | None, prompt: list[int], n: int, on_token=None) -> dict:
    """One streamed completion: its tokens (ids, or one None per chunk where the server sends none),
    time to first token and the times of its tokens."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True, **({"model": model} if model else {})}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        return {"error": f"{resp.status} {resp.read()[:200]!r}", "tokens": [], "times": []}
    tokens, times = [], []
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        new = choice.get("token_ids")
        if new is None:  # a server without return_token_ids: one token per chunk with text
            new = [None] if choice.get("text") or choice.get("finish_reason") is None else []
        tokens += new
        times += [time.perf_counter()] * len(new)
        if on_token is not None and new:
            on_token(len(tokens))
    conn.close()
    return {"tokens": tokens, "ttft": times[0] - start if times else float("nan"), "times": times}


def _pct(xs, q) -> float:
    return 1e3 * float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(results: list[dict], wall: float) -> dict:
    tokens = sum(len(r["tokens"]) for r in results)
    ttft = [r["ttft"] for r in results if r["times"]]
    gaps = [g for r in results for g in np.diff(r["times"])]
    return {"wall_s": wall, "requests_per_s": len(results) / wall, "tokens_per_s": tokens / wall,
            "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99), "itl_ms_p50": _pct(gaps, 50),
            "itl_ms_p99": _pct(gaps, 99), "errors": sum("error" in r for r in results)}


def run_level(url: str, model: str | None, requests, clients: int) -> tuple[dict, list[dict]]:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda r: one(url, model, *r), requests))
    return summarize(results, time.perf_counter() - start), results


def run_long(url: str, model: str | None, requests) -> tuple[dict, list[dict]]:
    """The streams start together; the long prompt goes once every stream has 16 tokens."""
    streams, (long_ids, long_n) = requests[:-1], requests[-1]
    counts, ready = [0] * len(streams), threading.Event()

    def heard(i, n):
        counts[i] = n
        if min(counts) >= 16:
            ready.set()

    start = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(one, url, model, p, n, lambda k, i=i: heard(i, k)) for i, (p, n) in enumerate(streams)]
        ready.wait(600)
        arrived = time.perf_counter()
        long = pool.submit(one, url, model, long_ids, long_n).result()
        results = [f.result() for f in futures] + [long]
    out = summarize(results, time.perf_counter() - start)
    gaps = np.concatenate([np.diff(r["times"]) for r in results[:-1]])
    during = [g for r in results[:-1] for t, g in zip(r["times"][1:], np.diff(r["times"]))
              if arrived <= t <= arrived + long["ttft"] + 1e-3]
    out.update({"long_ttft_ms": 1e3 * long["ttft"], "stream_gap_ms_p50": _pct(gaps, 50),
                "stream_gap_ms_max": 1e3 * float(gaps.max()), "stream_gap_max_over_median": float(gaps.max() / np.median(gaps)),
                "stream_gap_ms_max_during_long_prefill": 1e3 * max(during, default=float("nan"))})
    return out, results


def solo_tokens(artifact: Path, requests, compute: str = "int8") -> list[list[int]]:
    from tk.models.spec.manifest import Manifest
    from tk.runtimes.decoding.generate import generate
    from tk.toolkit.backends import BackendOptions, open_runtime

    manifest = Manifest.read(artifact)
    with open_runtime(artifact, "ort", BackendOptions(static_cache=True, quant_compute=compute)) as rt:
        return [generate(rt, [p], n, eos_ids=manifest.eos_token_ids, ignore_eos=True).rows[0].tokens
                for p, n in requests]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server to benchmark: a URL, or a command started here on a free loopback port."""

    def __init__(self, name: str, spec: str):
        self.name, self.proc, self.model, self.artifact, self.compute = name, None, None, None, "int8"
        if re.match(r"https?://", spec):
            self.url = spec.rstrip("/")
            return
        port = _free_port()
        argv = shlex.split(spec.replace("{port}", str(port)))
        if argv[0] == "tk":  # this environment's tk
            argv[0] = str(Path(sys.executable).parent / "tk")
            self.artifact = Path(argv[2]) if argv[1:2] == ["serve"] else None
            flag = [a.split("=", 1)[1] if "=" in a else b for a, b in zip(argv, argv[1:] + [""])
                    if a.split("=", 1)[0] == "--quant-compute"]
            self.compute = flag[-1] if flag else "int8"  # the solo check computes as the server does
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/bench_serve_{name}.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{name}: {argv[0]} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            self.stop()
            sys.exit(f"{name}: not ready after 600 s; see {self.log.name}")

    def metric(self, name: str) -> float | None:
        try:
            text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        except OSError:
            return None
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.log.close()


def workload(name: str, artifact: Path, vocab: int, n: int, seed: int):
    if name == "mix":
        return mix(vocab, n, seed)
    if name == "streams":
        return streams(vocab, n, seed)
    if name == "copy":
        return copying(artifact, n, seed)
    if name == "shared-prefix":
        return shared_prefix(vocab, n, seed)
    return long_prompt(vocab, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path, help="A static-cache tk export: its vocabulary, and the solo check")
    ap.add_argument("--server", action="append", default=[], metavar="NAME=SPEC",
                    help="A URL, or a command with {port} to start here (repeat: side by side)")
    ap.add_argument("--url", action="append", default=[], help="A running server: the same as --server URL=URL")
    ap.add_argument("--workload", choices=("mix", "streams", "copy", "shared-prefix", "long-prompt"), default="mix")
    ap.add_argument("--concurrency", default="1,4,16", help="Client counts (mix); shared-prefix takes the last")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16, help="tk serve --slots where no --server is given")
    ap.add_argument("--no-check", action="store_true", help="Skip the solo check (tokens are still counted)")
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()
    from tk.models.spec.manifest import Manifest

    vocab = Manifest.read(args.artifact).dims.vocab_size
    specs = [s.split("=", 1) for s in args.server] + [[u, u] for u in args.url] or [["tk", f"tk serve {args.artifact} --slots {args.slots} "
                                                              "--port {port}"]]
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.workload not in ("mix", "streams", "copy"):
        levels = levels[-1:] if args.workload == "shared-prefix" else [STREAMS + 1]
    rounds = [{c: workload(args.workload, args.artifact, vocab, args.requests, 1000 * r + c) for c in levels}
              for r in range(args.rounds)]
    solo: dict[tuple, list[list[int]]] = {}
    servers: list[Server] = []
    runs: dict[tuple[str, int], list[dict]] = {}
    bad = 0
    try:
        for name, spec in specs:
            servers.append(Server(name, spec))
        for s in servers if not args.no_check else []:  # each server's artifact, alone, every run's requests
            for r, by_level in enumerate(rounds):
                for c, reqs in by_level.items():
                    if (key := (s.artifact or args.artifact, s.compute, r, c)) not in solo:
                        solo[key] = solo_tokens(key[0], reqs, s.compute)
        for s in servers:
            one(s.url, s.model, [5, 6, 7, 8], 4)  # warm up
        for r, by_level in enumerate(rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for s in order:
                for c in (levels if r % 2 == 0 else levels[::-1]):
                    requests = by_level[c]
                    before = (s.metric("tk_prefix_cache_hits_total"), s.metric("tk_prefix_cache_queries_total"))
                    run, results = (run_long(s.url, s.model, requests) if args.workload == "long-prompt"
                                    else run_level(s.url, s.model, requests, c))
                    after = (s.metric("tk_prefix_cache_hits_total"), s.metric("tk_prefix_cache_queries_total"))
                    if None not in before + after and after[1] > before[1]:
                        run["prefix_hit_rate"] = (after[0] - before[0]) / (after[1] - before[1])
                    want = solo.get((s.artifact or args.artifact, s.compute, r, c))
                    checked = want is not None and all(None not in res["tokens"] for res in results)
                    wrong = [i for i, (res, w) in enumerate(zip(results, want or [])) if checked and res["tokens"] != w]
                    lost = [i for i, (res, (_, n)) in enumerate(zip(results, requests)) if len(res["tokens"]) != n]
                    bad += len(wrong) + len(lost)
                    run.update(mismatched=wrong, short=lost, checked=checked)
                    runs.setdefault((s.name, c), []).append(run)
                    extra = "".join(f"  {k} {run[k]:.2f}" for k in ("prefix_hit_rate", "stream_gap_max_over_median")
                                    if k in run)
                    print(f"round {r} {s.name:>10} clients {c:3d}: {run['tokens_per_s']:8.1f} tokens/s  "
                          f"TTFT p50 {run['ttft_ms_p50']:8.1f} p99 {run['ttft_ms_p99']:8.1f} ms  "
                          f"ITL p50 {run['itl_ms_p50']:6.1f} p99 {run['itl_ms_p99']:7.1f} ms{extra}  "
                          f"{'checked' if checked else 'counted'}: {len(wrong) + len(lost)} wrong", flush=True)
    finally:
        for s in servers:
            s.stop()
    summary = {}
    first = specs[0][0]
    for (name, c), rs in runs.items():
        med = {k: statistics.median(run[k] for run in rs) for k in rs[0] if isinstance(rs[0][k], float)}
        base = runs[(first, c)]
        med["tokens_per_s_ratio_to_" + first] = statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                                                  for a, b in zip(rs, base))
        med["ttft_p50_ratio_to_" + first] = statistics.median(a["ttft_ms_p50"] / b["ttft_ms_p50"] for a, b in zip(rs, base))
        summary[f"{name}@{c}"] = med
        print(f"{name:>10} clients {c:3d}: {med['tokens_per_s']:8.1f} tokens/s (x{med['tokens_per_s_ratio_to_' + first]:.2f} "
              f"of {first}), TTFT p50 {med['ttft_ms_p50']:.0f} ms (x{med['ttft_p50_ratio_to_' + first]:.2f}) p99 "
              f"{med['ttft_ms_p99']:.0f} ms" + "".join(f", {k} {med[k]:.2f}" for k in (
                  "prefix_hit_rate", "stream_gap_max_over_median", "stream_gap_ms_max", "stream_gap_ms_p50") if k in med))
    print(f"responses not equal to their solo run, or short: {bad}")
    if args.report:
        args.report.write_text(json.dumps({"artifact": str(args.artifact), "workload": args.workload,
                                           "servers": dict(specs), "summary": summary,
                                           "runs": {f"{n}@{c}": rs for (n, c), rs in runs.items()}, "wrong": bad},
                                          indent=2))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
