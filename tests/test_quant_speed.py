"""The quantizer's tiled, threaded, compiled search (models/quant/quantize.py, models/quant/kernel.py)
against a verbatim copy of the numpy whole-tensor algorithm it replaced (`reference_quantize` below,
kept as the specification): the same q, scales and zero points, bit for bit, on odd shapes, partial
last blocks, zero blocks and columns, outlier channels, importance weights, int4 and int8, with and
without zero points, blocks of 16 to 256 (a lone column's sums pairwise, as numpy's), any input
layout, one thread or many."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tk.models.quant import quantize as qmod
from tk.models.quant.quantize import QTensor, Scheme, quantize

# ---- the reference: models/quant/quantize.py's algorithm before issue 37, copied verbatim ----------

_QMAX = {"int4": 7, "int8": 127}
_LEVELS = {"int4": 15, "int8": 255}
_COLUMNS = 2048


def reference_quantize(w_t: np.ndarray, scheme: Scheme, importance: np.ndarray | None = None) -> QTensor:
    k, n = w_t.shape
    nb, b = -(-k // scheme.block), scheme.block
    w = np.zeros((nb * b, n), np.float32)
    w[:k] = w_t
    imp = None
    if importance is not None:
        imp = np.zeros((nb * b, 1), np.float32)
        imp[:k, 0] = np.maximum(importance.astype(np.float32), 0) + np.float32(1e-12)
        imp = imp.reshape(nb, b, 1)
    q = np.empty((nb * b, n), np.uint8 if scheme.zero_points else np.int8)
    scales = np.empty((nb, n), np.float32)
    zeros = np.empty((nb, n), np.uint8) if scheme.zero_points else None
    for c in range(0, n, _COLUMNS):
        x = w[:, c:c + _COLUMNS].reshape(nb, b, -1)
        qc, s, z = {"rtn": _ref_rtn, "search": _ref_search}[scheme.method](x, scheme, imp)
        q[:, c:c + _COLUMNS], scales[:, c:c + _COLUMNS] = qc.reshape(nb * b, -1), s
        if zeros is not None:
            zeros[:, c:c + _COLUMNS] = z
    return QTensor(q[:k], scales, zeros)


def _ref_round(x, inv, z, lo, hi):
    y = np.multiply(x, inv)
    np.rint(y, out=y)
    if not (isinstance(z, int) and z == 0):
        y += z
    return np.clip(y, lo, hi, out=y)


def _ref_rtn(x, scheme, imp=None):
    if not scheme.zero_points:
        qmax = _QMAX[scheme.bits]
        s = np.abs(x).max(axis=1) / np.float32(qmax)
        s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
        return _ref_round(x, (1 / s)[:, None], 0, -qmax - 1, qmax).astype(np.int8), s, None
    top = _LEVELS[scheme.bits]
    lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
    s = ((hi - lo) / np.float32(top)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    z = np.clip(np.rint(-lo / s), 0, top)
    return _ref_round(x, (1 / s)[:, None], z[:, None], 0, top).astype(np.uint8), s, z.astype(np.uint8)


def _ref_weights(x, imp):
    x2 = x * x
    if imp is None:
        return np.sqrt(x2.mean(axis=1, keepdims=True)) + np.abs(x)
    return imp * np.sqrt(2 * x2.mean(axis=1, keepdims=True) + x2)


def _ref_search(x, scheme, imp=None, steps=16, rmin=-1.0, rdelta=0.1):
    wt = _ref_weights(x, imp)
    q0, s0, z0 = _ref_rtn(x, scheme)
    best_q, best_s, best_z = q0.astype(np.float32), s0, (z0.astype(np.float32) if z0 is not None else None)
    best_err = _ref_error(x, wt, best_q, best_s, best_z)
    if scheme.zero_points:
        top = _LEVELS[scheme.bits]
        lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
        span = hi - lo
        sw, sx = wt.sum(1), (wt * x).sum(1)
    else:
        qmax = _QMAX[scheme.bits]
        amax = np.abs(x).max(axis=1)
    for i in range(steps + 1):
        if scheme.zero_points:
            s = span / np.float32(top + rmin + rdelta * i)
            s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
            z = np.clip(np.rint(-lo / s), 0, top)
            q = _ref_round(x, (1 / s)[:, None], z[:, None], 0, top)
            wq = wt * q
            sq, sqq, sqx = wq.sum(1), (wq * q).sum(1), (wq * x).sum(1)
            det = sw * sqq - sq * sq
            ok = det > 0
            a = np.where(ok, (sw * sqx - sx * sq) / np.where(ok, det, 1), s)
            c = np.where(ok, (sqq * sx - sq * sqx) / np.where(ok, det, 1), -z * s)
            a = np.where(a > 0, a, s).astype(np.float32)
            z = np.clip(np.rint(-c / a), 0, top)
            q = _ref_round(x, (1 / a)[:, None], z[:, None], 0, top)
            d = q - z[:, None]
        else:
            s = amax / np.float32(qmax + 1 + rmin + rdelta * i)
            s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
            d = _ref_round(x, (1 / s)[:, None], 0, -qmax - 1, qmax)
            z = None
        wd = wt * d
        num, den = (wd * x).sum(1), (wd * d).sum(1)
        a = np.where((den > 0) & (num > 0), num / np.where(den > 0, den, 1), s).astype(np.float32)
        if scheme.zero_points:
            q = _ref_round(x, (1 / a)[:, None], z[:, None], 0, top)
        else:
            q = _ref_round(x, (1 / a)[:, None], 0, -qmax - 1, qmax)
        err = _ref_error(x, wt, q, a, z)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, a, best_s).astype(np.float32)
        best_q = np.where(better[:, None], q, best_q)
        if z is not None:
            best_z = np.where(better, z, best_z)
    if scheme.zero_points:
        return best_q.astype(np.uint8), best_s, best_z.astype(np.uint8)
    return best_q.astype(np.int8), best_s, None


def _ref_error(x, wt, q, s, z):
    d = q - z[:, None] if z is not None else q.copy()
    d *= s[:, None]
    d -= x
    np.square(d, out=d)
    d *= wt
    return d.sum(axis=1)

# ---- end of the reference --------------------------------------------------------------------------


def _weight(k, n, seed, kind="heavy"):
    rng = np.random.default_rng(seed)
    if kind == "heavy":  # heavy tails and a few outlier input channels, as trained weights have
        w = rng.standard_t(3, (k, n)).astype(np.float32) * 0.02
        w[rng.integers(0, k, 3)] *= 8
    elif kind == "normal":  # plus outlier output columns
        w = rng.normal(0, 0.02, (k, n)).astype(np.float32)
        w[:, rng.integers(0, n, 2)] *= 10
    else:  # wide dynamic range: tiny, huge and exactly repeated values
        w = (rng.normal(size=(k, n)) * 10.0 ** rng.integers(-6, 3, (k, n))).astype(np.float32)
        w[rng.random((k, n)) < 0.05] = 0.01
    w[rng.random((k, n)) < 0.02] = 0.0  # scattered exact zeros
    if k > 40:
        w[8:40] = 0.0  # a whole zero block (blocks of 16 or 32)
    if n > 3:
        w[:, 1] = 0.0  # a zero column
        w[:, 2] = w[0, 2]  # a constant column
    return w


def _same(a: QTensor, b: QTensor):
    assert a.q.dtype == b.q.dtype and a.q.shape == b.q.shape
    np.testing.assert_array_equal(a.q, b.q)
    assert a.scales.dtype == b.scales.dtype and np.array_equal(a.scales, b.scales)
    assert (a.zeros is None) == (b.zeros is None)
    if a.zeros is not None:
        assert a.zeros.dtype == b.zeros.dtype and np.array_equal(a.zeros, b.zeros)


SCHEMES = [Scheme(bits, block, method, zp) for bits in ("int4", "int8") for method in ("search", "rtn")
           for zp in (True, False) for block in (32, 16)]
# numpy sums a lone column pairwise: eight accumulators up to 128 rows, two halves beyond
SCHEMES += [Scheme("int4", block, "search", zp) for block in (128, 256) for zp in (True, False)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.bits}-{s.block}-{s.method}-{'zp' if s.zero_points else 'sym'}")
@pytest.mark.parametrize("shape", [(64, 48), (50, 24), (33, 7), (7, 5), (96, 1), (100, 3), (160, 300), (1, 9),
                                   (40, 2049), (64, 2050)])
def test_bit_identical_to_the_whole_tensor_algorithm(scheme, shape):
    """Partial last blocks, one column, N % 2048 == 1 (the reference's last slice one column wide:
    its sums pairwise), N % 2048 == 2, zero blocks and columns, three kinds of weight each."""
    k, n = shape
    for seed, kind in ((0, "heavy"), (1, "normal"), (2, "wide")):
        w = _weight(k, n, seed, kind)
        _same(quantize(w, scheme, threads=2), reference_quantize(w, scheme))


@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_bit_identical_with_importance(bits, zero_points):
    scheme = Scheme(bits, 32, "search", zero_points)
    rng = np.random.default_rng(5)
    for k, n in ((128, 96), (70, 33), (96, 1)):
        w = _weight(k, n, 7)
        imp = rng.uniform(0.5, 1.5, k).astype(np.float32)
        imp[rng.choice(k, 3, replace=False)] *= 400
        imp[0] = 0.0
        imp[1] = -1.0  # clipped to 0 (and 1e-12), as before
        _same(quantize(w, scheme, imp), reference_quantize(w, scheme, imp))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_and_tiles_change_nothing(threads, monkeypatch):
    w = _weight(256, 700, 3)
    scheme = Scheme("int4", 32, "search", True)
    want = reference_quantize(w, scheme)
    for tile in (512, 4096, qmod.TILE, 1 << 20):
        monkeypatch.setattr(qmod, "TILE", tile)
        _same(quantize(w, scheme, threads=threads), want)


def test_other_input_dtypes_are_read_as_float32():
    w = _weight(64, 40, 4).astype(np.float64) * (1 + 1e-9)
    for scheme in (Scheme("int4", 32, "search", True), Scheme("int8", 32, "rtn", False)):
        _same(quantize(w, scheme), reference_quantize(w, scheme))
        _same(quantize(w.astype(np.float16), scheme), reference_quantize(w.astype(np.float16), scheme))


def test_tiles_cover_every_block_and_column_once():
    for nb, b, n in ((1, 32, 1), (3, 32, 2049), (176, 32, 2048), (64, 128, 32000), (5, 16, 4097)):
        seen = np.zeros((nb, n), int)
        for b0, b1, c0, c1 in qmod._tiles(nb, b, n):
            seen[b0:b1, c0:c1] += 1
            assert c1 - c0 >= 2 or n % qmod.COLUMNS == 1  # a lone column only where it was one
        assert (seen == 1).all()


@pytest.mark.parametrize("zero_points", [True, False])
def test_bit_identical_on_a_real_sized_matrix(zero_points):
    """Default tiles, two threads: several tiles of COLUMNS columns and a narrower last one, many blocks."""
    w = _weight(512, 4100, 11, "normal")
    scheme = Scheme("int4", 32, "search", zero_points)
    imp = np.random.default_rng(12).uniform(0.5, 2.0, 512).astype(np.float32)
    _same(quantize(w, scheme, threads=2), reference_quantize(w, scheme))
    _same(quantize(w, scheme, imp, threads=2), reference_quantize(w, scheme, imp))


def test_blocks_beyond_what_matmulnbits_takes_are_refused():
    with pytest.raises(ValueError, match="blocks of 1 to 256 rows"):
        quantize(np.zeros((512, 4), np.float32), Scheme("int4", 512, "search", True))


def test_any_layout_is_read_as_it_is():
    """The quantized reference hands over a transposed view (`weight.T`): no copy, the same result."""
    w = _weight(96, 70, 8)
    scheme = Scheme("int4", 32, "search", True)
    want = reference_quantize(w, scheme)
    _same(quantize(np.asfortranarray(w), scheme), want)
    strided = np.zeros((96, 140), np.float32)
    strided[:, ::2] = w
    _same(quantize(strided[:, ::2], scheme, threads=2), want)


def test_the_kernel_compiles_while_torch_export_has_math_patched_once_ready_ran():
    """The weights writer quantizes on a thread beside torch.export's trace, which swaps math functions
    for lambdas of its own while it traces (torch._export.non_strict_utils); numba's first compile or
    cache load in a process reads the math module and failed on them (AttributeError, `tk export
    --weights int4 --symmetric` on a real checkpoint). `ready()`, run before the trace, loads it first."""
    code = textwrap.dedent("""
        import math, sys
        import numpy as np
        from tk.models.quant import kernel
        if sys.argv[1] == "ready":
            kernel.ready()
        math.pow = lambda x, y: x ** y  # what the trace does to math while it runs
        from tk.models.quant.quantize import Scheme, quantize
        quantize(np.ones((32, 8), np.float32), Scheme(bits="int4", block=32, zero_points=False), threads=1)
        print("ok")
    """)
    run = lambda arg: subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=300)
    done = run("ready")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    failed = run("not")
    assert failed.returncode != 0 and "AttributeError" in failed.stderr  # what ready() prevents
