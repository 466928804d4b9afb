"""Checkpoints someone already quantized: GPTQ and AWQ folders, read as integers, not re-quantized.

A folder whose config.json has a `quantization_config` with `quant_method` "gptq" or "awq" holds,
for each quantized linear layer `X` (in_features K, out_features N, group size G, b bits, 32 / b
values per int32):
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq"; transformers' GPTQ integration):
  `X.qweight` int32 [K / (32/b), N], packed along K (value k at bits b * (k % (32/b)) of row k // (32/b));
  `X.qzeros` int32 [ceil(K/G), N / (32/b)], packed along N the same way; `X.scales` [ceil(K/G), N];
  `X.g_idx` int32 [K], each input channel's group. The "gptq" (v1) format stores each zero point
  minus one: w = (q - (z + 1)) * s; "gptq_v2" stores it as it is: w = (q - z) * s.
- AWQ (AutoAWQ's GEMM kernels, `version` "gemm"): `X.qweight` int32 [K, N / (32/b)] and `X.qzeros`
  int32 [ceil(K/G), N / (32/b)], both packed along N in AWQ's interleaved order (the eight values
  of an int32 are columns 0, 2, 4, 6, 1, 3, 5, 7 of its group of eight); `X.scales` [ceil(K/G), N];
  w = (q - z) * s.
(transformers' `integrations/awq.py` `unpack_awq`/`reverse_awq_order` and GPTQModel's
`dequantize_weight` are the reference code these follow.)

Both are what tk stores for a block-quantized weight with zero points (models/quant/quantize.py: q and z
unsigned, blocks of G rows of K), so they export straight to DequantizeLinear graphs from their
integers, and the reference decoder is their dequantized weights. Act-order GPTQ (`desc_act`, a
`g_idx` that is not k // G) assigns input channels to groups out of order, which blocked
DequantizeLinear cannot express over tk's fused projections: refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tk.models.spec.errors import CheckpointError

METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of its group of eight each 4-bit value of an int32 holds
GROUP_SIZES = (16, 32, 64, 128, 256)  # what ONNX Runtime's MatMulNBits takes


@dataclass(frozen=True)
class PreQuant:
    method: str  # "gptq" or "awq"
    bits: int
    group: int
    zero_offset: int  # added to the stored zero points: 1 for GPTQ's v1 format

    @property
    def weights(self) -> str:
        return f"int{self.bits}"


def read_prequantized(folder: Path) -> PreQuant | None:
    """The checkpoint's quantization, from config.json; None for a float checkpoint. A method or a
    layout tk does not read is one CheckpointError."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":  # gpt-oss's experts: dequantized exactly as they are read (models/checkpoint/mxfp4.py)
        return None
    if method not in METHODS:
        raise CheckpointError(f"config.json's quantization_config has quant_method {method!r}; tk reads GPTQ, "
                              "AWQ and MXFP4 (gpt-oss) checkpoints (or export the float checkpoint with --weights int4)")
    bits, group = int(q.get("bits", q.get("w_bit", 0))), int(q.get("group_size", q.get("q_group_size", 0)))
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise CheckpointError(f"{method.upper()} with {bits} bits: tk reads 4-bit{' and 8-bit' * (method == 'gptq')} "
                              "checkpoints")
    if group not in GROUP_SIZES:
        raise CheckpointError(f"{method.upper()} group_size {group}: tk reads groups of "
                              f"{', '.join(map(str, GROUP_SIZES))} input channels (what ONNX Runtime's MatMulNBits "
                              "takes)")
    if method == "awq" and (not q.get("zero_point", True) or str(q.get("version", "gemm")).lower() != "gemm"):
        raise CheckpointError("tk reads AWQ checkpoints of the GEMM layout with zero points (version gemm, "
                              "zero_point true)")
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"GPTQ checkpoint_format {fmt!r}: tk reads gptq and gptq_v2")
    return PreQuant(method, bits, group, 1 if method == "gptq" and fmt == "gptq" else 0)


def quantized_shapes(pq: PreQuant, k: int, n: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one quantized linear layer [N, K] and their shapes (`g_idx`: GPTQ only)."""
    per, groups = 32 // pq.bits, -(-k // pq.group)
    if pq.method == "gptq":
        return {"qweight": (-(-k // per), n), "qzeros": (groups, -(-n // per)), "scales": (groups, n), "g_idx": (k,)}
    return {"qweight": (k, -(-n // per)), "qzeros": (groups, -(-n // per)), "scales": (groups, n)}


def _unpack(packed: np.ndarray, bits: int, axis: int, count: int) -> np.ndarray:
    """int32 words -> the unsigned values they hold along `axis` (the lowest bits first), `count` of them."""
    per = 32 // bits
    words = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(per, dtype=np.int64) * bits
    values = (np.expand_dims(words, -1) >> shifts) & ((1 << bits) - 1)  # [..., per]
    values = np.moveaxis(values, -1, axis + 1)  # each word's values right after it along axis
    shape = list(packed.shape)
    shape[axis] *= per
    values = values.reshape(shape)
    return np.take(values, np.arange(count), axis=axis).astype(np.uint8)


def unpack(pq: PreQuant, name: str, tensors: dict[str, np.ndarray], k: int, n: int):
    """One layer's integers as tk stores them: (q uint8 [K, N], scales float32 [ceil(K/G), N],
    zeros uint8 [ceil(K/G), N]); `name` is the layer's, for errors."""
    from tk.models.quant.quantize import QTensor

    if pq.method == "gptq":
        q = _unpack(tensors["qweight"], pq.bits, 0, k)
        g_idx = tensors.get("g_idx")
        if g_idx is not None and not np.array_equal(g_idx.astype(np.int64), np.arange(k) // pq.group):
            raise CheckpointError(f"{name}.g_idx assigns input channels to groups out of order (act-order GPTQ, "
                                  "desc_act); tk's fused projections need groups of consecutive channels: quantize "
                                  "without desc_act, or export the float checkpoint with --weights int4")
    else:
        order = np.argsort(AWQ_ORDER)  # column j of a group of eight is value order[j] of its int32
        q = _unpack(tensors["qweight"], pq.bits, 1, n + (-n) % 8)
        q = q.reshape(k, -1, 8)[:, :, order].reshape(k, -1)[:, :n]
    z = _unpack(tensors["qzeros"], pq.bits, 1, n + (-n) % (32 // pq.bits)).astype(np.int16)
    if pq.method == "awq":
        z = z.reshape(z.shape[0], -1, 8)[:, :, np.argsort(AWQ_ORDER)].reshape(z.shape[0], -1)
    z = z[:, :n] + pq.zero_offset
    if z.max(initial=0) >= 1 << pq.bits:
        raise CheckpointError(f"{name}.qzeros holds a zero point of {int(z.max())}, beyond {pq.bits} bits; tk stores "
                              f"zero points as {pq.bits}-bit integers")
    return QTensor(q, tensors["scales"].astype(np.float32), z.astype(np.uint8))
