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
numpy's elementwise float32 arithmetic does not depend on thread counts. The work goes in tiles
(a few blocks by up to COLUMNS columns) whose buffers stay in cache, on threads that take the
next tile (numpy releases the GIL in its loops): each sum runs down one block's rows, as it always
did, so neither the tiling nor the threads change a bit (tests/test_quant_speed.py holds the
whole-tensor algorithm they replaced, issue 37, and compares them).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from tk.models.spec.manifest import METHODS, MIXED  # noqa: F401  (the names of what this module does)

QMAX = {"int4": 7, "int8": 127}
LEVELS = {"int4": 15, "int8": 255}  # the largest unsigned value, with zero points
COLUMNS = 2048  # the most columns a tile spans; the whole-tensor algorithm's slices (see `_tiles`)


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


def quantize(w_t: np.ndarray, scheme: Scheme, importance: np.ndarray | None = None,
             threads: int | None = None) -> QTensor:
    """w_t float32 [K, N] -> its QTensor under `scheme`; `importance` ([K], the input channels'
    mean squared activation on calibration text) weights the search's error. The work goes in
    tiles of a few blocks by a few hundred columns (`_tiles`), each quantized by `_Tile` in
    buffers that stay in the core's cache, on `threads` threads (`quant_threads()` by default)."""
    k, n = w_t.shape
    nb, b = blocks_of(k, scheme.block), scheme.block
    imp = None
    if importance is not None:  # a partial last block's padding rows weigh nothing
        imp = np.zeros((nb * b, 1), np.float32)
        imp[:k, 0] = np.maximum(importance.astype(np.float32), 0) + np.float32(1e-12)
        imp = imp.reshape(nb, b, 1)
    q = np.empty((k, n), np.uint8 if scheme.zero_points else np.int8)
    scales = np.empty((nb, n), np.float32)
    zeros = np.empty((nb, n), np.uint8) if scheme.zero_points else None
    tiles = _tiles(nb, b, n)
    threads = max(1, min(threads or quant_threads(), len(tiles)))
    size = max([(b1 - b0) * b * (c1 - c0) for b0, b1, c0, c1 in tiles], default=0)
    run = lambda todo: _Tile(scheme, b, size).run(todo, w_t, imp, q, scales, zeros)
    if threads == 1:
        run(iter(tiles))
    else:  # numpy releases the GIL in its loops: each thread takes the next tile until none is left
        todo = _Shared(tiles)
        with ThreadPoolExecutor(threads, thread_name_prefix="tk-quantize") as pool:
            for f in [pool.submit(run, todo) for _ in range(threads)]:
                f.result()
    return QTensor(q, scales, zeros)


