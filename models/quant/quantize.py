"""Weight-only quantization: what tk stores for a quantized linear layer, and what it means.

A linear layer's weight, held as ONNX MatMul reads it (`w_t`, [K, N]: K inputs, N outputs), is
split along K into blocks of `block` rows (the last one partial when `block` does not divide K:
ONNX's blocked DequantizeLinear and ORT's MatMulNBits both take it). Each block of each column
gets a scale `s` and, with zero points, an integer zero point `z`; its values are integers `q`:
- symmetric (no zero point): q in [-2^(b-1), 2^(b-1) - 1], w ~= q * s, s > 0 (TensorRT's form);
- asymmetric (zero points): q and z in [0, 2^b - 1], w ~= (q - z) * s (both ONNX's
  DequantizeLinear and ORT's MatMulNBits take uint4/uint8 zero points).
What `DequantizeLinear(q, s[, z], axis=0, block_size=block)` computes, and what ONNX Runtime fuses
with the MatMul into MatMulNBits.

How s and z are chosen (`--quant-method`):
- `rtn`: round to nearest from the block's range (max |w|, or min and max with zero points).
- `search`: the k-quant family's weighted scale search (llama.cpp's `make_qkx2_quants`): for a
  grid of candidate scales, round, then solve the weighted least-squares fit of scale (and
  offset) to the rounded values, and keep the candidate of least weighted squared error. The
  weights are `av|w| + |w|` per element (llama.cpp's without an importance matrix), times the
  input channel's mean squared activation when calibration text gives one (its imatrix).
Half-Quadratic Quantization (HQQ's calibration-free proximal solver for the zero point) was tried
too: its zero points, rounded to the integers DequantizeLinear stores, came back to round-to-nearest's
(the same KL to 3 digits on both fixtures of README "Quantized weights"), so it is not offered.

Numpy, not torch: the exporter (writing the weights file) and the quantized reference (a child
process, at the same time) must get bit-identical q, s and z from the same float32 weight, and
numpy's elementwise float32 arithmetic does not depend on thread counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tk.models.spec.manifest import METHODS, MIXED  # noqa: F401  (the names of what this module does)

QMAX = {"int4": 7, "int8": 127}
LEVELS = {"int4": 15, "int8": 255}  # the largest unsigned value, with zero points
COLUMNS = 2048  # columns quantized at a time: the search's temporaries stay a few MiB


@dataclass(frozen=True)
class Scheme:
    """How one weight is stored: its integer type, block, method and whether it has zero points."""

    bits: str = "int4"
    block: int = 32
    method: str = "rtn"
    zero_points: bool = False

    @property
    def onnx_type(self) -> str:
        """The stored integers' type: int4/int8 symmetric, uint4/uint8 with zero points."""
        return ("u" if self.zero_points else "") + self.bits


@dataclass
class QTensor:
    """q [K, N] (int8 holding the signed values, or uint8 the unsigned ones), scales [ceil(K/B), N]
    float32, zeros [ceil(K/B), N] uint8 or None (symmetric)."""

    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None = None


