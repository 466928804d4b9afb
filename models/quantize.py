"""Weight-only quantization: what tk stores for a quantized linear layer, and what it means.

A linear layer's weight, held as ONNX MatMul reads it (`w_t`, [K, N]: K inputs, N outputs), is
split along K into blocks of `block` rows; each block of each column gets one positive scale
`s = max|w| / qmax` (symmetric, no zero point: qmax 7 for int4, 127 for int8) and its values
`q = round(w / s)`, clamped to [-qmax - 1, qmax]. Dequantized, `w ~= q * s`: what ONNX's
`DequantizeLinear(q, s, axis=0, block_size=block)` computes, and what ONNX Runtime fuses with the
MatMul into MatMulNBits.

Numpy, not torch: the exporter (writing the weights file) and the quantized reference (a child
process, at the same time) must get bit-identical q and s from the same float32 weight, and numpy's
elementwise float32 arithmetic does not depend on thread counts.
"""

from __future__ import annotations

import numpy as np

QMAX = {"int4": 7, "int8": 127}


def quantize(w_t: np.ndarray, bits: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """w_t float32 [K, N] -> (q int8 [K, N], scales float32 [K // block, N]); round to nearest."""
    k, n = w_t.shape
    if k % block:
        raise ValueError(f"block size {block} does not divide K = {k}")
    qmax = QMAX[bits]
    blocks = np.ascontiguousarray(w_t, dtype=np.float32).reshape(k // block, block, n)
    amax = np.abs(blocks).max(axis=1)
    scales = np.where(amax > 0, amax / np.float32(qmax), np.float32(1.0)).astype(np.float32)  # positive always
    q = np.clip(np.rint(blocks / scales[:, None, :]), -qmax - 1, qmax).astype(np.int8)
    return q.reshape(k, n), scales


def dequantize(q: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """(q int8 [K, N], scales [K // block, N]) -> float32 [K, N]: q * s, as DequantizeLinear does it."""
    k, n = q.shape
    return (q.reshape(k // block, block, n).astype(np.float32) * scales.astype(np.float32)[:, None, :]).reshape(k, n)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7] -> ONNX INT4 storage: two per byte, the first in the low nibble,
    packed over the flattened tensor (an odd count ends with a half-used byte)."""
    flat = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: np.ndarray, count: int) -> np.ndarray:
    """ONNX INT4 storage -> `count` int8 values (sign-extended)."""
    nibbles = np.empty(packed.size * 2, dtype=np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & 0xF, packed >> 4
    return ((nibbles[:count].astype(np.int16) ^ 8) - 8).astype(np.int8)


def quantized_layers(cfg, lm_head: bool) -> list[str]:
    """Our names of the linear weights a quantized export stores quantized: every projection of
    every layer (each expert's, and a shared expert's, in a mixture of experts), and the LM head when
    asked. Embeddings, routers and the shared expert's gate (one column) stay in the activation dtype."""
    names = []
    for i in range(cfg.num_layers):
        names += [f"layers.{i}.attn.wqkv.weight", f"layers.{i}.attn.wo.weight"]
        ffns = [f"layers.{i}.ffn."]
        if cfg.layer(i).moe:
            ffns = [f"layers.{i}.ffn.experts.{e}." for e in range(cfg.num_experts)]
            ffns += [f"layers.{i}.ffn.shared."] if cfg.shared_expert_size else []
        names += [f + w for f in ffns for w in ("w_gate_up.weight", "w_down.weight")]
    return names + (["lm_head.weight"] if lm_head else [])


def layer_ks(cfg) -> dict[str, int]:
    """Each kind of quantized layer's K (its input size), named as an error message would."""
    ks = {"layers.*.attn.wqkv and layers.*.ffn.w_gate_up (hidden_size)": cfg.hidden_size,
          "layers.*.attn.wo (num_heads x head_dim)": cfg.num_heads * cfg.head_dim}
    moe = [cfg.layer(i).moe for i in range(cfg.num_layers)]
    if not all(moe):
        ks["layers.*.ffn.w_down (intermediate_size)"] = cfg.intermediate_size
    if any(moe):
        ks["layers.*.ffn.experts.*.w_down (expert_size)"] = cfg.expert_size
    if any(moe) and cfg.shared_expert_size:
        ks["layers.*.ffn.shared.w_down (shared_expert_size)"] = cfg.shared_expert_size
    return ks
