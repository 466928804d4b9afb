"""The quantizer's inner loop, compiled (numba): round-to-nearest and the weighted scale search of
models/quant/quantize.py on one tile of a weight, every candidate of a block done while its rows
are in the core's cache, vectorized across columns.

numpy took some thirty passes over a tile per candidate scale, each a separate call; here a block's
rows are read once per pass and the candidates' small arithmetic costs nothing extra (issue 37: the
search ran 2.2x `llama-quantize`'s Q4_K_M time in numpy). Bit for bit what the numpy algorithm
computed (tests/test_quant_speed.py keeps it and compares): the same float32 operations in the same
order, every constant a float32 (a Python number would widen the arithmetic to float64), each
column's sum down a block's rows one row after another, as numpy adds rows, or, for a tile one
column wide, in numpy's pairwise order (it sums a contiguous run that way); no fast-math, so no
operation is fused or reordered. NaN weights are not quantized to any specification.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F0, F1 = np.float32(0), np.float32(1)


def ready() -> None:
    """Load numba's typing declarations now, on the caller's thread. The exporter quantizes on a thread
    beside torch.export's trace, which swaps math functions for lambdas of its own while it traces
    (torch._export.non_strict_utils); numba's first compile or cache load in a process reads the math
    module and fails on them (AttributeError). Once loaded, they are not read again."""
    from numba.core.registry import cpu_target

    cpu_target.typing_context.refresh()


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _clip(v, lo, hi):
    """min(max(v, lo), hi), as numpy's maximum then minimum (a NaN v stays NaN)."""
    v = lo if v < lo else v
    return hi if v > hi else v


@njit(nogil=True, cache=True, error_model="numpy")
def _pairwise8(p, c, start, n):
    """numpy's pairwise sum of p[start:start + n, c], n <= 128: eight accumulators."""
    if n < 8:
        res = np.float32(0)
        for i in range(start, start + n):
            res += p[i, c]
        return res
    if n <= 128:
        r0, r1, r2, r3 = p[start, c], p[start + 1, c], p[start + 2, c], p[start + 3, c]
        r4, r5, r6, r7 = p[start + 4, c], p[start + 5, c], p[start + 6, c], p[start + 7, c]
        i = 8
        while i < n - n % 8:
            r0 += p[start + i, c]
            r1 += p[start + i + 1, c]
            r2 += p[start + i + 2, c]
            r3 += p[start + i + 3, c]
            r4 += p[start + i + 4, c]
            r5 += p[start + i + 5, c]
            r6 += p[start + i + 6, c]
            r7 += p[start + i + 7, c]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += p[start + i, c]
            i += 1
        return res
    raise ValueError("a run of more than 128 rows is summed in halves")


@njit(nogil=True, cache=True, error_model="numpy")
def _pairwise(p, c, start, n):
    """numpy's pairwise sum of p[start:start + n, c], n <= 256 (beyond 128 rows numpy sums two halves;
    written out, not recursive: numba's on-disk cache does not hold a recursive function)."""
    if n <= 128:
        return _pairwise8(p, c, start, n)
    half = n // 2
    half -= half % 8
    return _pairwise8(p, c, start, half) + _pairwise8(p, c, start + half, n - half)


