"""The tolerance table: what a model may differ by, per precision, and where each number comes from.

Bounds scale with the model: each tensor is judged relative to the reference's own magnitude, at
the depth it was computed, with float32's relative bound derived from the model's accumulation
length. The parity core (toolkit/verify/metrics.py) judges traces by a `Tolerance`; `tk parity`,
export validation and the probes all take theirs from `tolerance_for`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


# Unit roundoff (half the machine epsilon) of each activation dtype.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# A dot product of length K computed in floating point with unit roundoff u has relative error
# at most lambda * sqrt(K) * u with probability 1 - 2 exp(-lambda^2 / 2) when rounding errors are
# independent (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J.
# Sci. Comput. 2019). Each layer adds its own, so a tensor that went through d layers is held to d
# times that. Lambda 8: over the ~1e7 values a parity run compares, the chance that rounding
# alone breaks a bound is under 2e7 * exp(-32) = 3e-7. Measured, ORT vs torch fp32 (tk parity,
# 16 steps): the worst logit error is 0.11 of this bound on the tiny Llama family and 0.024 on the
# trained-like preset (max_abs 1.6e-4 at max_rel 5e-6, as on a real 135M, 30-layer Llama checkpoint,
# where the bound at a logit of 30 is 1.7e-2 against the 1.7e-4 measured).
LAMBDA = 8.0


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """What one model may differ by in one precision. A tensor that went through d layers passes
    when |diff| <= atol + rtol * d * scale, scale being max |reference| over the tensor (logits:
    over each position's vocabulary; present.{i} and hidden.{i} sit at depth i + 1, logits at
    `depth`, the layers plus the head). Token-level gates come on top, in every precision."""

    atol: float  # absolute floor, for values near zero
    rtol: float  # relative error allowed per layer of depth
    depth: int  # the logits' depth: num_layers + 1
    min_top1: float  # fraction of decided positions whose argmax must agree
    tie: float  # a position whose reference top-2 margin is under tie x its logit bound is a tie
    min_top5: float  # least mean overlap of the top-5 sets
    probe_noise: float  # a probe allows a backend this many times the reference's own result on it
    kl_cap: float  # KL(reference || backend) allowed at any position, whatever the bound

    def bound(self, scale, depth: int | None = None):
        """The largest |difference| allowed for a tensor of magnitude `scale` at `depth`."""
        return self.atol + self.rtol * (self.depth if depth is None else depth) * scale

    def max_kl(self, bound):
        """KL(p || softmax(log p + delta)) = Var_p(delta) / 2 + O(delta^3) <= bound^2 / 2 when every
        |delta| <= bound: the KL a position may reach if its logits are within their bound (the
        1% covers the third-order term), capped by `kl_cap`."""
        return np.minimum(0.5 * np.square(bound) * 1.01 + 1e-12, self.kl_cap)


# Per precision: (atol, rtol per layer, min_top1, tie, min_top5, kl_cap). float32's rtol is
# derived from the arithmetic (LAMBDA * u * sqrt(K), K the model's longest accumulation); fp16
# and bf16 round every activation to their own precision, so a layer's relative error is a few
# units of their roundoff whatever K is.
_TABLE = {
    # atol 1e-5: torch.testing's float32 default. A flip needs both logits off by their bound: tie 2.
    # A 5th/6th near-tie may swap at one position: top-5 0.8. KL is bounded by the logits' bound.
    "float32": (1e-5, None, 1.0, 2.0, 0.8, 1e-4),
    # ORT's llama_parity.py bounds fp16 logits at 0.5. Measured (tk parity, 16 steps): tiny Llama
    # 0.022 (0.17 of the bound), trained-like preset 0.30 (0.19 of it, KL 2.7e-3); the real 135M
    # checkpoint 0.085, where the bound is 0.1 + 4u * 31 * 30 = 1.9. Ties under a tenth of the
    # bound (PyTorch's own fp16 cache/no-cache gap is 0.0195, transformers #25420).
    "float16": (0.1, 4 * UNIT_ROUNDOFF["float16"], 0.95, 0.1, 0.6, 0.02),
    # bf16: 8 bits of mantissa; PyTorch's own cache/no-cache gap is 0.125 (transformers #25420).
    "bfloat16": (0.5, 4 * UNIT_ROUNDOFF["bfloat16"], 0.9, 0.25, 0.6, 0.1),
}
# ORT's cache-vs-recompute gap on the real 135M checkpoint is 1.4x PyTorch's (1.18e-4 vs 8.2e-5).
PROBE_NOISE = 4.0


def accumulation_length(config) -> int:
    """The longest dot product of a layer (of a DecoderConfig): the hidden size (projections, norms,
    the head) or the FFN's inner size (down projection)."""
    return max(config.hidden_size, config.intermediate_size)


def tolerance_for(dtype: str, config, **overrides) -> Tolerance:
    """The tolerance for a model (a DecoderConfig) in `dtype`; overrides replace fields."""
    num_layers = config.num_layers
    atol, rtol, min_top1, tie, min_top5, kl_cap = _TABLE[dtype]
    if rtol is None:
        rtol = LAMBDA * UNIT_ROUNDOFF[dtype] * accumulation_length(config) ** 0.5
    tol = Tolerance(atol=atol, rtol=rtol, depth=num_layers + 1, min_top1=min_top1, tie=tie, min_top5=min_top5,
                    probe_noise=PROBE_NOISE, kl_cap=kl_cap)
    return replace(tol, **{k: v for k, v in overrides.items() if v is not None})
