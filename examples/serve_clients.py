"""The clients people point at an OpenAI-compatible server, run against `tk serve`, offline, every
server and client on 127.0.0.1. Each client lives in a virtual environment of its own (their
dependencies conflict); pass its executable.

    python examples/serve_clients.py lm-eval CHECKPOINT ARTIFACT --exe /path/to/venv/bin/lm_eval
    python examples/serve_clients.py aiperf ARTIFACT --exe /path/to/venv/bin/aiperf [--tokenizer CHECKPOINT]
    python examples/serve_clients.py guidellm ARTIFACT --exe /path/to/venv/bin/guidellm [--tokenizer CHECKPOINT]
    python examples/serve_clients.py fuzz ARTIFACT --exe /path/to/venv/bin/schemathesis

lm-eval: a multiple-choice task, a perplexity task (log-likelihoods) and a generation task on local
files this script writes, through `--model local-completions` against tk serve with
tokenized_requests on and off, and through lm-eval's `hf` backend on CHECKPOINT (float32); it
compares every sample: log-likelihoods within --tol (1e-3), greediness and generations equal.
aiperf, guidellm: streamed chat and completions runs; every request must succeed. fuzz:
schemathesis's property-based run of every operation in /openapi.json with all its checks (the
API key required and given). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
FACTS = [("What color is the sky on a clear day?", ["blue", "green", "red"], 0),
         ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
         ("Which number is even?", ["3", "7", "8", "11"], 2), ("What do bees make?", ["milk", "honey", "silk"], 1),
         ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
         ("The opposite of hot is", ["warm", "cold", "loud"], 1), ("A cat says", ["woof", "moo", "meow"], 2),
         ("Two plus three is", ["four", "five", "six"], 1), ("The sun rises in the", ["east", "west", "north"], 0),
         ("Which one is a fruit?", ["carrot", "apple", "potato"], 1),
         ("Paris is the capital of", ["Spain", "France", "Italy"], 1), ("Ice is", ["frozen water", "hot air"], 0)]
TEXTS = ["Once upon a time there was a small model that wanted to run everywhere: on a laptop, on a server.",
         "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828. Code: def f(x): return x * 2 + 1",
         "The quick brown fox jumps over the lazy dog, and the dog does not mind at all."]


def write_tasks(folder: Path) -> str:
    """The three tasks as lm-eval YAML over local JSON lines: their names, comma-separated."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n"
                                             for q, c, a in FACTS))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": c[a]}) + "\n" for q, c, a in FACTS))
    (folder / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    data = lambda name: f"dataset_kwargs:\n  data_files:\n    test: {folder / name}\n"  # noqa: E731
    (folder / "tk_mc.yaml").write_text(
        f"task: tk_mc\n{common}{data('mc.jsonl')}output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n")
    (folder / "tk_ppl.yaml").write_text(
        f"task: tk_ppl\n{common}{data('ppl.jsonl')}output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n')
    (folder / "tk_gen.yaml").write_text(
        f"task: tk_gen\n{common}{data('gen.jsonl')}output_type: generate_until\n"
        'doc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", "Q:"]\n  max_gen_toks: 16\n  do_sample: false\n  temperature: 0.0\n'
        "metric_list:\n  - metric: exact_match\n")
    return "tk_mc,tk_ppl,tk_gen"


@contextlib.contextmanager
def tk_serve(artifact: Path, *extra: str):
    """`tk serve ARTIFACT` on a free port of 127.0.0.1 -> its base URL; stopped (SIGTERM) on exit."""
    proc = subprocess.Popen(["tk", "serve", str(artifact), "--port", "0", "--host", "127.0.0.1", *extra],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if not found:
            raise SystemExit(f"tk serve did not start: {line}{proc.stderr.read() if proc.poll() is not None else ''}")
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(60)


def _samples(folder: Path) -> dict:
    """lm-eval's --log_samples files -> {(task, doc, choice): (value, is_greedy or None)}."""
    out = {}
    for f in glob.glob(str(folder / "**" / "samples_*.jsonl"), recursive=True):
        task = Path(f).name[len("samples_"):].rsplit("_", 1)[0]
        for line in open(f):
            s = json.loads(line)
            for i, r in enumerate(s["resps"]):
                v = r[0]
                out[(task, s["doc_id"], i)] = ((float(v[0]), str(v[1]) == "True") if isinstance(v, list) else
                                               (float(v), None) if task.endswith("ppl") else (v, None))
    return out


def run_lm_eval(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="tk-lm-eval-"))
    tasks = write_tasks(work / "tasks")
    env = {**os.environ, **OFFLINE}
    base = [args.exe, "--include_path", str(work / "tasks"), "--tasks", tasks, "--log_samples"]
    runs = {}
    t0 = time.perf_counter()
    subprocess.run([*base, "--model", "hf", "--model_args", f"pretrained={args.checkpoint},dtype=float32",
                    "--device", "cpu", "--output_path", str(work / "hf")], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    runs["hf"] = _samples(work / "hf")
    print(f"lm-eval hf backend: {len(runs['hf'])} samples in {time.perf_counter() - t0:.0f} s")
    with tk_serve(args.artifact, "--slots", "8") as url:
        for tokenized in (True, False):
            name = f"tk serve, tokenized_requests={tokenized}"
            t0 = time.perf_counter()
            model_args = (f"base_url={url}/v1/completions,model={Path(args.artifact).resolve().name},"
                          f"tokenizer={args.checkpoint},tokenized_requests={tokenized},num_concurrent=4")
            subprocess.run([*base, "--model", "local-completions", "--model_args", model_args,
                            "--output_path", str(work / name.replace(" ", "_"))], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            runs[name] = _samples(work / name.replace(" ", "_"))
            print(f"lm-eval {name}: {len(runs[name])} samples in {time.perf_counter() - t0:.0f} s")
    failed = 0
    ref = runs.pop("hf")
    for name, got in runs.items():
        worst, bad = 0.0, []
        for key in sorted(ref):
            (want, greedy), (have, have_greedy) = ref[key], got.get(key, (None, None))
            if isinstance(want, float) and isinstance(have, float):
                worst = max(worst, abs(want - have))
                if abs(want - have) > args.tol or greedy != have_greedy:
                    bad.append(key)
            elif want != have:
                bad.append(key)
        kinds = {k[0]: sum(1 for x in ref if x[0] == k[0]) for k in ref}
        print(f"{name} vs hf: {len(ref)} samples {kinds}, max |log-likelihood difference| {worst:.2e} "
              f"(tolerance {args.tol:g}), {len(bad)} differ{': ' + str(bad[:5]) if bad else ''}")
        failed += bool(bad)
    return int(failed > 0)


def run_load(args, kind: str) -> int:
    """aiperf or guidellm: a streamed chat run and a streamed completions run; no request may fail."""
    work = Path(tempfile.mkdtemp(prefix=f"tk-{kind}-"))
    name = Path(args.artifact).resolve().name
    failed = 0
    with tk_serve(args.artifact, "--slots", "8", "--api-key", "sk-tk") as url:
        for endpoint in ("chat", "completions"):
            out = work / endpoint
            if kind == "aiperf":
                cmd = [args.exe, "profile", "-m", name, "--url", url.removeprefix("http://"), "--endpoint-type",
                       endpoint, "--streaming", "--tokenizer", str(args.tokenizer or args.artifact), "--api-key", "sk-tk",
                       "--request-count", str(args.requests), "--concurrency", "8", "--isl", "64", "--osl", "32",
                       "--random-seed", "0", "--extra-inputs", "ignore_eos:true", "--ui", "none",
                       "--no-gpu-telemetry", "--no-server-metrics", "--artifact-dir", str(out)]
            else:
                cmd = [args.exe, "run", "--backend", f"kind=openai_http,target={url},model={name},api_key=sk-tk,"
                                                     f"request_format=/v1/{'chat/' if endpoint == 'chat' else ''}completions,"
                                                     "http2=false",
                       "--profile", "kind=concurrent,streams=8", "--constraint",
                       f"kind=max_requests,count={args.requests}", "--tokenizer",
                       f"kind=huggingface_auto,model={args.tokenizer or args.artifact}", "--data",
                       "kind=synthetic_text,prompt_tokens=64,output_tokens=32", "--output",
                       f"kind=json,path={out}.json", "--disable-console-interactive"]
            t0 = time.perf_counter()
            # aiperf 0.13 fails to load a local tokenizer folder when HF_HUB_OFFLINE is set: no hub variables
            env = {k: v for k, v in os.environ.items() if k not in OFFLINE} if kind == "aiperf" else \
                {**os.environ, **OFFLINE}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            done, errors = _load_counts(kind, out, proc)
            ok = proc.returncode == 0 and done == args.requests and errors == 0
            print(f"{kind} {endpoint}: exit {proc.returncode}, {done} requests completed, {errors} failed, "
                  f"{time.perf_counter() - t0:.0f} s{'' if ok else ' <- FAILED'}")
            if not ok:
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            failed += not ok
    return int(failed > 0)


def _load_counts(kind: str, out: Path, proc) -> tuple[int, int]:
    """(completed, failed) requests from the client's own JSON report."""
    if kind == "aiperf":
        files = glob.glob(str(out / "**" / "profile_export_aiperf.json"), recursive=True)
        if not files:
            return 0, -1
        report = json.loads(Path(files[0]).read_text())
        count = report.get("request_count", {})
        errors = report.get("error_request_count", {}) or {}
        return int(count.get("avg", 0) if isinstance(count, dict) else count), \
            int(errors.get("avg", 0) if isinstance(errors, dict) else errors)
    path = Path(f"{out}.json")
    if not path.is_file():
        return 0, -1
    bench = json.loads(path.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"] if "metrics" in bench else bench["request_totals"]
    return int(totals["successful"]), int(totals["errored"]) + int(totals.get("incomplete", 0))


# A body the schema allows can still ask for more than the context holds (its prompt's tokens plus
# max_tokens: no JSON schema can say so) or carry a regex or grammar llguidance refuses: those are
# 400s that name the field, on the two generation endpoints only; every other operation keeps
# positive_data_acceptance's own statuses.
FUZZ_CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "401", "403", "404", "409", "429"]

[[operations]]
include-path-regex = "^/v1/(chat/)?completions$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429"]
"""


def run_fuzz(args) -> int:
    config = Path(tempfile.mkdtemp(prefix="tk-fuzz-")) / "schemathesis.toml"
    config.write_text(FUZZ_CONFIG)
    with tk_serve(args.artifact, "--slots", "4", "--api-key", "sk-tk", "--max-queue", "256") as url:
        cmd = [args.exe, "--config-file", str(config), "run", f"{url}/openapi.json", "--checks", "all",
               "-H", "Authorization: Bearer sk-tk",
               "--max-examples", str(args.examples), "--seed", "0", "--request-timeout", "60",
               "--suppress-health-check", "all", "--output-sanitize", "false"]
        print(" ".join(cmd[1:]))
        proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    return proc.returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="client", required=True)
    lm = sub.add_parser("lm-eval")
    lm.add_argument("checkpoint")
    lm.add_argument("artifact")
    lm.add_argument("--tol", type=float, default=1e-3)
    for name in ("aiperf", "guidellm", "fuzz"):
        s = sub.add_parser(name)
        s.add_argument("artifact")
        s.add_argument("--requests", type=int, default=64)
        s.add_argument("--examples", type=int, default=50, help="fuzz: examples per operation")
        s.add_argument("--tokenizer", help="the folder the client loads its tokenizer from [default: ARTIFACT] "
                                           "(an older transformers may want the checkpoint's, with its config.json)")
    for s in sub.choices.values():
        s.add_argument("--exe", required=True, help="the client's executable (in its own virtual environment)")
    args = p.parse_args()
    if args.client == "lm-eval":
        return run_lm_eval(args)
    if args.client == "fuzz":
        return run_fuzz(args)
    return run_load(args, args.client)


if __name__ == "__main__":
    sys.exit(main())
