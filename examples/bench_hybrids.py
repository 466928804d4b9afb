"""The hybrids' speed against the anchors: tk `--for ort-cpu` (fp32, int4) against onnxruntime-genai's
builder (`-p fp32`, `-p int4 -e cpu`) and llama.cpp (F32, Q4_0) on one checkpoint, batch 1, greedy.

Two numbers per stack, as issue 43 asks: decode ms/token after a --prompt-len (512) prompt
(--new-tokens, 128, of them), and the prefill time of a --prefill-len (2,048) prompt (its time to first
token). Every stack runs in a process of its own each time (no two thread pools in one process, nothing
left warm between stacks), round by round in the same order (the machine is shared: compare within one
run, as ratios); medians over --rounds. Before each run the machine must be quiet (--quiet: at most that
share of its CPUs busy, from /proc/stat, waiting up to --max-wait seconds), and each run records the
share of its threads' time it got (process CPU / wall / threads): a run under 0.8 had neighbours. Prompt ids are numpy's default_rng(0).integers(0, vocab) (llama-bench
draws its own: timing only). Anchors run where given:

- `--genai DIR ...`: onnxruntime-genai model folders, run by --genai-python (its own venv: genai pins
  an onnxruntime of its own): append the prompt, one generate_next_token (time to first token), then
  each further one timed;
- `--gguf FILE ...`: llama.cpp's `llama-bench` from --llama-bin: `-p 0 -n NEW -d PROMPT` (decode after a
  context of PROMPT tokens) and `-p PREFILL -n 0` (prompt processing), `-r 1` per round.

    python examples/bench_hybrids.py CHECKPOINT ART [ART ...] [--genai DIR ...] [--gguf FILE ...]
        [--genai-python PY] [--llama-bin DIR] [--rounds 3] [--threads 2] [--report FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = "--_worker"


def _prompt(vocab: int, n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, n).tolist()


def _tk(artifact: str, threads: int, jobs: list[dict]) -> list[dict]:
    """tk's ORT runtime in this process: each job's time to first token and decode ms/token."""
    from tk.runtimes.backends.ort import OrtRuntime
    from tk.runtimes.backends.ort_pool import use_shared_thread_pool
    from tk.runtimes.decoding.generate import generate

    use_shared_thread_pool()  # this process is tk's alone, as in the tk command
    with OrtRuntime(artifact, threads=threads, prepack=True) as rt:
        generate(rt, [jobs[0]["prompt"][:64]], 8, ignore_eos=True)  # warm-up
        out = []
        for job in jobs:
            r = generate(rt, [job["prompt"]], job["new"], ignore_eos=True)
            out.append({"ttft_ms": r.ttft_s * 1e3, "decode_ms": r.decode_ms_per_token if job["new"] > 1 else None,
                        "tokens": r.rows[0].tokens})
    return out


def _genai(folder: str, threads: int, jobs: list[dict]) -> list[dict]:
    """onnxruntime-genai's generator, as its examples run it."""
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                                         "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def run(prompt, n):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, do_sample=False)
        gen = og.Generator(model, params)
        start = time.perf_counter()
        gen.append_tokens(prompt)
        gen.generate_next_token()
        ttft, steps = time.perf_counter() - start, []
        while not gen.is_done():
            t = time.perf_counter()
            gen.generate_next_token()
            steps.append(time.perf_counter() - t)
        return {"ttft_ms": ttft * 1e3, "decode_ms": 1e3 * statistics.fmean(steps) if steps else None,
                "tokens": [int(t) for t in gen.get_sequence(0)][len(prompt):]}

    run(jobs[0]["prompt"][:64], 8)  # warm-up
    return [run(job["prompt"], job["new"]) for job in jobs]


def _worker(kind: str, path: str, threads: int) -> None:
    jobs = json.loads(sys.stdin.read())
    print(json.dumps({"tk": _tk, "genai": _genai}[kind](path, threads, jobs)))


def _in_process(python: str, kind: str, path: Path, threads: int, jobs: list[dict]) -> list[dict]:
    out = subprocess.run([python, __file__, WORKER, kind, str(path), str(threads)], input=json.dumps(jobs),
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{kind} {path}: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _busy(seconds: float) -> float:
    """The share of every CPU busy over `seconds`, while this process waits (/proc/stat)."""
    def snap():
        ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
        return sum(ticks), ticks[3] + ticks[4]
    (t0, i0), _ = snap(), time.sleep(seconds)
    t1, i1 = snap()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def _quietly(run, threads: int, quiet: float, max_wait: float):
    """run() once the machine is quiet (or after max_wait) -> (its result, the CPU share its children got)."""
    start = time.time()
    while _busy(1.0) > quiet and time.time() - start < max_wait:
        pass
    before, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = run()
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - wall
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return out, cpu / (wall * threads)


def _llama(bench: Path, gguf: Path, threads: int, args: list[str]) -> float:
    """One llama-bench run -> its mean seconds per test (tokens / tokens per second)."""
    cmd = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr[-1500:]}")
    row = json.loads(out.stdout)[0]
    return (row["n_prompt"] + row["n_gen"]) / row["avg_ts"]


