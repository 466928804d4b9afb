"""Weight-only quantization: what tk stores for a quantized linear layer, and what it means.

A linear layer's weight, held as ONNX MatMul reads it (`w_t`, [K, N]: K inputs, N outputs), is
split along K into blocks of `block` rows (the last one partial when `block` does not divide K:
ONNX's blocked DequantizeLinear and ORT's MatMulNBits both take it). Each block of each column
gets a scale `s` and, with zero points, an integer zero point `z`; its values are integers `q`:
- symmetric (no zero point): q in [-2^(b-1), 2^(b-1) - 1], w ~= q * s, s > 0 (TensorRT's form);
- asymmetric (zero points): q and z in [0, 2^b - 1], w ~= (q - z) * s (both ONNX's
  DequantizeLinear and ORT's MatMulNBits take uint4/uint8 zero points).
What `DequantizeLinear(q, s[, z], axis=0, block_size=block)` computes, and what ONNX Runtime fuses
with the MatMul into MatMulNBits. A W8A8 weight (`int8_inputs`: `--mixed-precision lm-head-w8a8`) is
int8 with one scale a column (a block of all K rows) and 7 bits of it (q in [-64, 63], `W8A8_QMAX`),
and its input is rounded to int8 too, with one scale a row (`quantize_rows`): ONNX Runtime multiplies
it in integers (MatMulIntegerToFloat), exactly on every CPU (below).

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

Numpy and a compiled kernel, not torch: the exporter (writing the weights file) and the quantized
reference (a child process, at the same time) must get bit-identical q, s and z from the same
float32 weight, whatever their thread counts. The search runs in models/quant/kernel.py (numba,
no fast-math: the float32 operations numpy took, in numpy's order), a tile (a block or a few by up
to COLUMNS columns) at a time, on threads that take the next tile (the kernel releases the GIL):
each sum runs down one block's rows, as it always did, so neither the tiling nor the threads nor
the kernel change a bit (tests/test_quant_speed.py holds the numpy whole-tensor algorithm they
replaced, issue 37, and compares them).
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
# a W8A8 weight's largest integer: 7 bits. ONNX Runtime's integer GEMM takes its input as uint8 (around a
# zero point of 128) and, on an x86 CPU without VNNI or AMX (a Zen 3 EPYC), sums each pair of uint8 x int8
# products in 16 bits (vpmaddubsw), which saturate past 32,767: 2 x 255 x 64 fits, 2 x 255 x 127 does not
# (ONNX Runtime's reduce_range). So the one table is exact on every CPU; on the real 0.5B's head the 7 bits
# cost a KL to float32 of 1.69e-3 against 8 bits' 1.34e-3 (the input's int8 rounding is most of both; the
# int4 head's is 1.35e-2)
W8A8_QMAX = 63
LEVELS = {"int4": 15, "int8": 255}  # the largest unsigned value, with zero points
COLUMNS = 2048  # the most columns a tile spans; the whole-tensor algorithm's slices (see `_tiles`)
MAX_BLOCK = 256  # the largest block ONNX Runtime's MatMulNBits takes (models/spec/manifest.py BLOCK_SIZES)
STEPS, RMIN, RDELTA = 16, -1.0, 0.1  # the search's candidates: llama.cpp's make_qkx2_quants grid
# each candidate's denominator: the range (or max |w|) over it is the candidate scale, float32 as numpy made them
SEARCH_DENS = {t: np.array([np.float32((LEVELS[bits] if zp else QMAX[bits] + 1) + RMIN + RDELTA * j)
                            for j in range(STEPS + 1)], np.float32)
               for bits in ("int4", "int8") for zp in (True, False) for t in [("u" if zp else "") + bits]}


@dataclass(frozen=True)
class Scheme:
    """How one weight is stored: its integer type, block, method and whether it has zero points;
    `int8_inputs`: its input is quantized to int8 a row at a time (W8A8, `quantize_rows`)."""

    bits: str = "int4"
    block: int = 32
    method: str = "rtn"
    zero_points: bool = False
    int8_inputs: bool = False

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
    tiles of a block or a few by a few hundred columns (`_tiles`), each quantized by the compiled
    kernel (models/quant/kernel.py) in buffers that stay in the core's cache, on `threads` threads
    (`quant_threads()` by default; the kernel releases the GIL)."""
    from tk.models.quant.kernel import quantize_tile  # numba compiles it on first use (cached on disk)

    if scheme.block < 1 or (scheme.block > MAX_BLOCK and scheme.method == "search"):
        # the search sums a block in numpy's pairwise order, which the kernel writes out up to MAX_BLOCK rows
        raise ValueError(f"block {scheme.block}: the quantizer takes blocks of 1 to {MAX_BLOCK} rows "
                         "(round to nearest: any)")
    w_t = np.asarray(w_t, dtype=np.float32)  # any layout: the kernel copies each block into its own buffer
    k, n = w_t.shape
    nb, b = blocks_of(k, scheme.block), scheme.block
    imp = np.zeros(0, np.float32)
    if importance is not None:  # a partial last block's padding rows weigh nothing
        imp = np.zeros(nb * b, np.float32)
        imp[:k] = np.maximum(importance.astype(np.float32), 0) + np.float32(1e-12)
    q = np.empty((k, n), np.uint8 if scheme.zero_points else np.int8)
    scales = np.empty((nb, n), np.float32)
    zeros = np.empty((nb, n), np.uint8) if scheme.zero_points else np.empty((0, 0), np.uint8)
    qmax, top = W8A8_QMAX if scheme.int8_inputs else QMAX[scheme.bits], LEVELS[scheme.bits]
    search = scheme.method == "search"
    tiles = _tiles(nb, b, n)
    threads = max(1, min(threads or quant_threads(), len(tiles)))

    dens = SEARCH_DENS[scheme.onnx_type]

    def run(todo):
        for b0, b1, c0, c1 in todo:
            quantize_tile(w_t, imp, b0, b1, c0, c1, b, search, scheme.zero_points, qmax, top, dens, q, scales, zeros)

    if threads == 1:
        run(tiles)
    else:  # each thread takes the next tile until none is left
        todo = _Shared(tiles)
        with ThreadPoolExecutor(threads, thread_name_prefix="tk-quantize") as pool:
            for f in [pool.submit(run, todo) for _ in range(threads)]:
                f.result()
    return QTensor(q, scales, zeros if scheme.zero_points else None)


