"""Export a Hugging Face checkpoint and generate through the Python API on PyTorch and ONNX Runtime.

    python examples/export_and_generate.py [CHECKPOINT_DIR] [--out DIR] [--prompt TEXT]

Without CHECKPOINT_DIR it writes the built-in tiny preset first, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tk.models.fixtures.presets import write_preset
from tk.runtimes.decoding.generate import generate
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.backends import open_runtime
from tk.toolkit.textgen import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tk-example-"))
    checkpoint = args.checkpoint or write_preset("tiny", work / "checkpoint")
    out = args.out or work / "artifact"
    manifest = export_artifact(checkpoint, out, dtype="fp32", progress=print)  # validates ORT against torch

    tokenizer = Tokenizer(out)
    prompt = tokenizer.encode(args.prompt)
    sampling = SamplingConfig(temperature=0.0)  # greedy; try temperature=0.8, top_p=0.9, seed=1
    for backend in ("torch", "ort"):
        with open_runtime(out, backend) as runtime:
            result = generate(runtime, [prompt], args.max_new_tokens, sampling,
                              eos_ids=manifest.eos_token_ids)
        row = result.rows[0]
        print(f"{backend:5} {tokenizer.decode(row.tokens)!r} ({row.finish_reason}, "
              f"{result.decode_ms_per_token:.2f} ms/token, tokens {row.tokens})")


if __name__ == "__main__":
    main()
