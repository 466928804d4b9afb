"""What re-quantizing gpt-oss's MXFP4 experts into tk's integer formats costs: MXFP4 values (e2m1 codes times a
power of two per 32 inputs) are not on an int4 grid, so `tk export --weights int4` of an MXFP4 checkpoint rounds
them again. This measures that rounding on one expert matrix of gpt-oss-20b's shape (2880 x 2880 of its 5760
gate/up rows), made MXFP4 from Gaussian weights by the format's rules (tests/test_attention_2026.py `to_mxfp4`):
the relative RMS error and the share of values kept exactly, for tk's int4 (round to nearest and its default
search, blocks of 32, with and without zero points) and int8 (blocks of 32).

    python examples/mxfp4_int4.py [--rows 2880] [--cols 2880] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_attention_2026 import to_mxfp4  # noqa: E402  (the format's rules, as the tests make MXFP4 tensors)

from tk.models.checkpoint import mxfp4  # noqa: E402
from tk.models.quant.quantize import Scheme, dequantize, quantize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2880, help="output rows (N)")
    ap.add_argument("--cols", type=int, default=2880, help="inputs (K), a multiple of 32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    dense = torch.randn(args.rows, args.cols, generator=g) * 0.02  # [out, in], as MXFP4 blocks run along the inputs
    blocks, scales = to_mxfp4(dense)
    w = mxfp4.dequantize(blocks, scales).T.contiguous().numpy()  # [K, N]: the exact MXFP4 values, as tk quantizes
    print(f"MXFP4 {args.rows} x {args.cols}: its own error against the Gaussian weights "
          f"{_relative(w, dense.T.numpy()):.4f}")
    for name, scheme in (("int4 (rtn), blocks of 32", Scheme("int4", 32)),
                         ("int4 (search: tk's default), blocks of 32", Scheme("int4", 32, "search")),
                         ("int4 (search), zero points", Scheme("int4", 32, "search", True)),
                         ("int8 (search), blocks of 32", Scheme("int8", 32, "search"))):
        back = dequantize(quantize(w, scheme), scheme.block)
        print(f"{name:42} relative RMS error {_relative(back, w):.4f}, values kept exactly "
              f"{np.mean(back == w):.1%}")


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b ** 2).mean()))


if __name__ == "__main__":
    main()