def quant_threads() -> int:
    """Threads `quantize` uses: OMP_NUM_THREADS when set (an export's reference child runs with 1,
    beside the writer), else every core."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


TILE = 8192  # elements a tile holds: the kernel's six float32 buffers of a block stay in the core's L2


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


def dequantize(t: QTensor, block: int, out: np.ndarray | None = None) -> np.ndarray:
    """QTensor -> float32 [K, N]: (q - z) * s, as DequantizeLinear computes it. With `out` (a float32
    [K, N] array or view, such as a [N, K] weight's transpose), written there a few columns at a
    time: the same values, without the whole-tensor temporaries (the export's reference dequantizes
    a large LM head beside the rest of the model), each piece copied whole (a ufunc writing through
    the transposed view strides and took twice as long)."""
    k, n = t.q.shape
    if out is None:
        out = np.empty((k, n), dtype=np.float32)
    for c0 in range(0, n, DEQUANT_COLUMNS):
        c = slice(c0, c0 + DEQUANT_COLUMNS)
        q = t.q[:, c].astype(np.float32)
        if t.zeros is not None:
            q -= np.repeat(t.zeros[:, c].astype(np.float32), block, axis=0)[:k]
        q *= np.repeat(t.scales[:, c].astype(np.float32), block, axis=0)[:k]
        out[:, c] = q
    return out


DEQUANT_COLUMNS = 256  # a piece of dequantize's work: K x 256 float32 temporaries
ROW_SCALE_FLOOR = 1e-30  # an all-zero row's scale (any positive one rounds it to zeros)


def quantize_rows(x):
    """A W8A8 weight's input (a torch tensor [..., K]) as its int8 rounding gives it back: one scale a
    row, max |x| / 127 (at least ROW_SCALE_FLOOR), x rounded to integers in [-127, 127] (half to even)
    times that scale. What the ONNX graph computes before MatMulIntegerToFloat (exporters/quantize_graph.py),
    op for op in float32, so the quantized reference rounds every row as the artifact does."""
    import torch

    scale = torch.clamp(x.abs().amax(-1, keepdim=True), min=ROW_SCALE_FLOOR) / 127
    return torch.round(x / scale) * scale


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
