"""tk's ORT backend against the anchors, on the same workload in one run: same prompt ids, greedy,
batch 1, EOS ignored, runs alternated after a warm-up, medians reported with ratios to tk. Each
stack runs in its own process (ORT thread pools of two stacks in one process slow each other).

    python examples/bench_anchors.py CHECKPOINT ARTIFACT [ARTIFACT ...] [--genai DIR] [--optimum DIR] [--prompt-len 128]

Every ARTIFACT is a `tk export` of CHECKPOINT (say the portable default and a `--target ort
--kv-cache static --prefill-logits last` one); each runs as its own stack. Anchors, each only
where installed (optional dev dependencies, never tk's own):
- transformers `generate` (SDPA) on the checkpoint;
- Optimum's ORTModelForCausalLM on its own ONNX export of the checkpoint (exported into
  --optimum if that folder does not exist yet);
- onnxruntime-genai on a model its builder makes from the same checkpoint (built into --genai if
  that folder does not exist yet; `--genai-precision int4` for its int4 CPU build, beside a tk
  `--weights int4` export). Quantized stacks need not pick the same tokens (different rounding).
Each stack's RSS before and after loading is reported (VmRSS of its process).
It checks that every stack produced the same tokens. Ratios are anchor / tk (above 1: tk is
faster), taken per repeat between runs next to each other, then the median: drift of the
machine's speed during the run cancels out. The decode bound is the bytes a decode step must
read (every weight but the embedding table, plus the KV cache) over this machine's read
bandwidth, measured between the rounds with as many threads as the benchmark uses.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tk.runtimes.decoding.generate import generate
from tk.runtimes.backends.ort import OrtRuntime


def tk_ort(artifact: Path, threads: int, huge_pages: bool = True):
    rt = OrtRuntime(artifact, threads=threads, huge_pages=huge_pages, prepack=True).activate()  # speed: packed weights

    def run(prompt: list[int], n: int):
        r = generate(rt, [prompt], n, ignore_eos=True)
        return r.rows[0].tokens, r.ttft_s * 1e3, r.decode_ms_per_token

    return run


def transformers_anchor(checkpoint: Path, threads: int):
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return lambda prompt, n: _timed_generate(model, prompt, n)


class _Clock:
    """A `generate` streamer that notes when each token is handed over: the prompt first, then
    every new token, so first token and decode steps are timed within one call."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _timed_generate(model, prompt: list[int], n: int):
    """Greedy `generate` of exactly n tokens on a transformers-style model -> (tokens, ttft ms, decode ms/token)."""
    import torch

    ids = torch.tensor([prompt])
    clock = _Clock()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                             max_new_tokens=n, min_new_tokens=n, streamer=clock)
    first, last = clock.times[1], clock.times[-1]
    return out[0, len(prompt):].tolist(), (first - t0) * 1e3, (last - first) * 1e3 / (n - 1)


def optimum_anchor(checkpoint: Path, folder: Path, threads: int):
    """Optimum's ORTModelForCausalLM on its own export of the checkpoint (made into `folder` if
    that does not exist yet), on ONNX Runtime's CPU provider with `threads` threads."""
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForCausalLM

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if not folder.exists():
        ORTModelForCausalLM.from_pretrained(checkpoint, export=True).save_pretrained(folder)
    model = ORTModelForCausalLM.from_pretrained(folder, session_options=options, provider="CPUExecutionProvider")
    return lambda prompt, n: _timed_generate(model, prompt, n)


def genai_anchor(checkpoint: Path, folder: Path, threads: int, precision: str = "fp32"):
    import onnxruntime_genai as og

    if not folder.exists():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(checkpoint), "-i",
                        str(checkpoint), "-o", str(folder), "-p", precision, "-e", "cpu"], check=True,
                       capture_output=True)
        cfg_path = folder / "genai_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
        cfg_path.write_text(json.dumps(cfg, indent=2))
    model = og.Model(str(folder))

    def run(prompt: list[int], n: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)
        gen.generate_next_token()
        ttft = time.perf_counter() - t0
        steps = []
        while not gen.is_done():
            t = time.perf_counter()
            gen.generate_next_token()
            steps.append(time.perf_counter() - t)
        tokens = list(gen.get_sequence(0))[len(prompt):]
        return tokens, ttft * 1e3, 1e3 * float(np.mean(steps))

    return run


