"""A W8A8 LM head (`--mixed-precision lm-head-w8a8`) in parity: its input is rounded to int8 a row at
a time (models/quant/quantize.py `quantize_rows`), so an element that the reference leaves within
float noise of a rounding boundary may round the other way in the backend. One such flip moves every
logit of its position by a row of the head times the row's scale: on the real Qwen2.5-0.5B, 0.0275
where the float bound allows 0.0122, though the artifact computes what it should.

Judging that fairly needs what the reference's rounding saw: the reference records its head's inputs
(`record_head_inputs`, kept in the Trace), and at a position over its bound `HeadRounding` asks
whether flips of the elements that sat within the input's own float bound of a boundary explain the
difference: a least-squares fit over those candidates' rows of the head (the nearest `MAX_CANDIDATES`),
rounded to whole flips, taken out of the backend's logits. The position is judged on what is left,
by the same bound and gates; a difference no flips explain (a wrong scale, a wrong weight, an input
a whole quantum off) still fails. (A rounding mode that differs only at exact halves, such elements
being on a boundary, would pass as flips.) The head's int8 weights and column scales are read from the artifact, and
only when some position needs them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from tk.models.quant.quantize import ROW_SCALE_FLOOR

MAX_CANDIDATES = 128  # elements nearest their boundary that may have flipped (a real flip sits far closer)


@contextlib.contextmanager
def record_head_inputs(runtime):
    """While open, the list of what a reference runtime's LM head took in before its int8 rounding,
    one (B, S, K) float32 array a call; an empty list for any other runtime (or head)."""
    seen: list[np.ndarray] = []
    head = getattr(getattr(runtime, "model", None), "lm_head", None)
    if not getattr(head, "int8_inputs", False):
        yield seen
        return
    hook = head.register_forward_pre_hook(lambda _, args: seen.append(args[0].float().cpu().numpy()), prepend=True)
    try:
        yield seen
    finally:
        hook.remove()


class HeadRounding:
    """The W8A8 head of an artifact: explains logit differences by flips of its input's rounding."""

    def __init__(self, artifact: Path | None, logits_scaling: float = 1.0,
                 weights: tuple[np.ndarray, np.ndarray] | None = None):
        """`weights` (int8 [K, V], float32 [V]) where known; else read from `artifact` when first needed."""
        self.artifact, self.logits_scaling, self._weights = artifact and Path(artifact), logits_scaling, weights

    @classmethod
    def of(cls, artifact: Path, manifest) -> "HeadRounding | None":
        """For an artifact whose head rounds its input, unless a softcap bends the logits after it."""
        config = manifest.config
        if manifest.precision.mixed != "lm-head-w8a8" or config.final_softcap is not None:
            return None
        return cls(artifact, config.logits_scaling)

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        """(int8 [K, V], float32 [V]): the decode graph's MatMulIntegerToFloat weight and column scales."""
        if self._weights is None:
            import onnx
            from onnx.numpy_helper import to_array

            graph = onnx.load(str(self.artifact / "decode.onnx"), load_external_data=False).graph
            node = next(n for n in graph.node if n.op_type == "MatMulIntegerToFloat")
            inits = {t.name: t for t in graph.initializer}
            q, scale = (to_array(inits[node.input[i]], str(self.artifact)) for i in (1, 3))
            self._weights = q, scale.reshape(-1).astype(np.float32)
        return self._weights

    def undo_flips(self, x: np.ndarray, delta: np.ndarray, noise: float) -> tuple[np.ndarray, int]:
        """One position: its head input `x` (K,) as the reference had it, the backend's logits minus the
        reference's `delta` (V,), and how far the backend's input may be from `x` (`noise`). -> (delta
        with the flips that best explain it taken out, how many)."""
        peak = max(float(np.abs(x).max()), ROW_SCALE_FLOOR)
        s = np.float32(peak) / np.float32(127)
        u = x.astype(np.float64) / float(s)
        gap = np.abs(u - np.floor(u) - 0.5) * float(s)  # distance to the nearest rounding boundary
        near = np.flatnonzero(gap <= noise)
        if near.size == 0:
            return delta, 0
        near = near[np.argsort(gap[near])[:MAX_CANDIDATES]]
        step = np.where(np.round(u[near]) > u[near], -1.0, 1.0)  # rounded up: a flip goes down
        q, scale = self.weights()
        rows = q[near].astype(np.float32) * scale  # (n, V): what one flip adds, per unit of the row's scale
        rows *= (step * float(s) / self.logits_scaling).astype(np.float32)[:, None]
        fit, *_ = np.linalg.lstsq(rows @ rows.T, rows @ delta.astype(np.float32), rcond=None)
        flips = np.clip(np.round(fit), 0, 1)
        if not flips.any():
            return delta, 0
        return delta - flips.astype(np.float32) @ rows, int(flips.sum())

    def explain(self, ref: np.ndarray, test: np.ndarray, inputs: np.ndarray, over: np.ndarray,
                noise: np.ndarray) -> tuple[np.ndarray, int]:
        """Positions (N, V) of reference and backend logits, the reference's head inputs (N, K), which
        positions are over their bound and each input's float bound -> (the backend's logits with the
        flips found taken out, how many flips)."""
        test, total = test.copy(), 0
        for p in np.flatnonzero(over):
            delta, n = self.undo_flips(inputs[p], (test[p] - ref[p]).astype(np.float32), float(noise[p]))
            if n:
                test[p], total = ref[p] + delta, total + n
        return test, total
