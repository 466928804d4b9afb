"""Where a `tk serve` step goes under load: ONNX Runtime, the batcher's Python, or HTTP.

    python examples/profile_serve.py ARTIFACT [--clients 16] [--tokens 64] [--seconds 20] [--serve-args "..."]

Starts `tk serve ARTIFACT` on a free port of 127.0.0.1, keeps `--clients` streaming clients busy
(prompts of 32 token ids, `--tokens` new tokens each, greedy, EOS ignored) and samples the server
with py-spy (`pip install py-spy`; `py-spy record --threads --idle --format raw`) for `--seconds`
of the steady state. Each sample of the batcher's thread (tk-batcher) is ONNX Runtime where its
stack is in an InferenceSession run, else the batcher's Python (scheduling, sampling, rows, events);
the event loop's thread is HTTP (uvicorn, FastAPI, the SSE chunks, the handlers); the worker threads
are tokenizing and preparing. Prints each share of the batcher's time and the event loop's busy share,
and the tokens/s of the run, as one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WAITS = re.compile(r"(select \(selectors\.py|wait \(threading\.py|get \(queue\.py)[^;]*$")  # a blocked leaf frame


def classify(stack: str) -> tuple[str, str]:
    """A collapsed py-spy stack -> (thread kind, what it does). A thread blocked in a select or a
    wait is idle: the HTTP front end's worker threads spend their life in their queue's wait."""
    idle = "(idle)" in stack.split(";")[0] or stack.rstrip().endswith("(idle)") or bool(WAITS.search(stack))
    if "tk-batcher" in stack or re.search(r"_loop \([^)]*serving/batching\.py", stack):
        if re.search(r"run_with_iobinding|InferenceSession\.run|\brun \(onnxruntime", stack):
            return "batcher", "onnxruntime"
        return "batcher", "idle" if idle else "python"
    if "MainThread" in stack.split(";")[0] and ("uvicorn" in stack or "asyncio" in stack):
        return "event loop", "idle" if idle else "busy"
    return "other", "idle" if idle else "busy"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--serve-args", default="")
    args = ap.parse_args()
    if shutil.which("py-spy") is None:
        ap.error("py-spy is not on PATH: pip install py-spy (and run from the environment that has it)")
    from tk.models.spec.manifest import Manifest

    vocab = Manifest.read(args.artifact).dims.vocab_size
    port = _free_port()
    tk = str(Path(sys.executable).parent / "tk")
    proc = subprocess.Popen([tk, "serve", str(args.artifact), "--port", str(port), "--slots", str(args.clients),
                             *args.serve_args.split()], stderr=subprocess.DEVNULL)
    try:  # the server goes whatever happens (an interrupted profile left one running)
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                    break
            except OSError:
                if proc.poll() is not None:
                    sys.exit("tk serve exited")
                time.sleep(0.5)
        stop, tokens = threading.Event(), Counter()

        def client(i: int) -> None:
            rng = np.random.default_rng(i)
            while not stop.is_set():
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                body = {"prompt": rng.integers(3, vocab, 32).tolist(), "max_tokens": args.tokens, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                for line in conn.getresponse():
                    if line.startswith(b"data: {"):
                        tokens["n"] += 1
                conn.close()

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(5)  # past the first prefills
        raw = Path(tempfile.mkdtemp()) / "profile.txt"
        before, tick = tokens["n"], time.monotonic()
        subprocess.run(["py-spy", "record", "--threads", "--idle", "--format", "raw", "--rate", "200", "--duration",
                        str(int(args.seconds)), "--pid", str(proc.pid), "--output", str(raw), "--nonblocking"],
                       check=True, capture_output=True)
        rate = (tokens["n"] - before) / (time.monotonic() - tick)
        stop.set()
    finally:
        proc.terminate()
        proc.wait(60)
    kinds: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        kinds[classify(stack)] += int(count)
    batcher = sum(n for (t, _), n in kinds.items() if t == "batcher") or 1
    loop = sum(n for (t, _), n in kinds.items() if t == "event loop") or 1
    report = {"artifact": str(args.artifact), "clients": args.clients, "streamed_chunks_per_s": rate,
              "load_average": os.getloadavg(),
              "batcher": {k: kinds[("batcher", k)] / batcher for k in ("onnxruntime", "python", "idle")},
              "event_loop_busy": kinds[("event loop", "busy")] / loop,
              "samples": {f"{t}/{k}": n for (t, k), n in sorted(kinds.items())}}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