@njit(nogil=True, cache=True, error_model="numpy")
def _colsum(p, out, pairwise):
    """out[c] = the sum of column c of p [rows, C], in numpy's order for a tile that wide."""
    rows, cols = p.shape
    if pairwise:
        for c in range(cols):
            out[c] = _pairwise(p, c, 0, rows)
        return
    for c in range(cols):
        out[c] = p[0, c]
    for i in range(1, rows):
        for c in range(cols):
            out[c] += p[i, c]


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_tile(w, imp, b0, b1, c0, c1, block, search, zero_points, qmax, top, dens, q, scales, zeros):
    """Quantize blocks b0..b1 of columns c0..c1 of w [K, N] (float32, any layout) into q, scales and
    zeros. imp: [blocks * block] row weights (zero-length for none; padding rows weigh 0).
    Symmetric: q in [-qmax - 1, qmax]; with zero points q and z in [0, top]. dens: the search's
    candidate denominators (float32); search False: round to nearest only."""
    k = w.shape[0]
    cols = c1 - c0
    pairwise = cols == 1
    b = block
    tiles = np.empty((6, b, cols), np.float32)  # a block's values, error weights, integers and products
    x, wt, d, pa, pb, pc = tiles[0], tiles[1], tiles[2], tiles[3], tiles[4], tiles[5]
    percol = np.empty((23, cols), np.float32)  # one value a column each
    lo, hi, span, s0, z0, m = percol[0], percol[1], percol[2], percol[3], percol[4], percol[5]
    sa, sb, sc, sw, sx, err = percol[6], percol[7], percol[8], percol[9], percol[10], percol[11]
    best_e, best_s, best_z, sj, zj, nzj = percol[12], percol[13], percol[14], percol[15], percol[16], percol[17]
    za, lq, hq, a = percol[18], percol[19], percol[20], percol[21]
    inv = percol[22]  # 1 / a scale, once a column (numpy's `(1 / s)[:, None]`): no division a weight
    has_imp = imp.shape[0] > 0
    fb, ftop, fqmax = np.float32(b), np.float32(top), np.float32(qmax)
    qlo, qhi = (F0, ftop) if zero_points else (np.float32(-qmax - 1), fqmax)
    for blk in range(b0, b1):
        r0 = blk * b
        rows = min(k, r0 + b) - r0
        for i in range(rows):
            for c in range(cols):
                x[i, c] = w[r0 + i, c0 + c]
        for i in range(rows, b):  # a partial last block is padded with zeros, as numpy's tile was
            for c in range(cols):
                x[i, c] = F0
        # round to nearest: the range's scale (and zero point)
        for c in range(cols):
            lo[c] = x[0, c]
            hi[c] = x[0, c] if zero_points else abs(x[0, c])
        for i in range(1, b):
            if zero_points:
                for c in range(cols):
                    v = x[i, c]
                    lo[c] = v if v < lo[c] else lo[c]
                    hi[c] = v if v > hi[c] else hi[c]
            else:
                for c in range(cols):
                    av = abs(x[i, c])
                    hi[c] = av if av > hi[c] else hi[c]
        for c in range(cols):
            if zero_points:
                lo[c] = lo[c] if lo[c] < F0 else F0
                hi[c] = hi[c] if hi[c] > F0 else F0
                s = (hi[c] - lo[c]) / ftop
            else:
                s = hi[c] / fqmax
            s = s if s > F0 else F1
            s0[c] = s
            if zero_points:
                z0[c] = _clip(np.rint(-lo[c] / s), F0, ftop)
            else:
                z0[c] = F0
        if not search:
            _store(x, s0, z0, inv, rows, r0, c0, blk, qlo, qhi, zero_points, q, scales, zeros)
            continue
        # the error weights: av|x| + |x| (llama.cpp's k-quants), or imp * sqrt(2 av(x^2) + x^2)
        for i in range(b):
            for c in range(cols):
                pa[i, c] = x[i, c] * x[i, c]
        _colsum(pa, m, pairwise)
        for c in range(cols):
            m[c] = m[c] / fb
        for i in range(b):
            if has_imp:
                iw = imp[r0 + i]
                for c in range(cols):
                    wt[i, c] = iw * np.sqrt(np.float32(2) * m[c] + pa[i, c])
            else:
                for c in range(cols):
                    wt[i, c] = np.sqrt(m[c]) + abs(x[i, c])
        # round to nearest is the first candidate
        _recip(s0, inv)
        for i in range(b):
            for c in range(cols):
                d[i, c] = _clip(np.rint(x[i, c] * inv[c]) + z0[c], qlo, qhi) - z0[c]
        _error(x, wt, d, s0, pa, best_e, pairwise)
        for c in range(cols):
            best_s[c], best_z[c] = s0[c], z0[c]
            span[c] = hi[c] - lo[c] if zero_points else hi[c]
        if zero_points:
            _colsum(wt, sw, pairwise)
            for i in range(b):
                for c in range(cols):
                    pa[i, c] = wt[i, c] * x[i, c]
            _colsum(pa, sx, pairwise)
        for j in range(dens.shape[0]):
            den = dens[j]
            for c in range(cols):
                s = span[c] / den
                s = s if s > F0 else F1
                sj[c] = s
                if zero_points:
                    z = _clip(np.rint(-lo[c] / s), F0, ftop)
                    zj[c] = z
                    nzj[c] = -z * s
            if zero_points:
                # the integers of this scale and zero point, and the weighted least-squares fit
                # x ~ a q + c, its offset then put on the grid
                _recip(sj, inv)
                for i in range(b):
                    for c in range(cols):
                        v = _clip(np.rint(x[i, c] * inv[c]) + zj[c], F0, ftop)
                        wq = wt[i, c] * v
                        pa[i, c] = wq
                        pb[i, c] = wq * v
                        pc[i, c] = wq * x[i, c]
                _colsum(pa, sa, pairwise)
                _colsum(pb, sb, pairwise)
                _colsum(pc, sc, pairwise)
                for c in range(cols):
                    det = sw[c] * sb[c] - sa[c] * sa[c]
                    ok = det > F0
                    det = det if ok else F1
                    av = (sw[c] * sc[c] - sx[c] * sa[c]) / det
                    cv = (sb[c] * sx[c] - sa[c] * sc[c]) / det
                    av = av if ok else sj[c]
                    cv = cv if ok else nzj[c]
                    av = av if av > F0 else sj[c]
                    z = _clip(np.rint(-cv / av), F0, ftop)
                    za[c], lq[c], hq[c], a[c] = z, -z, ftop - z, av
                _clip_round(x, a, inv, lq, hq, d)  # d = q - z
            else:
                for c in range(cols):
                    za[c], lq[c], hq[c], a[c] = F0, qlo, qhi, sj[c]
                _clip_round(x, a, inv, lq, hq, d)
            # the scale fit to these integers, and the integers again to that scale
            for i in range(b):
                for c in range(cols):
                    wd = wt[i, c] * d[i, c]
                    pa[i, c] = wd * x[i, c]
                    pb[i, c] = wd * d[i, c]
            _colsum(pa, sa, pairwise)
            _colsum(pb, sb, pairwise)
            for c in range(cols):
                num, dd = sa[c], sb[c]
                a[c] = num / (dd if dd > F0 else F1) if (dd > F0) and (num > F0) else sj[c]
            _clip_round(x, a, inv, lq, hq, d)
            _error(x, wt, d, a, pa, err, pairwise)
            for c in range(cols):
                # the first of least error: `err < best`, a NaN never better, a NaN first never bettered
                if err[c] < best_e[c] and best_e[c] == best_e[c]:
                    best_e[c], best_s[c], best_z[c] = err[c], a[c], za[c]
        _store(x, best_s, best_z, inv, rows, r0, c0, blk, qlo, qhi, zero_points, q, scales, zeros)


