"""Soak benchmark of `tk serve`: looping clients for a long while, the server's memory sampled, then
one SIGTERM with requests still in flight.

    python examples/soak_serve.py ARTIFACT [--clients 32] [--minutes 30] [--drain 10] [--slots 16] \\
        [--serve-args "--no-prefix-cache"] [--out soak.json]

`tk serve ARTIFACT` starts on a free port of 127.0.0.1. Each client loops until the time is up, each
request drawn from the mix: a prompt of 10-400 words (completions or chat), half of them streamed;
one in 8 streams is cancelled mid-stream (the client closes the connection after a few chunks), one
in 16 stalls (reads a few chunks, stops reading for 5-20 s with the connection open, then closes),
and one in 8 requests is malformed (bad JSON, an unknown field, a negative max_tokens, a prompt past
the context, a token id outside the vocabulary, a wrong type): each must be a 4xx. Every 10 s the
server's RSS (VmRSS of its process) is read. At the end, with the clients still sending, one SIGTERM
goes to the server and the time until it exits is measured. The report: requests by outcome, the
5xx count (must be 0; after the SIGTERM a 503, the server's answer to what it no longer takes, is
counted apart and allowed), malformed requests not answered 4xx (must be 0), RSS at minute 10 and the
largest and smallest over the last 20 minutes (within 5% of minute 10 when the memory is bounded;
with a shorter --minutes, the last half against its start), and the exit time against --drain + 5 s.
Exit 1 when any check fails.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum old tunes about "
         "rivers mountains lamps and paper boats that drift toward an unknown harbor at dawn").split()
MALFORMED = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4', "bad JSON"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4, "frobnicate": 1}).encode(), "unknown field"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": -3}).encode(), "negative max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi " * 100_000, "max_tokens": 4}).encode(), "past the context"),
    ("/v1/completions", json.dumps({"prompt": [10 ** 9], "max_tokens": 4}).encode(), "token id outside the vocabulary"),
    ("/v1/chat/completions", json.dumps({"messages": "hello", "max_tokens": 4}).encode(), "wrong type"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Counts:
    """Outcomes by kind; once `stopping` is set (the SIGTERM went out) each is counted under "after SIGTERM: ",
    where a 503 is the server's answer to what it no longer takes (a 500 there still fails the soak)."""

    def __init__(self):
        self.lock, self.by, self.stopping = threading.Lock(), {}, threading.Event()

    def add(self, key: str) -> None:
        key = f"after SIGTERM: {key}" if self.stopping.is_set() else key
        with self.lock:
            self.by[key] = self.by.get(key, 0) + 1


def one_request(port: int, rng: random.Random, counts: Counts) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        if rng.random() < 1 / 8:
            path, body, why = rng.choice(MALFORMED)
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            status = conn.getresponse().status
            counts.add("malformed 4xx" if 400 <= status < 500 else f"malformed answered {status} ({why})")
            return
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 400)))
        stream = rng.random() < 0.5
        if rng.random() < 0.5:
            path, body = "/v1/completions", {"prompt": text}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
        body.update(max_tokens=rng.randint(8, 64), temperature=rng.choice([0, 0.8]), stream=stream)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status >= 500:
            counts.add(f"5xx {resp.status}")
            return
        if resp.status != 200:
            counts.add(f"{resp.status}")  # 429 (queue full) or 503 (shutting down) are the server's to say
            resp.read()
            return
        fate = rng.random()
        if not stream:
            resp.read()
            counts.add("ok")
            return
        chunks = 0
        for line in resp:
            if line.startswith(b"data: "):
                chunks += 1
                if fate < 1 / 8 and chunks == 3:  # cancelled mid-stream: the client goes away
                    counts.add("cancelled mid-stream")
                    return
                if 1 / 8 <= fate < 3 / 16 and chunks == 3:  # stalls with the connection open, then leaves
                    time.sleep(rng.uniform(5, 20))
                    counts.add("stalled, then gone")
                    return
        counts.add("ok stream")
    except (OSError, http.client.HTTPException) as e:
        counts.add(f"client error {type(e).__name__}")
    finally:
        conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--drain", type=float, default=10.0)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--serve-args", default="", help="More tk serve options, as one string.")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    port = _free_port()
    tk = str(Path(sys.executable).parent / "tk")
    argv = [tk, "serve", str(args.artifact), "--port", str(port), "--slots", str(args.slots), "--drain",
            str(args.drain), *args.serve_args.split()]
    log = open(f"/tmp/soak_serve_{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1200):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                break
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"tk serve exited with {proc.returncode}; see {log.name}")
            time.sleep(0.5)
    counts, stop, start = Counts(), threading.Event(), time.monotonic()

    def client(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            one_request(port, rng, counts)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    samples = []  # (minutes since start, RSS bytes)
    end = start + 60 * args.minutes
    while time.monotonic() < end:
        samples.append(((time.monotonic() - start) / 60, rss_bytes(proc.pid)))
        print(f"{samples[-1][0]:6.2f} min  RSS {samples[-1][1] / 2**30:.3f} GiB  {dict(sorted(counts.by.items()))}",
              flush=True)
        time.sleep(min(10.0, max(0.0, end - time.monotonic())))
    tick = time.monotonic()
    counts.stopping.set()
    proc.send_signal(signal.SIGTERM)  # one SIGTERM, the clients still sending
    try:
        proc.wait(timeout=args.drain + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
    exit_s = time.monotonic() - tick
    stop.set()
    for t in threads:
        t.join(30)
    mark = 10.0 if args.minutes >= 30 else args.minutes / 3
    ref = min(samples, key=lambda s: abs(s[0] - mark))[1]
    tail = [r for m, r in samples if m >= args.minutes - (20.0 if args.minutes >= 30 else args.minutes / 2)]
    report = {"artifact": str(args.artifact), "clients": args.clients, "minutes": args.minutes,
              "serve": " ".join(argv[1:]), "load_average": os.getloadavg(), "outcomes": counts.by,
              "rss_gib": [(round(m, 2), round(r / 2**30, 4)) for m, r in samples],
              "rss_reference_minute": mark, "rss_reference_gib": ref / 2**30,
              "rss_tail_max_over_reference": max(tail) / ref, "rss_tail_min_over_reference": min(tail) / ref,
              "sigterm_exit_s": exit_s, "exit_code": proc.returncode, "drain_s": args.drain}
    fivexx = sum(n for k, n in counts.by.items() if k.startswith("5xx") or (k.startswith("after SIGTERM: 5xx")
                                                                            and not k.endswith("503")))
    bad4xx = sum(n for k, n in counts.by.items() if k.startswith("malformed answered"))
    report["checks"] = {"no 5xx": fivexx == 0, "every malformed request a 4xx": bad4xx == 0,
                        "RSS within 5% of the reference": max(tail) <= 1.05 * ref and min(tail) >= 0.95 * ref,
                        "exit within drain + 5 s": exit_s <= args.drain + 5}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