def _worker(name: str, args: argparse.Namespace, conn) -> None:
    """One stack in its own process: ORT thread pools of different stacks never share a process."""
    if name.startswith("tk"):
        from tk.runtimes.backends.ort_pool import use_shared_thread_pool

        use_shared_thread_pool()  # this worker process is tk's alone, as in the tk command
    make = {"transformers": lambda: transformers_anchor(args.checkpoint, args.threads),
            "optimum": lambda: optimum_anchor(args.checkpoint, args.optimum, args.threads),
            "onnxruntime-genai": lambda: genai_anchor(args.checkpoint, args.genai, args.threads, args.genai_precision),
            **{label: (lambda a=a, h=h: tk_ort(a, args.threads, h)) for label, (a, h) in args.tk.items()}}[name]
    before = _rss()
    try:
        run = make()
    except ImportError as e:
        conn.send(("skip", f"{e.name} is not installed"))
        return
    conn.send(("ready", (before, _rss())))
    while (msg := conn.recv()) is not None:
        prompt, n = msg
        conn.send(("done", run(prompt, n)))


def _rss() -> int:
    """This process's resident bytes now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _label(artifact: Path) -> str:
    from tk.models.spec.manifest import Manifest

    m = Manifest.read(artifact)
    v, p = m.variant, m.precision
    return " ".join(["tk", *([p.weights] if p.quantized else []), v.target.value, v.cache.value,
                     *(["last-logits"] if v.prefill_logits.value == "last" else [])])


def read_bandwidth_gbs(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes/s this machine streams from memory on `threads` threads: the best of a few sums over
    a float32 tensor far larger than any cache (PyTorch's vectorized, threaded reduction)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**18)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best / 1e9


def decode_bytes(checkpoint: Path, context: int, artifact: Path | None = None) -> int:
    """What one decode step must read: every weight but the embedding table (one row is
    gathered; a tied head reads the whole table anyway), plus the KV cache of `context` tokens.
    With a tk `artifact`, its weights file's bytes (quantized weights are smaller); else the
    checkpoint's parameters in float32."""
    from tk.models.checkpoint.loading import read_config
    from tk.models.spec.manifest import Precision
    from tk.toolkit.tools.describe import memory_plan

    cfg = read_config(checkpoint)
    data = artifact / "weights.onnx.data" if artifact is not None else None
    weights = data.stat().st_size if data is not None and data.is_file() else None
    plan = memory_plan(cfg, Precision(), 1, context, weights)
    embed = cfg.vocab_size * cfg.hidden_size * 4
    if weights is not None:  # the artifact stores the table once as itself, once as the head
        table = json.loads((artifact / "manifest.json").read_text()).get("weights", {})
        embed = table.get("model.embed.weight", [0, embed])[1]
    elif cfg.tie_embeddings:
        embed = 0  # a tied head reads the whole table: it counts once, as the head
    return plan["weights_bytes"] - embed + plan["kv_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("artifacts", type=Path, nargs="+", help="tk exports of CHECKPOINT, each run as a stack")
    ap.add_argument("--genai", type=Path, help="onnxruntime-genai model folder (built if missing)")
    ap.add_argument("--genai-precision", default="fp32", choices=("fp32", "int4"),
                    help="the builder's -p when it builds --genai (int4: MatMulNBits, block 32, accuracy level 4)")
    ap.add_argument("--optimum", type=Path, help="Optimum ORTModelForCausalLM export folder (exported if missing)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", type=Path)
    ap.add_argument("--also-without-huge-pages", action="store_true",
                    help="also run each artifact with its weights on ordinary 4 KiB pages (runtimes/backends/hugepages.py)")
    args = ap.parse_args()

    args.tk = {}  # label -> (artifact, huge pages)
    for artifact in args.artifacts:
        label = _label(artifact)
        label = label if label not in args.tk else f"{label} ({artifact.name})"
        args.tk[label] = (artifact, True)
        if args.also_without_huge_pages:
            args.tk[f"{label}, 4k pages"] = (artifact, False)
    names = [*args.tk, "transformers", *(["optimum"] if args.optimum else []),
             *(["onnxruntime-genai"] if args.genai else [])]
    for name, flag in (("optimum", args.optimum), ("onnxruntime-genai", args.genai)):
        if not flag:
            print(f"{name}: skipped (pass --{name.split('-')[-1]} DIR)")
    ctx = multiprocessing.get_context("spawn")
    workers, memory = {}, {}
    for name in names:  # started one at a time: building or loading never overlaps a measurement
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(name, args, child), daemon=True)
        proc.start()
        status, detail = parent.recv()
        if status == "skip":
            print(f"{name}: skipped ({detail})")
            continue
        workers[name] = (proc, parent)
        memory[name] = {"rss_before_load": detail[0], "rss_after_load": detail[1]}
    vocab = json.loads((args.artifacts[0] / "manifest.json").read_text())["config"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_len).tolist()

    def run(name: str, n: int):
        workers[name][1].send((prompt, n))
        result = workers[name][1].recv()[1]
        time.sleep(0.2)  # let the stack's idle threads stop spinning before the next one runs
        return result

    for name in workers:  # warm-up
        run(name, 8)
    results = {name: [] for name in workers}
    tokens = {}
    bandwidths = []  # measured between the rounds: the machine's bandwidth drifts with its neighbours
    for _ in range(args.repeats):
        for name in workers:  # alternated, so load shifts hit every stack alike
            toks, ttft, decode = run(name, args.new_tokens)
            tokens[name] = toks
            results[name].append((ttft, decode))
        bandwidths.append(read_bandwidth_gbs(args.threads, repeats=3))
    for proc, conn in workers.values():
        conn.send(None)
        proc.join(timeout=10)
    first = next(iter(args.tk))
    bandwidth = statistics.median(bandwidths)
    bound_ms = decode_bytes(args.checkpoint, args.prompt_len + args.new_tokens // 2) / (bandwidth * 1e9) * 1e3
    report = {"workload": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": 1,
                           "threads": args.threads, "repeats": args.repeats},
              "read_bandwidth_gbs": bandwidth, "decode_bound_ms": bound_ms, "stacks": {}}
    context = args.prompt_len + args.new_tokens // 2
    for name, rs in results.items():
        decode = statistics.median(r[1] for r in rs)
        own = decode_bytes(args.checkpoint, context, args.tk[name][0]) / (bandwidth * 1e9) * 1e3 \
            if name in args.tk else bound_ms
        report["stacks"][name] = {"ttft_ms": statistics.median(r[0] for r in rs), "decode_ms_per_token": decode,
                                  "decode_spread_ms": [min(r[1] for r in rs), max(r[1] for r in rs)],
                                  "fraction_of_decode_bound": own / decode, "decode_bound_ms": own,
                                  "runs": [{"ttft_ms": r[0], "decode_ms_per_token": r[1]} for r in rs],
                                  "same_tokens_as_first": tokens[name] == tokens[first], **memory[name]}
        if name in args.tk:
            weights = (args.tk[name][0] / "weights.onnx.data")
            report["stacks"][name]["weights_bytes"] = weights.stat().st_size if weights.exists() else None
    print(f"prompt {args.prompt_len}, {args.new_tokens} new tokens, batch 1, {args.threads} threads, "
          f"median of {args.repeats}, each stack in its own process")
    print(f"{'stack':32} {'ttft ms':>8} {'decode ms/tok':>14} {'of bound':>9} {'RSS after load':>15}  same tokens")
    for name, r in report["stacks"].items():
        print(f"{name:32} {r['ttft_ms']:8.2f} {r['decode_ms_per_token']:14.2f} {r['fraction_of_decode_bound']:9.2f} "
              f"{r['rss_after_load'] / 2**20:11.1f} MiB  {r['same_tokens_as_first']}")
    print(f"decode bound: {bound_ms:.2f} ms/token ({decode_bytes(args.checkpoint, 0) / 1e6:.0f} MB of weights and "
          f"the cache per token at {bandwidth:.1f} GB/s read bandwidth)")
    ratios = {}
    for anchor in (n for n in workers if n not in args.tk):
        for tk in args.tk:
            if tk not in workers:
                continue
            pairs = list(zip(results[anchor], results[tk]))
            r = {"decode": statistics.median(a[1] / t[1] for a, t in pairs),
                 "ttft": statistics.median(a[0] / t[0] for a, t in pairs)}
            ratios[f"{anchor} / {tk}"] = r
            print(f"{anchor} / {tk}: decode {r['decode']:.3f}, time to first token {r['ttft']:.3f} "
                  f"(median of {len(pairs)} paired runs; above 1: tk is faster)")
    report["ratios"] = ratios
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
