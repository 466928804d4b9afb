"""MXFP4 (the OCP Microscaling format's FP4) as gpt-oss checkpoints ship their experts: per tensor `{name}_blocks`
(uint8 [..., rows, in / 32, 16], two 4-bit e2m1 codes a byte, the low nibble first) and `{name}_scales` (uint8
[..., rows, in / 32], an e8m0 exponent per 32 values, biased by 127). A value is its code's e2m1 number times
2 ** (scale - 127): exactly representable in float32 (and bfloat16) for every scale a checkpoint holds, so
dequantizing is exact. Such a tensor is stored [out, in] per expert: the transpose of what transformers' dense
`gate_up_proj` / `down_proj` hold (models/checkpoint/names.py marks those `transposed`).
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
# e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 their negatives
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NAN_SCALE = 255  # e8m0's NaN


def is_mxfp4(quantization_config: dict | None) -> bool:
    return (quantization_config or {}).get("quant_method") == "mxfp4"


def packed_shapes(dense: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """A dense [..., in, out] tensor's MXFP4 blocks and scales shapes ([..., out, in / 32, 16], [..., out, in / 32]);
    None where `in` is not a multiple of 32."""
    *lead, k, n = dense
    if k % BLOCK:
        return {}
    return {"_blocks": (*lead, n, k // BLOCK, BLOCK // 2), "_scales": (*lead, n, k // BLOCK)}


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., G, 16] and scales [..., G] -> float32 [..., G * 32], exactly: each code's e2m1 value
    times 2 ** (scale - 127) (ldexp: an exponent change, no rounding)."""
    if bool((scales == NAN_SCALE).any()):
        raise ValueError("an MXFP4 scale is 255, e8m0's NaN")
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # (..., G, 16, 2): low nibble first
    values = table[codes].flatten(-2)  # (..., G, 32)
    exponents = (scales.to(torch.int32) - 127)[..., None]
    return torch.ldexp(values, exponents.to(torch.float32)).flatten(-2)
