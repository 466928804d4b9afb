"""Real sizes: what `tk export` and the ORT runtime cost on a checkpoint of a real model's shape.

Writes a checkpoint with random weights and the shape of TinyLlama-1.1B or Llama-2-7B (sharded
safetensors, written tensor by tensor), then, each in its own process so the kernel's peak RSS
(getrusage of the child) belongs to it alone:
- `tk export` (validation as given): wall time and peak RSS, against the weight bytes;
- the artifact's bytes against the weight bytes;
- the ORT runtime: RSS and PSS after loading, and after one generation (PSS counts the weights
  file, which both sessions memory-map, once);
- onnxruntime-genai's model builder on the same folder (`--genai-python`: a Python with
  onnxruntime-genai installed; it pins its own onnxruntime, so give it a venv of its own).

    python examples/bench_sizes.py --shape tinyllama --work /tmp/sizes --genai-python /tmp/genai-venv/bin/python
    python examples/bench_sizes.py --shape llama2-7b --dtype fp16 --work /tmp/sizes7b --no-validate
    python examples/bench_sizes.py --shape tinyllama --work /tmp/sizes --weights int4 --no-prepacked --rounds 1
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SHAPES = {
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
}


def write_checkpoint(folder: Path, shape: str, dtype: str, shard_bytes: int = 2 << 30) -> int:
    """Random weights (std 0.02, as HF's init) in shards; returns the weight bytes."""
    import torch
    from safetensors.torch import save_file

    from tk.models.checkpoint.families import config_from_hf
    from tk.models.checkpoint.names import hf_shapes
    from tk.models.fixtures.presets import _LLAMA, train_tokenizer

    hf = {**_LLAMA, **SHAPES[shape], "torch_dtype": {"fp32": "float32", "fp16": "float16"}[dtype]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    g = torch.Generator().manual_seed(0)
    shards, shard, size, total = [], {}, 0, 0
    for name, dims in sorted(hf_shapes(config_from_hf(hf)).items()):
        t = (torch.randn(dims, generator=g) * 0.02 if len(dims) > 1 else 1 + 0.1 * torch.randn(dims, generator=g))
        shard[name] = t.to(torch_dtype).contiguous()
        size += shard[name].numel() * shard[name].element_size()
        if size >= shard_bytes:
            shards.append(shard)
            save_file(shard, str(folder / f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            total, shard, size = total + size, {}, 0
    if shard:
        shards.append(shard)
        save_file(shard, str(folder / f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        total += size
    weight_map = {n: f"model-{i + 1:05d}.safetensors" for i, s in enumerate(shards) for n in s}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    train_tokenizer(folder, hf["vocab_size"])
    return total


def timed(cmd: list[str], **kw) -> tuple[float, int, subprocess.CompletedProcess, int]:
    """(wall seconds, peak RSS bytes of the largest child, result, peak of the summed RSS of the
    child's whole process tree, sampled every 0.2 s: tk export runs its reference in a child)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    tree_peak = [0]

    def sample():
        while proc.poll() is None:
            tree_peak[0] = max(tree_peak[0], _tree_rss(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.join()
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far
    return wall, peak, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), tree_peak[0]


def _tree_rss(pid: int) -> int:
    """Summed RSS of `pid` and all its descendants (/proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            total += next(int(l.split()[1]) * 1024 for l in Path(f"/proc/{p}/status").read_text().splitlines()
                          if l.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def watched(cmd: list[str], max_rss: int) -> str:
    """Run `cmd`, killing it if its RSS passes `max_rss` (a runtime that widens fp16 weights to fp32
    on the CPU would take the machine down with it); returns its stdout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        try:
            rss = int(Path(f"/proc/{proc.pid}/statm").read_text().split()[1]) * 4096
        except (FileNotFoundError, ProcessLookupError):
            break
        if rss > max_rss:
            proc.kill()
            sys.exit(f"killed {cmd[0]}: its RSS passed {max_rss / 2**30:.0f} GiB")
        time.sleep(0.5)
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"runtime check failed: {err[-2000:]}")
    return out


RUNTIME = """
import json, sys
from tk.runtimes.backends.ort import OrtRuntime
from tk.runtimes.decoding.generate import generate
def mem():
    rss = int(open('/proc/self/statm').read().split()[1]) * 4096
    pss = next(int(l.split()[1]) * 1024 for l in open('/proc/self/smaps_rollup') if l.startswith('Pss:'))
    return rss, pss
r0, p0 = mem()
rt = OrtRuntime({art!r}, prepack={prepack}).activate()
r1, p1 = mem()
tokens = generate(rt, [[5, 6, 7, 8]], 8, ignore_eos=True).rows[0].tokens
r2, p2 = mem()
print(json.dumps({{"load_rss": r1 - r0, "load_pss": p1 - p0, "run_rss": r2 - r0, "run_pss": p2 - p0,
                  "tokens": tokens}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="tinyllama")
    ap.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--no-validate", action="store_true")
    ap.add_argument("--weights", choices=["int4", "int8"],
                    help="tk export --weights (genai's builder: -p int4 for int4)")
    ap.add_argument("--genai-python", help="a Python with onnxruntime-genai (its builder is timed on the same folder)")
    ap.add_argument("--no-prepacked", action="store_true", help="skip the ORT run with prepacked weights (a copy each)")
    ap.add_argument("--max-rss-gib", type=float, default=20.0, help="kill a runtime check whose RSS passes this")
    ap.add_argument("--rounds", type=int, default=2, help="tk export and genai's builder, alternated, this many times")
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()
    ckpt, art = args.work / "checkpoint", args.work / "artifact"
    if not (ckpt / "config.json").is_file():
        t = time.perf_counter()
        weights = write_checkpoint(ckpt, args.shape, args.dtype)
        print(f"checkpoint {args.shape} {args.dtype}: {weights / 2**30:.2f} GiB in {time.perf_counter() - t:.0f} s",
              flush=True)
    weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    tk = str(Path(sys.executable).with_name("tk"))
    cmd = [tk, "export", str(ckpt), "-o", str(art), "--dtype", args.dtype,
           *(["--no-validate"] if args.no_validate else []), *(["--weights", args.weights] if args.weights else [])]
    genai_cmd = None
    if args.genai_python:
        genai_out = args.work / "genai"
        precision = "int4" if args.weights == "int4" else args.dtype
        genai_cmd = [args.genai_python, "-m", "onnxruntime_genai.models.builder", "-m", str(ckpt), "-i", str(ckpt),
                     "-o", str(genai_out), "-p", precision, "-e", "cpu", "-c", str(args.work / "genai-cache")]
    walls, genai_walls, time_peak, tree_peak = [], [], 0, 0
    for _ in range(args.rounds):  # tk, then genai's builder, alternated: the machine's drift hits both
        shutil.rmtree(art, ignore_errors=True)
        wall, peak, out, tree = timed(["/usr/bin/time", "-v", *cmd])
        print(out.stderr)
        if out.returncode != 0:
            sys.exit(f"tk export failed ({out.returncode})")
        walls.append(wall)
        time_peak = max(time_peak, next((int(l.split()[-1]) * 1024 for l in out.stderr.splitlines()
                                         if "Maximum resident" in l), peak))
        tree_peak = max(tree_peak, tree)
        if genai_cmd:
            shutil.rmtree(genai_out, ignore_errors=True)
            g_wall, _, g, _ = timed(genai_cmd)
            if g.returncode != 0:
                print(g.stderr[-2000:])
                genai_cmd = None
            else:
                genai_walls.append(g_wall)
    wall = statistics.median(walls)
    artifact = sum(p.stat().st_size for p in art.iterdir() if p.is_file())
    report = {"shape": args.shape, "dtype": args.dtype, "weights_bytes": weights, "export_s": wall,
              "export_runs_s": walls, "export_peak_rss": time_peak, "export_tree_peak_rss": tree_peak,
              "artifact_bytes": artifact}
    if genai_walls:
        report["genai_builder_s"] = statistics.median(genai_walls)
        report["genai_runs_s"] = genai_walls
        report["export_time_ratio"] = statistics.median(t / g for t, g in zip(walls, genai_walls))
    for prepack in (False,) if args.no_prepacked else (False, True):
        code = RUNTIME.format(art=str(art), prepack=prepack)
        result = watched([sys.executable, "-c", code], int(args.max_rss_gib * 2**30))
        report["ort_prepacked" if prepack else "ort_shared"] = json.loads(result.strip().splitlines()[-1])
    gib = 2**30
    bound = 1.3 * weights + gib
    print(f"weights {weights / gib:.2f} GiB; tk export {wall:.1f} s (median of {walls}), peak RSS "
          f"{time_peak / gib:.2f} GiB of its largest process, {tree_peak / gib:.2f} GiB summed over its processes "
          f"({tree_peak / weights:.2f}x the weights; bound 1.3x + 1 GiB = {bound / gib:.2f} GiB); artifact "
          f"{artifact / weights:.3f}x the weights")
    for key in ("ort_shared", "ort_prepacked"):
        if key not in report:
            continue
        m = report[key]
        print(f"{key}: after load RSS {m['load_rss'] / weights:.2f}x / PSS {m['load_pss'] / weights:.2f}x the weights; "
              f"after a generation RSS {m['run_rss'] / weights:.2f}x / PSS {m['run_pss'] / weights:.2f}x")
    if report.get("genai_builder_s"):
        print(f"onnxruntime-genai builder {report['genai_builder_s']:.1f} s (median of {genai_walls}): tk/genai "
              f"export time {report['export_time_ratio']:.2f} (median of the alternated pairs)")
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