def quant_threads() -> int:
    """Threads `quantize` uses: OMP_NUM_THREADS when set (an export's reference child runs with 1,
    beside the writer), else every core."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


TILE = 65536  # elements a tile holds: its seven float32 buffers stay in the cache (L2, or L3)


def _tiles(nb: int, b: int, n: int) -> list[tuple[int, int, int, int]]:
    """(first block, end block, first column, end column) of each tile. Every sum the search takes
    runs down one block's rows, and numpy adds those rows one after another whenever a tile is two
    or more columns wide (pairwise, in another order, for a single column): so a tile is one column
    wide only where the whole-tensor algorithm's last slice of COLUMNS was (N % COLUMNS == 1)."""
    lone = n > 1 and n % COLUMNS == 1
    m = n - 1 if lone else n
    pieces = -(-m // max(4, min(COLUMNS, TILE // b))) if m else 0
    cuts = [m * i // pieces for i in range(pieces + 1)] if m else [0]  # as even as can be: none narrower than 2
    spans = list(pairwise(cuts)) + ([(m, n)] if lone else [])
    tiles = []
    for c0, c1 in spans:
        per = max(1, TILE // (b * (c1 - c0)))
        tiles += [(b0, min(nb, b0 + per), c0, c1) for b0 in range(0, nb, per)]
    return tiles


class _Shared:
    """An iterator several threads draw from."""

    def __init__(self, items):
        self._it, self._lock = iter(items), threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            return next(self._it)


def dequantize(t: QTensor, block: int) -> np.ndarray:
    """QTensor -> float32 [K, N]: (q - z) * s, as DequantizeLinear computes it."""
    k = t.q.shape[0]
    s = np.repeat(t.scales.astype(np.float32), block, axis=0)[:k]
    q = t.q.astype(np.float32)
    if t.zeros is not None:
        q = q - np.repeat(t.zeros.astype(np.float32), block, axis=0)[:k]
    return q * s


class _Tile:
    """One thread's buffers, and the quantizers on a tile x [blocks, B, columns] held in them.

    Bit for bit what the whole-tensor algorithm computed (tests/test_quant_speed.py keeps it): the
    same float32 operations on the same values in the same order (elementwise ones do not depend on
    the tile; each sum runs down one block's rows, as it did), written into buffers (`out=`) instead
    of new tensor-sized temporaries. Where it saves passes it does so exactly, on small integers:
    clip(r + z, 0, top) - z == clip(r, -z, top - z), so with zero points a candidate's integers
    less the zero point are rounded and clipped in one go; clip(y, lo, hi) is min(max(y, lo), hi)
    (against buffers of the bounds: numpy's max against a scalar is several times slower); and the
    winner's integers are rounded once at the end from its scale and zero point, as it rounded them."""

    def __init__(self, scheme: Scheme, block: int, size: int):
        self.scheme, self.block = scheme, block
        self._flat = np.empty((7 if scheme.method == "search" else 1, size), np.float32)  # x, wt, r, t, u, lo, hi

    def run(self, todo, w_t, imp, q, scales, zeros) -> None:
        k, b = w_t.shape[0], self.block
        for b0, b1, c0, c1 in todo:
            shape, r0, r1 = (b1 - b0, b, c1 - c0), b0 * b, min(k, b1 * b)
            x, *bufs = (f[:shape[0] * b * shape[2]].reshape(shape) for f in self._flat)
            x2d = x.reshape(-1, shape[2])
            x2d[:r1 - r0] = w_t[r0:r1, c0:c1]  # as float32
            x2d[r1 - r0:] = 0  # a partial last block is padded with zeros, which every scheme stores
            # exactly (q = z), so they change no error and no fit
            ti = None if imp is None else imp[b0:b1]
            if self.scheme.method == "rtn":
                qt, s, z = _rtn(x, self.scheme)
            else:
                qt, s, z = self.search(x, ti, *bufs)
            q[r0:r1, c0:c1] = qt.reshape(-1, shape[2])[:r1 - r0]
            scales[b0:b1, c0:c1] = s
            if zeros is not None:
                zeros[b0:b1, c0:c1] = z

    def search(self, x, imp, wt, r, t, u, lo_b, hi_b, steps: int = 16, rmin: float = -1.0,
               rdelta: float = 0.1):
        """Weighted scale (and zero point) search: each candidate scale rounds the block, a weighted
        least-squares fit refines the scale to those integers, and the least weighted error wins."""
        zp, bits = self.scheme.zero_points, self.scheme.bits
        _weights(x, imp, out=wt)
        q0, s0, z0 = _rtn(x, self.scheme)
        i = range(steps + 1)
        if zp:
            top = LEVELS[bits]
            lo_b.fill(0)
            hi_b.fill(top)
            best_z = z0.astype(np.float32)
            np.subtract(q0, best_z[:, None], out=r)  # q - z
            lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
            span = hi - lo
            sw = wt.sum(1)
            sx = np.multiply(wt, x, out=t).sum(1)
            # every step's candidate scale and zero point at once: [steps + 1, blocks, columns]
            den = np.array([np.float32(top + rmin + rdelta * j) for j in i], np.float32)
            s_all = span / den[:, None, None]
        else:
            qmax = QMAX[bits]
            lo_b.fill(-qmax - 1)
            hi_b.fill(qmax)
            r[...] = q0
            amax = np.abs(x).max(axis=1)
            den = np.array([np.float32(qmax + 1 + rmin + rdelta * j) for j in i], np.float32)
            s_all = amax / den[:, None, None]
        s_all = np.where(s_all > 0, s_all, np.float32(1))
        inv_all = 1 / s_all
        if zp:
            z_all = np.clip(np.rint(-lo / s_all), 0, top)
            nz_all = -z_all * s_all
        # each candidate's error, scale and zero point (the first is round-to-nearest's): the winner,
        # the first of least error, is picked at the end, as the running `err < best` kept it
        errs = np.empty((steps + 2,) + s0.shape, np.float32)
        cand_s = np.empty_like(errs)
        cand_s[0] = s0
        if zp:
            cand_z = np.empty_like(errs)
            cand_z[0] = best_z
        errs[0] = _error(x, wt, r, s0, t)
        for j in i:
            s, inv = s_all[j], inv_all[j][:, None]
            if zp:
                z = z_all[j]
                zc = z[:, None]
                # the integers q of this scale and zero point
                np.multiply(x, inv, out=r)
                np.rint(r, out=r)
                r += zc
                np.maximum(r, lo_b, out=r)
                np.minimum(r, hi_b, out=r)
                # the weighted least-squares affine fit x ~ a q + c, its offset then put on the grid
                wq = np.multiply(wt, r, out=u)
                sq = np.add.reduce(wq, 1)
                sqq = np.add.reduce(np.multiply(wq, r, out=t), 1)
                sqx = np.add.reduce(np.multiply(wq, x, out=t), 1)
                det = sw * sqq - sq * sq
                ok = det > 0
                det = np.where(ok, det, 1)
                a = np.where(ok, (sw * sqx - sx * sq) / det, s)
                c = np.where(ok, (sqq * sx - sq * sqx) / det, nz_all[j])
                a = np.where(a > 0, a, s)
                z = np.clip(np.rint(-c / a), 0, top)
                zc = z[:, None]
                lo_q, hi_q = -zc, top - zc
                _clip_round(x, (1 / a)[:, None], lo_q, hi_q, r)  # d = q - z
            else:
                z, lo_q, hi_q = None, lo_b, hi_b
                _clip_round(x, inv, lo_q, hi_q, r)  # d = q
            # the scale fit to these integers, and the integers again to that scale
            wd = np.multiply(wt, r, out=u)
            num = np.add.reduce(np.multiply(wd, x, out=t), 1)
            den = np.add.reduce(np.multiply(wd, r, out=t), 1)
            a = np.where((den > 0) & (num > 0), num / np.where(den > 0, den, 1), s)
            _clip_round(x, (1 / a)[:, None], lo_q, hi_q, r)  # q - z (or q)
            errs[j + 1] = _error(x, wt, r, a, t)
            cand_s[j + 1] = a
            if zp:
                cand_z[j + 1] = z
        pick = _first_least(errs)[None]
        best_s = np.take_along_axis(cand_s, pick, 0)[0]
        if zp:
            best_z = np.take_along_axis(cand_z, pick, 0)[0]
        # the winner's integers: rounded from its scale (and zero point), as its candidate rounded them
        np.multiply(x, (1 / best_s)[:, None], out=r)
        np.rint(r, out=r)
        if zp:
            r += best_z[:, None]
            np.maximum(r, lo_b, out=r)
            np.minimum(r, hi_b, out=r)
            return r.astype(np.uint8), best_s, best_z.astype(np.uint8)
        np.maximum(r, lo_b, out=r)
        np.minimum(r, hi_b, out=r)
        return r.astype(np.int8), best_s, None


def _first_least(errs: np.ndarray) -> np.ndarray:
    """The index of each column's first least error: the candidate that `err < best` (best the
    first's, then each better one's) keeps, a NaN never better (and a NaN first never bettered)."""
    nan = np.isnan(errs)
    if not nan.any():
        return np.argmin(errs, axis=0)
    return np.where(nan[0], 0, np.argmin(np.where(nan, np.inf, errs), axis=0))


def _clip_round(x, inv, lo, hi, out) -> None:
    """out = clip(rint(x * inv), lo, hi)."""
    np.multiply(x, inv, out=out)
    np.rint(out, out=out)
    np.maximum(out, lo, out=out)
    np.minimum(out, hi, out=out)


def _round(x: np.ndarray, inv: np.ndarray, z, lo, hi, out: np.ndarray | None = None) -> np.ndarray:
    y = np.multiply(x, inv, out=out)  # one buffer, rounded, shifted and clipped in place
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


def _weights(x: np.ndarray, imp, out: np.ndarray) -> np.ndarray:
    """The search's per-element error weights (llama.cpp's k-quants: av|x| + |x|, or with an
    importance matrix imp * sqrt(sigma^2 + x^2)), into `out`."""
    x2 = np.multiply(x, x, out=out)
    m = x2.mean(axis=1, keepdims=True)
    if imp is None:
        return np.add(np.sqrt(m), np.abs(x), out=out)
    np.add(2 * m, x2, out=out)
    np.sqrt(out, out=out)
    return np.multiply(imp, out, out=out)


def _error(x, wt, d, s, t) -> np.ndarray:
    """Each block's weighted squared error of d * s (d: the integers less the zero point) against x."""
    np.multiply(d, s[:, None], out=t)
    t -= x
    np.square(t, out=t)
    t *= wt
    return np.add.reduce(t, 1)  # what t.sum(axis=1) calls


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
