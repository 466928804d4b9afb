"""What int4 costs, tk's quantizers against onnxruntime-genai's and llama.cpp's, on one checkpoint and one text.

    python examples/quality_int4.py CHECKPOINT TEXT --work DIR [--window 512] [--max-tokens 16384]
        [--calibration FILE] [--llama BIN_DIR] [--report FILE]

Exports CHECKPOINT with tk in each quantization of TK_BUILDS into DIR, builds onnxruntime-genai's
CPU int4 models (`-p int4 -e cpu`, algo_config default / k_quant / k_quant_mixed) with its builder,
and scores each on the same windows of TEXT, teacher-forced (one prefill per window): perplexity,
and against the float32 PyTorch reference's logits the KL divergence per token (mean, 99th
percentile) and top-1 agreement, with the weights' bytes on disk. tk runs on ONNX Runtime as users
run it (int8 compute); genai's graph runs directly on ONNX Runtime. With --llama (a folder holding
llama-quantize and llama-perplexity, and `convert_hf_to_gguf.py` beside them two levels up, as the
llama-cpp-python sdist's vendored build lays out) llama.cpp's F32, Q4_0 and Q4_K_M are scored by its
own `llama-perplexity` (its ratios are to its own F32: it scores the second half of each window).
Run it with a Python that has onnxruntime-genai and tk (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# name -> tk export flags (ExportOptions.from_flags keywords)
TK_BUILDS = {
    "tk int4 rtn symmetric b32 (before)": dict(weights="int4", block_size=32, quant_method="rtn", zero_points=False,
                                                quantize_embedding=False),
    "tk int4 rtn zero points b32": dict(weights="int4", block_size=32, quant_method="rtn"),
    "tk int4 search b32": dict(weights="int4", block_size=32),
    "tk int4 search b64": dict(weights="int4", block_size=64),
    "tk int4 search b128": dict(weights="int4", block_size=128),
    "tk int4 search b32 int8 lm-head": dict(weights="int4", block_size=32, mixed_precision="lm-head"),
    "tk int4 search b32 int8 sensitive": dict(weights="int4", block_size=32, mixed_precision="sensitive"),
    "tk int4 search b32 lm-head b16": dict(weights="int4", block_size=32, lm_head_block_size=16),
    "tk int4 search b32 int8 sensitive lm-head b16": dict(weights="int4", block_size=32, mixed_precision="sensitive",
                                                          lm_head_block_size=16),
}
GENAI_BUILDS = {"genai int4 default": "default", "genai int4 k_quant": "k_quant",
                "genai int4 k_quant_mixed": "k_quant_mixed"}


def genai_logits(folder: Path):
    """A function of a window -> its (S, V) logits through genai's model.onnx on ONNX Runtime."""
    import onnxruntime as ort

    cfg = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(folder / cfg["filename"]), providers=["CPUExecutionProvider"])

    def run(chunk):
        ids = np.array([chunk], np.int64)
        feeds = {}
        for inp in sess.get_inputs():
            if inp.name == "input_ids":
                feeds[inp.name] = ids
            elif inp.name == "attention_mask":
                feeds[inp.name] = np.ones_like(ids)
            elif inp.name == "position_ids":
                feeds[inp.name] = np.arange(len(chunk), dtype=np.int64)[None]
            elif inp.name.startswith("past_key_values"):
                dtype = np.float16 if "float16" in inp.type else np.float32
                feeds[inp.name] = np.zeros((1, cfg["num_key_value_heads"], 0, cfg["head_size"]), dtype)
        return sess.run(["logits"], feeds)[0][0]

    return run


def folder_bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