@njit(nogil=True, cache=True, error_model="numpy")
def _clip_round(x, a, inv, lo, hi, out):
    """out = clip(rint(x * (1 / a)), lo, hi), per column (inv: a buffer for 1 / a)."""
    b, cols = x.shape
    _recip(a, inv)
    for i in range(b):
        for c in range(cols):
            out[i, c] = _clip(np.rint(x[i, c] * inv[c]), lo[c], hi[c])


@njit(nogil=True, cache=True, error_model="numpy")
def _recip(s, inv):
    """inv = 1 / s, in float32."""
    for c in range(s.shape[0]):
        inv[c] = F1 / s[c]


@njit(nogil=True, cache=True, error_model="numpy")
def _error(x, wt, d, s, t, out, pairwise):
    """Each column's weighted squared error of d * s against x, into out."""
    b, cols = x.shape
    for i in range(b):
        for c in range(cols):
            e = d[i, c] * s[c] - x[i, c]
            t[i, c] = e * e * wt[i, c]
    _colsum(t, out, pairwise)


@njit(nogil=True, cache=True, error_model="numpy")
def _store(x, s, z, inv, rows, r0, c0, blk, qlo, qhi, zero_points, q, scales, zeros):
    """The winner's integers, rounded from its scale (and zero point), its scale and zero point."""
    cols = x.shape[1]
    _recip(s, inv)
    for i in range(rows):
        for c in range(cols):
            q[r0 + i, c0 + c] = _clip(np.rint(x[i, c] * inv[c]) + z[c], qlo, qhi)
    for c in range(cols):
        scales[blk, c0 + c] = s[c]
        if zero_points:
            zeros[blk, c0 + c] = z[c]
