"""Speculative decoding, tk against llama.cpp, on one real checkpoint (issue 35): batch 1, greedy,
the code-edit workload (`workload_text("code-edit")` of tk/toolkit/tools/bench_speculative.py, the
same text to both tools), decode ms/token with time to first token excluded. Modes: plain, n-gram
prompt lookup, and a draft model (the same crude draft for both tools).

    python examples/bench_speculative.py --checkpoint CKPT --draft DRAFT --llama-bin BIN --work WORK \
        [--weights f32,int4] [--skip-draft] [--new-tokens 128] [--repeats 3] [--threads 2] [--out WORK/bench_speculative.json]

tk runs `tk bench ART --workloads code-edit --draft DRAFT_ART --report F.json` (its modes alternate
inside it). llama.cpp runs one `llama-server` per mode on a free 127.0.0.1 port, all three up at
once, requests alternated plain, ngram, draft, plain, ... after a warm-up request each, then
stopped; it reads `/completion`'s `timings` (n_predict N, temperature 0, ignore_eos, cache_prompt
false). The ngram mode is `--spec-type ngram-simple --spec-draft-n-max 8 --spec-ngram-simple-size-m 8`
(this llama.cpp sizes ngram-simple's guesses by size-m, default 48, not by --spec-draft-n-max);
the draft mode `-md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max 4`.

Inputs, prepared once (WORK holds them; the commands used for issue 35):
1. the checkpoint: `pip install gguf accelerate sentencepiece`, then
   `python /work/shared/fixtures/real_checkpoint.py CKPT` (Qwen2.5-Coder-0.5B-Instruct, float32);
2. the draft: a copy of CKPT whose config says num_hidden_layers=6 and whose safetensors keep
   layers 0..5, the embeddings, the final norm and lm_head;
3. tk exports: `tk export CKPT -o WORK/tk-f32 --for ort-cpu --max-seq-len 2048` (add
   `--weights int4` for WORK/tk-int4), the same of DRAFT into WORK/tk-draft-f32 (and
   WORK/tk-draft-int4; without it the int4 runs use the f32 draft);
4. llama.cpp: the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp built with
   `cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
   -DGGML_FMA=ON -DGGML_F16C=ON [AVX-512 flags where /proc/cpuinfo lists them] -DLLAMA_CURL=OFF
   -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF && cmake --build build -j2 --target llama-server
   llama-quantize` (BIN = build/bin); `PYTHONPATH=gguf-py python convert_hf_to_gguf.py CKPT
   --outfile WORK/ckpt-f32.gguf --outtype f32` (DRAFT into WORK/draft-f32.gguf), then
   `llama-quantize WORK/ckpt-f32.gguf WORK/ckpt-q4_0.gguf Q4_0` (and the draft's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tk.toolkit.tools.bench_speculative import workload_text

GGUF = {"f32": "f32", "int4": "q4_0"}  # tk weights -> llama.cpp file suffix (Q4_0 beside tk's int4)


def tk_bench(work: Path, weights: str, args) -> dict:
    art, draft = work / f"tk-{weights}", work / f"tk-draft-{weights}"
    if not draft.exists():
        draft = work / "tk-draft-f32"
    report = work / f"tk-bench-{weights}.json"
    cmd = [shutil.which("tk") or "tk", "bench", str(art), "--workloads", "code-edit",
           *([] if args.skip_draft else ["--draft", str(draft)]), "--new-tokens", str(args.new_tokens),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--draft-p-min", str(args.draft_p_min),
           *(["--no-prepack"] if args.no_prepack else []),
           "--report", str(report)]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    out = json.loads(report.read_text())
    out["command"], out["wall_s"] = " ".join(cmd), round(time.time() - t0, 1)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 900) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """One llama-server on a free 127.0.0.1 port, up until stop()."""

    def __init__(self, bin_dir: Path, model: Path, extra: list[str], threads: int, log: Path):
        self.port = free_port()
        self.cmd = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port",
                    str(self.port), "-t", str(threads), "-tb", str(threads), "-c", "2048", "-np", "1", *extra]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 600) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                sys.exit(f"llama-server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        sys.exit(f"llama-server not ready after {timeout} s; see {self.log.name}")

    def complete(self, prompt: str, n: int) -> dict:
        return post(self.port, "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                                               "ignore_eos": True, "cache_prompt": False, "seed": 0})

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def llama_bench(work: Path, weights: str, args, prompt: str) -> dict:
    suffix, threads = GGUF[weights], str(args.threads)
    modes = {"plain": [],
             "ngram": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8", "--spec-ngram-simple-size-m", "8"],
             "draft": ["-md", str(work / f"draft-{suffix}.gguf"), "--spec-type", "draft-simple",
                       "--spec-draft-n-max", "4", "--spec-draft-p-min", str(args.draft_p_min),
                       "-td", threads, "-tbd", threads]}
    if args.skip_draft:
        del modes["draft"]
    servers = {m: Server(args.llama_bin, work / f"ckpt-{suffix}.gguf", extra, args.threads,
                         work / f"llama-server-{weights}-{m}.log") for m, extra in modes.items()}
    runs: dict[str, list] = {m: [] for m in modes}
    try:
        for s in servers.values():
            s.wait()
        prompt_tokens = len(post(servers["plain"].port, "/tokenize", {"content": prompt})["tokens"])
        for s in servers.values():  # warm-up
            s.complete(prompt, 16)
        for _ in range(args.repeats):
            for m, s in servers.items():
                r = s.complete(prompt, args.new_tokens)
                runs[m].append({"timings": r["timings"], "content": r["content"]})
    finally:
        for s in servers.values():
            s.stop()
    out = {"prompt_tokens": prompt_tokens, "commands": {m: " ".join(s.cmd) for m, s in servers.items()}, "modes": {}}
    plain = statistics.median(r["timings"]["predicted_per_token_ms"] for r in runs["plain"])
    for m, rs in runs.items():
        t = [r["timings"] for r in rs]
        ms = statistics.median(x["predicted_per_token_ms"] for x in t)
        entry = {"decode_ms_per_token": {"median": ms, "min": min(x["predicted_per_token_ms"] for x in t),
                                         "max": max(x["predicted_per_token_ms"] for x in t)},
                 "tokens_per_s": {"median": 1000 / ms}, "speedup": plain / ms,
                 "predicted_n": [x["predicted_n"] for x in t], "timings": t,
                 "same_tokens": all(r["content"] == runs["plain"][0]["content"] for r in rs)}
        if t[0].get("draft_n"):
            n, acc = t[0]["predicted_n"], t[0]["draft_n_accepted"]
            entry.update(acceptance=acc / t[0]["draft_n"], proposed=t[0]["draft_n"], accepted=acc,
                         tokens_per_step=n / max(1, n - acc))  # approx: each target step yields accepted + 1
        out["modes"][m] = entry
    return out


def rows(results: dict) -> list[dict]:
    table = []
    for weights, res in results.items():
        lp = res["llama"]["modes"]["plain"]["decode_ms_per_token"]["median"]
        for tool, modes in (("tk", res["tk"]["workloads"]["code-edit"]["modes"]), ("llama.cpp", res["llama"]["modes"])):
            for mode, m in modes.items():
                ms = m["decode_ms_per_token"]["median"]
                table.append({"tool": tool, "weights": weights if tool == "tk" else GGUF[weights].upper(),
                              "mode": "lookup" if mode == "ngram" else mode, "ms_per_token": ms,
                              "tokens_per_s": 1000 / ms, "speedup": m["speedup"], "vs_llama_plain": lp / ms,
                              "tokens_per_step": m.get("tokens_per_step", 1.0), "acceptance": m.get("acceptance"),
                              "same_tokens": m["same_tokens"]})
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--weights", default="f32,int4", help="comma-separated: f32, int4 (llama.cpp: Q4_0)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-draft", action="store_true", help="plain and lookup only (no draft mode)")
    ap.add_argument("--no-prepack", action="store_true",
                    help="tk: keep the weights unpacked (tk prepacks when it speculates: a verify run is a MatMul of "
                         "several rows, which packs unpacked weights again every run)")
    ap.add_argument("--draft-p-min", type=float, default=0.75,
                    help="both tools' draft stops at a guess it is less sure of (tk --draft-p-min, llama.cpp "
                         "--spec-draft-p-min, whose own default is 0)")
    ap.add_argument("--out", type=Path, help="JSON of everything (default WORK/bench_speculative.json)")
    args = ap.parse_args()
    prompt = workload_text("code-edit")
    try:
        from transformers import AutoTokenizer
        hf_tokens = len(AutoTokenizer.from_pretrained(args.checkpoint).encode(prompt))
    except Exception:  # the tokenizer check is informative only
        hf_tokens = None
    results = {}
    for weights in args.weights.split(","):  # tk, then llama.cpp (alternated within each tool)
        results[weights] = {"tk": tk_bench(args.work, weights, args), "llama": llama_bench(args.work, weights, args, prompt)}
        print(f"{weights}: tk prompt {results[weights]['tk']['workloads']['code-edit']['prompt_tokens']} tokens, "
              f"llama.cpp {results[weights]['llama']['prompt_tokens']}, HF tokenizer {hf_tokens}", flush=True)
    table = rows(results)
    print(f"\n{'tool':9} {'weights':7} {'mode':6} {'ms/token':>9} {'tok/s':>7} {'speed-up':>9} "
          f"{'vs llama plain':>15} {'tok/step':>9} {'accept':>7}  same tokens")
    for r in table:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(f"{r['tool']:9} {r['weights']:7} {r['mode']:6} {r['ms_per_token']:9.2f} {r['tokens_per_s']:7.1f} "
              f"{r['speedup']:8.2f}x {r['vs_llama_plain']:14.2f}x {r['tokens_per_step']:9.2f} {acc:>7}  "
              f"{'yes' if r['same_tokens'] else 'NO'}")
    out = args.out or args.work / "bench_speculative.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "prompt": prompt,
                               "hf_prompt_tokens": hf_tokens, "results": results, "table": table}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