def _label(path: Path) -> str:
    if path.suffix == ".gguf":
        return f"llama.cpp {path.stem.rsplit('-', 1)[-1].upper()}"
    if (path / "genai_config.json").is_file():
        return f"genai {path.name.rsplit('-', 1)[-1]}"
    manifest = json.loads((path / "manifest.json").read_text())
    return f"tk {manifest['precision']['weights'].replace('float32', 'fp32')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("artifacts", type=Path, nargs="+", help="tk exports of CHECKPOINT (--for ort-cpu)")
    ap.add_argument("--genai", type=Path, nargs="*", default=[])
    ap.add_argument("--gguf", type=Path, nargs="*", default=[])
    ap.add_argument("--genai-python", default=sys.executable)
    ap.add_argument("--llama-bin", type=Path)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quiet", type=float, default=0.2, help="the busy share of the CPUs a run waits for")
    ap.add_argument("--max-wait", type=float, default=600)
    ap.add_argument("--report", type=Path)
    a = ap.parse_args()
    cfg = json.loads((a.checkpoint / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    jobs = [{"kind": "decode", "prompt": _prompt(vocab, a.prompt_len), "new": a.new_tokens},
            {"kind": "prefill", "prompt": _prompt(vocab, a.prefill_len), "new": 1}]
    stacks = {_label(p): p for p in [*a.artifacts, *a.genai, *a.gguf]}
    times: dict[str, dict[str, list[float]]] = {s: {"decode_ms": [], "prefill_ms": [], "cpu_share": []}
                                                for s in stacks}
    tokens: dict[str, list[int]] = {}
    quietly = lambda run: _quietly(run, a.threads, a.quiet, a.max_wait)  # noqa: E731
    for r in range(a.rounds):
        for label, path in stacks.items():
            if path.suffix == ".gguf":
                bench = a.llama_bin / "llama-bench"
                decode, share = quietly(lambda: _llama(bench, path, a.threads, ["-p", "0", "-n", str(a.new_tokens),
                                                                                "-d", str(a.prompt_len)]))
                prefill, share2 = quietly(lambda: _llama(bench, path, a.threads, ["-p", str(a.prefill_len), "-n", "0"]))
                d, p = {"decode_ms": decode / a.new_tokens * 1e3}, {"ttft_ms": prefill * 1e3}
                share = min(share, share2)
            else:
                genai = path in a.genai
                (d, p), share = quietly(lambda: _in_process(a.genai_python if genai else sys.executable,
                                                            "genai" if genai else "tk", path, a.threads, jobs))
                tokens[label] = d["tokens"]
            times[label]["decode_ms"].append(d["decode_ms"])
            times[label]["prefill_ms"].append(p["ttft_ms"])
            times[label]["cpu_share"].append(share)
            print(f"round {r + 1}: {label}: decode {d['decode_ms']:.2f} ms/token, prefill {p['ttft_ms']:.0f} ms "
                  f"(CPU share {share:.2f}, load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    report = {"workload": {"prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "prefill_len": a.prefill_len,
                           "threads": a.threads, "rounds": a.rounds, "batch": 1}, "stacks": {}}
    first_tk = next(iter(stacks))
    print(f"decode after {a.prompt_len} tokens ({a.new_tokens} new), prefill of {a.prefill_len}; batch 1, "
          f"{a.threads} threads, median of {a.rounds} rounds, alternated")
    print(f"{'stack':16} {'decode ms/tok':>14} {'prefill ms':>11}  ratios to {first_tk} (above 1: it is slower)")
    for label, t in times.items():
        med = {k: statistics.median(v) for k, v in t.items()}
        ratio = {k: statistics.median(x / y for x, y in zip(t[k], times[first_tk][k])) for k in t if k != "cpu_share"}
        report["stacks"][label] = {"path": str(stacks[label]), **med, "runs": t,
                                   f"ratio_to_{first_tk}": ratio,
                                   "same_tokens_as_first": tokens.get(label) == tokens.get(first_tk)
                                   if label in tokens else None}
        print(f"{label:16} {med['decode_ms']:14.2f} {med['prefill_ms']:11.0f}  "
              f"decode {ratio['decode_ms']:.2f}x, prefill {ratio['prefill_ms']:.2f}x  (CPU share {min(t['cpu_share']):.2f}"
              f"..{max(t['cpu_share']):.2f})")
    if a.report:
        a.report.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