def blocks_of(k: int, block: int) -> int:
    return -(-k // block)


def quantize(w_t: np.ndarray, scheme: Scheme, importance: np.ndarray | None = None) -> QTensor:
    """w_t float32 [K, N] -> its QTensor under `scheme`; `importance` ([K], the input channels'
    mean squared activation on calibration text) weights the search's error."""
    k, n = w_t.shape
    nb, b = blocks_of(k, scheme.block), scheme.block
    w = np.zeros((nb * b, n), np.float32)  # a partial last block is padded with zeros, which every
    w[:k] = w_t  # scheme stores exactly (q = z), so they change no error and no fit
    imp = None
    if importance is not None:
        imp = np.zeros((nb * b, 1), np.float32)
        imp[:k, 0] = np.maximum(importance.astype(np.float32), 0) + np.float32(1e-12)
        imp = imp.reshape(nb, b, 1)
    q = np.empty((nb * b, n), np.uint8 if scheme.zero_points else np.int8)
    scales = np.empty((nb, n), np.float32)
    zeros = np.empty((nb, n), np.uint8) if scheme.zero_points else None
    for c in range(0, n, COLUMNS):
        x = w[:, c:c + COLUMNS].reshape(nb, b, -1)
        qc, s, z = _METHODS[scheme.method](x, scheme, imp)
        q[:, c:c + COLUMNS], scales[:, c:c + COLUMNS] = qc.reshape(nb * b, -1), s
        if zeros is not None:
            zeros[:, c:c + COLUMNS] = z
    return QTensor(q[:k], scales, zeros)


def dequantize(t: QTensor, block: int) -> np.ndarray:
    """QTensor -> float32 [K, N]: (q - z) * s, as DequantizeLinear computes it."""
    k, n = t.q.shape
    s = np.repeat(t.scales.astype(np.float32), block, axis=0)[:k]
    q = t.q.astype(np.float32)
    if t.zeros is not None:
        q = q - np.repeat(t.zeros.astype(np.float32), block, axis=0)[:k]
    return q * s


def _round(x: np.ndarray, inv: np.ndarray, z, lo: int, hi: int) -> np.ndarray:
    y = np.multiply(x, inv)  # one temporary, rounded, shifted and clipped in place
    np.rint(y, out=y)
    if not (isinstance(z, int) and z == 0):
        y += z
    return np.clip(y, lo, hi, out=y)


def _rtn(x: np.ndarray, scheme: Scheme, imp=None):
    """Round to nearest; x [nb, B, n] -> (q, s [nb, n], z [nb, n] or None)."""
    if not scheme.zero_points:
        qmax = QMAX[scheme.bits]
        s = np.abs(x).max(axis=1) / np.float32(qmax)
        s = np.where(s > 0, s, np.float32(1)).astype(np.float32)  # positive always
        return _round(x, (1 / s)[:, None], 0, -qmax - 1, qmax).astype(np.int8), s, None
    top = LEVELS[scheme.bits]
    lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
    s = ((hi - lo) / np.float32(top)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    z = np.clip(np.rint(-lo / s), 0, top)
    return _round(x, (1 / s)[:, None], z[:, None], 0, top).astype(np.uint8), s, z.astype(np.uint8)


def _weights(x: np.ndarray, imp) -> np.ndarray:
    """The search's per-element error weights (llama.cpp's k-quants: av|x| + |x|, or with an
    importance matrix imp * sqrt(sigma^2 + x^2))."""
    x2 = x * x
    if imp is None:
        return np.sqrt(x2.mean(axis=1, keepdims=True)) + np.abs(x)
    return imp * np.sqrt(2 * x2.mean(axis=1, keepdims=True) + x2)


def _search(x: np.ndarray, scheme: Scheme, imp=None, steps: int = 16, rmin: float = -1.0, rdelta: float = 0.1):
    """Weighted scale (and zero point) search: each candidate scale rounds the block, a weighted
    least-squares fit refines the scale to those integers, and the least weighted error wins."""
    wt = _weights(x, imp)
    q0, s0, z0 = _rtn(x, scheme)
    best_q, best_s, best_z = q0.astype(np.float32), s0, (z0.astype(np.float32) if z0 is not None else None)
    best_err = _error(x, wt, best_q, best_s, best_z)
    if scheme.zero_points:
        top = LEVELS[scheme.bits]
        lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
        span = hi - lo
        sw, sx = wt.sum(1), (wt * x).sum(1)
    else:
        qmax = QMAX[scheme.bits]
        amax = np.abs(x).max(axis=1)
    for i in range(steps + 1):
        if scheme.zero_points:
            s = span / np.float32(top + rmin + rdelta * i)
            s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
            z = np.clip(np.rint(-lo / s), 0, top)
            q = _round(x, (1 / s)[:, None], z[:, None], 0, top)
            # the weighted least-squares affine fit x ~ a q + c, its offset then put on the grid
            wq = wt * q
            sq, sqq, sqx = wq.sum(1), (wq * q).sum(1), (wq * x).sum(1)
            det = sw * sqq - sq * sq
            ok = det > 0
            a = np.where(ok, (sw * sqx - sx * sq) / np.where(ok, det, 1), s)
            c = np.where(ok, (sqq * sx - sq * sqx) / np.where(ok, det, 1), -z * s)
            a = np.where(a > 0, a, s).astype(np.float32)
            z = np.clip(np.rint(-c / a), 0, top)
            q = _round(x, (1 / a)[:, None], z[:, None], 0, top)
            d = q - z[:, None]
        else:
            s = amax / np.float32(qmax + 1 + rmin + rdelta * i)
            s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
            d = _round(x, (1 / s)[:, None], 0, -qmax - 1, qmax)
            z = None
        # the scale fit to these integers, and the integers again to that scale
        wd = wt * d
        num, den = (wd * x).sum(1), (wd * d).sum(1)
        a = np.where((den > 0) & (num > 0), num / np.where(den > 0, den, 1), s).astype(np.float32)
        if scheme.zero_points:
            q = _round(x, (1 / a)[:, None], z[:, None], 0, top)
        else:
            q = _round(x, (1 / a)[:, None], 0, -qmax - 1, qmax)
        err = _error(x, wt, q, a, z)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, a, best_s).astype(np.float32)
        best_q = np.where(better[:, None], q, best_q)
        if z is not None:
            best_z = np.where(better, z, best_z)
    if scheme.zero_points:
        return best_q.astype(np.uint8), best_s, best_z.astype(np.uint8)
    return best_q.astype(np.int8), best_s, None


def _error(x, wt, q, s, z) -> np.ndarray:
    d = q - z[:, None] if z is not None else q.copy()
    d *= s[:, None]
    d -= x
    np.square(d, out=d)
    d *= wt
    return d.sum(axis=1)


_METHODS = {"rtn": _rtn, "search": _search}


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Values in [-8, 7] (int8) or [0, 15] (uint8) -> ONNX INT4/UINT4 storage: two per byte, the
    first in the low nibble, packed over the flattened tensor (an odd count ends with a half-used byte)."""
    flat = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: np.ndarray, count: int, signed: bool = True) -> np.ndarray:
    """ONNX INT4 (sign-extended to int8) or UINT4 (uint8) storage -> `count` values."""
    nibbles = np.empty(packed.size * 2, dtype=np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & 0xF, packed >> 4
    if not signed:
        return nibbles[:count]
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




def sensitive_layers(num_layers: int) -> list[int]:
    """The layers whose value and down projections cost most when rounded: llama.cpp's Q4_K_M rule
    (`use_more_bits`), as onnxruntime-genai's `mixed_layers` writes it: the first and last eighth of
    the layers and every third one between."""
    n = num_layers
    return [i for i in range(n) if i < n / 8 or i >= 7 * n / 8 or (i - round(n / 8)) % 3 == 2]


def quant_plan(cfg, precision) -> dict[str, Scheme]:
    """Each weight a quantized export stores quantized (our names; `embed.weight` is an untied
    embedding, stored transposed like a linear layer's weight: a tied one is read from the LM
    head's table), with its scheme: the precision's, or int8 where `mixed` keeps it (the LM head
    and embedding for `lm-head`; also the fused QKV and down projections of `sensitive_layers`), the
    LM head and embedding in blocks of `head_block` when given."""
    base = Scheme(precision.weights, precision.block_size, precision.method, precision.zero_points)
    int8 = Scheme("int8", base.block, base.method, base.zero_points)
    names = quantized_layers(cfg, precision.quantized_lm_head)
    if precision.quantized_embedding and not cfg.tie_embeddings:
        names.append("embed.weight")
    plan = {name: base for name in names}
    upgrade = {"lm_head.weight", "embed.weight"} if precision.mixed in ("lm-head", "sensitive") else set()
    if precision.mixed == "sensitive":
        upgrade |= {f"layers.{i}.{w}" for i in sensitive_layers(cfg.num_layers)
                    for w in ("attn.wqkv.weight", "ffn.w_down.weight")}
    plan = {name: int8 if name in upgrade else s for name, s in plan.items()}
    for name in ("lm_head.weight", "embed.weight"):
        if name in plan and precision.head_block:
            plan[name] = Scheme(plan[name].bits, precision.head_block, base.method, base.zero_points)
    return plan
