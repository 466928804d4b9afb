"""What int4 costs in perplexity, against onnxruntime-genai's int4 build of the same checkpoint.

    python examples/quality_int4.py CHECKPOINT TEXT --work DIR [--window 128]

Exports CHECKPOINT with tk (fp32, and `--weights int4`) into DIR, builds onnxruntime-genai's
int4 CPU model (`-p int4 -e cpu`) into DIR/genai-int4 if it is missing, tokenizes TEXT with the
checkpoint's tokenizer, and prints the perplexity of each, teacher-forced over the same windows:
the float32 PyTorch reference, tk int4 on ONNX Runtime (int8 compute, as users run it), and
genai's int4 graph run as it is by ONNX Runtime (one prefill per window, an empty cache). Run it
with a Python that has onnxruntime-genai (its builder) and tk importable (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np


def genai_nll(folder: Path, chunks: list[list[int]]) -> tuple[float, int]:
    """NLL of the windows through genai's model.onnx, run directly by ONNX Runtime."""
    import onnxruntime as ort

    from tk.toolkit.verify.perplexity import window_nll

    cfg = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(folder / cfg["filename"]), providers=["CPUExecutionProvider"])
    total = 0.0
    for chunk in chunks:
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
        total += window_nll(sess.run(["logits"], feeds)[0][0], chunk)
    return total, sum(len(c) - 1 for c in chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("text", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=32, help="tk's int4 block (genai's builder uses 32)")
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()

    from tk.runtimes.ort_runtime import OrtRuntime
    from tk.toolkit.backends import reference_runtime
    from tk.toolkit.verify.perplexity import nll, windows
    from tk.toolkit.pipeline.export import export_artifact
    from tk.toolkit.textgen import Tokenizer

    args.work.mkdir(parents=True, exist_ok=True)
    fp32, int4 = args.work / "tk-fp32", args.work / "tk-int4"
    if not fp32.exists():
        export_artifact(args.checkpoint, fp32)
    if not int4.exists():
        export_artifact(args.checkpoint, int4, weights="int4", block_size=args.block_size)
    genai = args.work / "genai-int4"
    if not genai.exists():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(args.checkpoint), "-i",
                        str(args.checkpoint), "-o", str(genai), "-p", "int4", "-e", "cpu"], check=True,
                       capture_output=True)
    chunks = windows(Tokenizer(fp32).encode(args.text.read_text(encoding="utf-8")), args.window)
    rows = {}
    for name, open_rt in (("torch float32 reference", lambda: reference_runtime(fp32)),
                          ("tk fp32 (ORT)", lambda: OrtRuntime(fp32)),
                          (f"tk int4 block {args.block_size} (ORT, int8 compute)", lambda: OrtRuntime(int4))):
        with open_rt() as rt:
            rows[name] = nll(rt, chunks)
    rows["onnxruntime-genai int4 (its graph on ORT)"] = genai_nll(genai, chunks)
    report = {name: {"tokens": n, "nll": t / n, "perplexity": math.exp(t / n)} for name, (t, n) in rows.items()}
    for name, r in report.items():
        print(f"{name:44} {r['tokens']:6} tokens  nll {r['nll']:.4f}  perplexity {r['perplexity']:.3f}")
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