def llama_rows(args, text: Path) -> dict:
    """llama.cpp's own perplexity of F32, Q4_0 and Q4_K_M GGUFs of the checkpoint (and their KL to F32)."""
    bins, work = args.llama, args.work / "llama"
    convert = bins.parents[1] / "convert_hf_to_gguf.py"
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / "f32.gguf"
    if not f32.exists():
        subprocess.run([sys.executable, str(convert), str(args.checkpoint), "--outfile", str(f32), "--outtype", "f32"],
                       check=True, capture_output=True, env={"PYTHONPATH": str(convert.parent / "gguf-py"),
                                                             "PATH": "/usr/bin:/bin"})
    rows, base = {}, work / "f32.kld"
    for quant in ("F32", "Q4_0", "Q4_K_M"):
        gguf = f32 if quant == "F32" else work / f"{quant.lower()}.gguf"
        if not gguf.exists():
            subprocess.run([str(bins / "llama-quantize"), str(f32), str(gguf), quant], check=True, capture_output=True)
        cmd = [str(bins / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(args.window), "-t", "2",
               "-b", str(args.window)]
        cmd += ["--kl-divergence-base", str(base)] if quant == "F32" else ["--kl-divergence-base", str(base),
                                                                            "--kl-divergence"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        log = out.stdout + out.stderr
        ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log) or re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", log)
        kl = re.search(r"Mean\s+KLD:\s+([0-9.]+)", log)
        p99 = re.search(r"99\.0%\s+KLD:\s+([0-9.]+)", log)
        same = re.search(r"Same top p:\s+([0-9.]+)", log)
        rows[f"llama.cpp {quant}"] = {"perplexity": float(ppl.group(1)) if ppl else None,
                                      "kl_mean": float(kl.group(1)) if kl else None,
                                      "kl_p99": float(p99.group(1)) if p99 else None,
                                      "top1_agreement": float(same.group(1)) / 100 if same else None,
                                      "bytes": gguf.stat().st_size, "scored": "its own (second half of each window)"}
    f32_ppl = rows["llama.cpp F32"]["perplexity"]
    for row in rows.values():
        row["perplexity_ratio"] = row["perplexity"] / f32_ppl if row["perplexity"] and f32_ppl else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("text", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16384, help="Score at most this many tokens of TEXT.")
    ap.add_argument("--calibration", type=Path, help="Also export the search with this calibration text.")
    ap.add_argument("--only", help="A regular expression: only the builds whose name matches.")
    ap.add_argument("--llama", type=Path, help="Folder of llama.cpp's llama-quantize and llama-perplexity.")
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()

    from tk.runtimes.backends.ort import OrtRuntime
    from tk.toolkit.backends import reference_runtime
    from tk.toolkit.pipeline.export import export_artifact
    from tk.toolkit.textgen import Tokenizer
    from tk.toolkit.verify.perplexity import Scores, window_logits, windows

    args.work.mkdir(parents=True, exist_ok=True)
    builds = dict(TK_BUILDS)
    if args.calibration:
        builds["tk int4 search b32 calibrated"] = dict(weights="int4", block_size=32, calibration=args.calibration)
        builds["tk int4 search b32 int8 sensitive calibrated"] = dict(
            weights="int4", block_size=32, mixed_precision="sensitive", calibration=args.calibration)
        builds["tk int4 search b32 lm-head b16 calibrated"] = dict(weights="int4", block_size=32, lm_head_block_size=16,
                                                                   calibration=args.calibration)
        builds["tk int4 search b32 int8 sensitive lm-head b16 calibrated"] = dict(
            weights="int4", block_size=32, mixed_precision="sensitive", lm_head_block_size=16,
            calibration=args.calibration)
    keep = re.compile(args.only) if args.only else None
    fp32 = args.work / "tk-fp32"
    if not fp32.exists():
        export_artifact(args.checkpoint, fp32, validate=False)
    runs = {}
    for name, flags in builds.items():
        if keep and not keep.search(name):
            continue
        out = args.work / re.sub(r"[^a-z0-9]+", "-", name.lower())
        if not out.exists():
            start = time.perf_counter()
            export_artifact(args.checkpoint, out, validate=False, **flags)
            print(f"exported {name} in {time.perf_counter() - start:.0f} s", flush=True)
        runs[name] = (out, folder_bytes(out, "weights.onnx.data"))
    for name, algo in GENAI_BUILDS.items():
        if keep and not keep.search(name):
            continue
        out = args.work / f"genai-{algo}"
        if not out.exists():
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(args.checkpoint), "-i",
                            str(args.checkpoint), "-o", str(out), "-p", "int4", "-e", "cpu", "--extra_options",
                            f"algo_config={algo}"], check=True, capture_output=True)
        runs[name] = (out, folder_bytes(out, "model.onnx*"))

    text = args.text.read_text(encoding="utf-8")
    ids = Tokenizer(fp32).encode(text)[:args.max_tokens]
    chunks = windows(ids, args.window)
    with reference_runtime(fp32) as ref:
        reference = [window_logits(ref, c)[:-1] for c in chunks]
    base = Scores()
    for r, c in zip(reference, chunks):
        base.add(r, c)
    report = {"reference": {**base.row(), "bytes": folder_bytes(fp32, "weights.onnx.data")}}
    for name, (folder, size) in runs.items():
        if name.startswith("genai"):
            run, close = genai_logits(folder), None
        else:
            rt = OrtRuntime(folder, quant_compute="int8").__enter__()
            run, close = (lambda c, rt=rt: window_logits(rt, c)), rt
        scores = Scores()
        for r, c in zip(reference, chunks):
            scores.add(run(c)[:-1], c, r)
        if close is not None:
            close.__exit__(None, None, None)
        report[name] = {**scores.row(base), "bytes": size}
        print(f"{name:48} {size / 1e6:8.2f} MB  ppl {report[name]['perplexity']:8.3f}  ratio "
              f"{report[name]['perplexity_ratio']:.4f}  KL {report[name]['kl_mean']:.5f} "
              f"(p99 {report[name]['kl_p99']:.4f})  top-1 {report[name]['top1_agreement']:.2%}", flush=True)
    if args.llama:
        scored = args.work / "llama-text.txt"
        scored.write_text(Tokenizer(fp32).decode(ids), encoding="utf-8")
        for name, row in llama_rows(args, scored).items():
            report[name] = row
            print(f"{name:48} {row['bytes'] / 1e6:8.2f} MB  ppl {row['perplexity']}  ratio {row['perplexity_ratio']}  "
                  f"KL {row['kl_mean']} (p99 {row['kl_p99']})  top-1 {row['top1_agreement']}", flush=True)
    print(f"reference float32: perplexity {report['reference']['perplexity']:.3f} over {base.count} tokens "
          f"(windows of {args.window})")
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
