"""Time tk's int4/int8 weight quantizer (models/quant/quantize.py) on a 1.1B model's weights (issue 37).

The weights tk quantizes in a TinyLlama-1.1B-shaped export (hidden 2048, intermediate 5632, 22 layers,
32 heads, 4 KV heads, vocabulary 32000), as `quantize` gets them ([K, N], fused as tk stores them):
per layer wqkv [2048, 2560], wo [2048, 2048], w_gate_up [2048, 11264], w_down [5632, 2048]; and the LM
head [2048, 32000]. Seeded random weights drawn like trained ones: Student-t tails, a few loud input
channels. Only `--layers` of the 22 layers are quantized (each layer has the same shapes, and the
quantizer's time does not depend on the values' layer): the total is their time times 22 / layers,
plus the LM head's, and the script says so.

`--reference` times the algorithm before issue 37 too (a verbatim copy kept in
tests/test_quant_speed.py) on the same weights, and checks that both give the same q, scales and
zero points, bit for bit. `--llama-quantize PATH --gguf F32.gguf` runs llama.cpp's llama-quantize
(Q4_K_M, its own thread count) on a GGUF of the same shape in the same run and prints both times.
`--int8-gain` measures what the search gains over round-to-nearest for int8 (the weighted error the
search minimizes, and the plain squared error).

`--checkpoint DIR` times instead what `tk export DIR --weights int4` spends on the weights, alone: the
export's writer (exporters/weights.py `write_weights`: read the safetensors, transpose, quantize, write
the weights file) on a real checkpoint, against `llama-quantize` of a GGUF of the same checkpoint
(`--gguf`), alternated (llama.cpp, tk, llama.cpp, ...) `--repeats` times.

    python examples/bench_quantize.py --layers 2 --reference
    python examples/bench_quantize.py --llama-quantize .../build/bin/llama-quantize --gguf tiny11-f32.gguf
    python examples/bench_quantize.py --checkpoint qwen05 --llama-quantize .../llama-quantize --gguf qwen05-f32.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 2048, 5632, 22, 32, 4, 32000
HEAD_DIM = HIDDEN // HEADS


def layer_shapes() -> dict[str, tuple[int, int]]:
    """[K, N] of each weight one layer quantizes (tk's fused names)."""
    qkv = HIDDEN + 2 * KV_HEADS * HEAD_DIM
    return {"attn.wqkv": (HIDDEN, qkv), "attn.wo": (HIDDEN, HIDDEN), "ffn.w_gate_up": (HIDDEN, 2 * INTER),
            "ffn.w_down": (INTER, HIDDEN)}


def trained_like(k: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_t(5, (k, n)).astype(np.float32) * np.float32(0.02)
    w[rng.choice(k, 4, replace=False)] *= 8  # a few loud input channels
    w[:, rng.choice(n, 2, replace=False)] *= 3  # and output columns
    return w


def weights(layers: int):
    """(name, w_t) of the sampled layers and the LM head, made one at a time."""
    for i in range(layers):
        for j, (name, (k, n)) in enumerate(layer_shapes().items()):
            yield f"layers.{i}.{name}", trained_like(k, n, 100 * i + j)
    yield "lm_head", trained_like(HIDDEN, VOCAB, 99999)


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def same(a, b) -> bool:
    return (np.array_equal(a.q, b.q) and a.q.dtype == b.q.dtype and np.array_equal(a.scales, b.scales)
            and (a.zeros is None) == (b.zeros is None) and (a.zeros is None or np.array_equal(a.zeros, b.zeros)))


def bench_tk(args) -> dict:
    from tk.models.quant.quantize import Scheme, quant_threads, quantize

    ref = None
    if args.reference:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_quant_speed import reference_quantize as ref
    scheme = Scheme(args.bits, args.block, args.method, not args.symmetric)
    threads = args.threads or quant_threads()
    scale = LAYERS / args.layers
    rows, totals = [], {"new": [0.0, 0.0], "old": [0.0, 0.0]}
    for name, w in weights(args.layers):
        times = {}
        new, *times["new"] = timed(lambda w=w: quantize(w, scheme, threads=threads))
        if ref is not None:
            old, *times["old"] = timed(lambda w=w: ref(w, scheme))
            if not same(new, old):
                raise SystemExit(f"{name}: the new quantizer's result differs from the reference's")
        factor = 1.0 if name == "lm_head" else scale
        for kind, (wall, cpu) in times.items():
            totals[kind][0] += wall * factor
            totals[kind][1] += cpu * factor
        rows.append({"name": name, "shape": list(w.shape), **{f"{k}_wall_s": round(v[0], 3) for k, v in times.items()},
                     **{f"{k}_cpu_s": round(v[1], 3) for k, v in times.items()}})
        print(f"  {name:24s} {list(w.shape)!s:14s} " + "  ".join(
            f"{k}: {v[0]:6.2f} s wall {v[1]:6.2f} s cpu" for k, v in times.items()), flush=True)
    out = {"scheme": {"bits": scheme.bits, "block": scheme.block, "method": scheme.method,
                      "zero_points": scheme.zero_points}, "threads": threads, "cpu_count": os.cpu_count(),
           "layers_timed": args.layers, "layers_model": LAYERS, "tensors": rows,
           "model_new_wall_s": round(totals["new"][0], 1), "model_new_cpu_s": round(totals["new"][1], 1)}
    if ref is not None:
        out.update(model_old_wall_s=round(totals["old"][0], 1), model_old_cpu_s=round(totals["old"][1], 1),
                   bit_identical=True)
    return out


def bench_llama(path: str, gguf: str) -> dict:
    exe = Path(path)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{exe.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(dir=Path(gguf).parent) as tmp:
        wall = time.perf_counter()
        p = subprocess.run([str(exe), gguf, str(Path(tmp) / "q4km.gguf"), "Q4_K_M"], env=env,
                           capture_output=True, text=True, check=False)
        wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if p.returncode:
        raise SystemExit(f"llama-quantize failed ({p.returncode}):\n{p.stderr[-2000:]}")
    said = [line for line in (p.stdout + p.stderr).splitlines() if "quantize time" in line]
    return {"llama_quantize_q4_k_m_wall_s": round(wall, 1), "llama_quantize_q4_k_m_cpu_s": round(cpu, 1),
            "llama_quantize_says": said[-1].strip() if said else None}


def bench_writer(checkpoint: str, out_dir: str) -> dict:
    """The export's writer alone, with `tk export --weights int4`'s defaults, into a file in out_dir."""
    from tk.exporters.weights import WEIGHTS_FILE, export_view, write_weights
    from tk.models.checkpoint.loading import CheckpointReader, read_config, torch_dtype
    from tk.models.spec.options import ExportOptions

    config = read_config(checkpoint)
    precision = ExportOptions.from_flags(weights="int4").for_model(config).precision
    dtype = torch_dtype(precision.activations)
    path = Path(out_dir) / WEIGHTS_FILE
    _, wall, cpu = timed(lambda: write_weights(CheckpointReader(checkpoint, config), export_view(config, dtype), path,
                                               dtype, precision=precision))
    size = path.stat().st_size
    path.unlink()
    return {"tk_writer_wall_s": round(wall, 1), "tk_writer_cpu_s": round(cpu, 1), "tk_weights_bytes": size,
            "precision": precision.describe()}


def compare_checkpoint(args) -> dict:
    """llama-quantize Q4_K_M and tk's writer on the same checkpoint, alternated."""
    runs = []
    with tempfile.TemporaryDirectory(dir=Path(args.gguf).parent) as tmp:
        for i in range(args.repeats):
            lq = bench_llama(args.llama_quantize, args.gguf)
            tk = bench_writer(args.checkpoint, tmp)
            runs.append({**lq, **tk})
            lq_wall, tk_wall = lq["llama_quantize_q4_k_m_wall_s"], tk["tk_writer_wall_s"]
            print(f"  run {i + 1}: llama-quantize Q4_K_M {lq_wall} s wall ({lq['llama_quantize_q4_k_m_cpu_s']} s cpu); "
                  f"tk writer ({tk['precision']}) {tk_wall} s wall ({tk['tk_writer_cpu_s']} s cpu): "
                  f"{tk_wall / lq_wall:.2f}x", flush=True)
    ratios = sorted(r["tk_writer_wall_s"] / r["llama_quantize_q4_k_m_wall_s"] for r in runs)
    return {"checkpoint": args.checkpoint, "runs": runs, "tk_over_llama_quantize_wall_median": ratios[len(ratios) // 2]}


def int8_gain(args) -> dict:
    """What the int8 search gains over round-to-nearest, on the sampled layers' weights."""
    from tk.models.quant.quantize import Scheme, dequantize, quantize

    out = {}
    for zp in (True, False):
        sums = {"rtn": [0.0, 0.0], "search": [0.0, 0.0]}
        for name, w in weights(1):
            if name == "lm_head":
                continue
            k, n = w.shape
            x = w.reshape(k // args.block, args.block, n)
            x2 = x * x  # the search's own error weights, av|x| + |x| (models/quant/kernel.py's, without calibration)
            wt = (np.sqrt(x2.mean(axis=1, keepdims=True)) + np.abs(x)).reshape(k, n)
            for method in sums:  # noqa: PLC0206
                d = dequantize(quantize(w, Scheme("int8", args.block, method, zp)), args.block) - w
                sums[method][0] += float((wt * d * d).sum(dtype=np.float64))
                sums[method][1] += float((d * d).sum(dtype=np.float64))
        out["zero_points" if zp else "symmetric"] = {
            "weighted_error_search_over_rtn": round(sums["search"][0] / sums["rtn"][0], 4),
            "squared_error_search_over_rtn": round(sums["search"][1] / sums["rtn"][1], 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="layers of the 22 to quantize (the total scales up)")
    ap.add_argument("--bits", default="int4", choices=["int4", "int8"])
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--method", default="search", choices=["rtn", "search"])
    ap.add_argument("--symmetric", action="store_true", help="no zero points (tk's default has them)")
    ap.add_argument("--threads", type=int, default=0, help="quantize's threads (default: quant_threads())")
    ap.add_argument("--reference", action="store_true", help="also time the algorithm before issue 37")
    ap.add_argument("--llama-quantize", help="llama.cpp's llama-quantize binary")
    ap.add_argument("--gguf", help="an F32 GGUF of the same shape, for --llama-quantize")
    ap.add_argument("--int8-gain", action="store_true")
    ap.add_argument("--checkpoint", help="a Hugging Face checkpoint: time the export's writer on it (needs "
                    "--llama-quantize and --gguf of the same checkpoint)")
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs of each, with --checkpoint")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    result = {}
    if args.checkpoint:
        if not (args.llama_quantize and args.gguf):
            ap.error("--checkpoint needs --llama-quantize and --gguf")
        result = compare_checkpoint(args)
        median = result["tk_over_llama_quantize_wall_median"]
        print(f"tk writer / llama-quantize (wall, median of {args.repeats}): {median:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return
    if args.llama_quantize:
        if not args.gguf:
            ap.error("--llama-quantize needs --gguf")
        print("llama-quantize Q4_K_M ...", flush=True)
        result.update(bench_llama(args.llama_quantize, args.gguf))
        print(f"  {result['llama_quantize_q4_k_m_wall_s']} s wall, {result['llama_quantize_q4_k_m_cpu_s']} s cpu "
              f"({result['llama_quantize_says']})", flush=True)
    print(f"tk quantize, {args.layers} of {LAYERS} layers (times scaled by {LAYERS / args.layers:g}) and the LM head:",
          flush=True)
    result.update(bench_tk(args))
    if args.int8_gain:
        result["int8_gain"] = int8_gain(args)
    print(f"1.1B model, tk {args.bits} {args.method}{'' if args.symmetric else ' zero points'} block {args.block}, "
          f"{result['threads']} thread(s): {result['model_new_wall_s']} s wall, {result['model_new_cpu_s']} s cpu")
    if args.reference:
        print(f"  before issue 37: {result['model_old_wall_s']} s wall, {result['model_old_cpu_s']} s cpu "
              f"(bit-identical results)")
    if args.llama_quantize:
        print(f"  llama-quantize Q4_K_M: {result['llama_quantize_q4_k_m_wall_s']} s wall, "
              f"{result['llama_quantize_q4_k_m_cpu_s']} s cpu; tk / llama.cpp: "
              f"{result['model_new_wall_s'] / result['llama_quantize_q4_k_m_wall_s']:.2f} (wall), "
              f"{result['model_new_cpu_s'] / result['llama_quantize_q4_k_m_cpu_s']:.2f} (cpu)")
    if "int8_gain" in result:
        print("int8 search / rtn error:", json.dumps(result["int8_gain"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
