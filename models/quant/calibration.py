"""What `tk export --calibration FILE` measured, and what it changes in the weights.

Two uses of the same statistics, each input channel's mean squared activation on the user's text
(toolkit/pipeline/calibrate.py collects them; this module keeps their file):

- importance: the scale search (models/quant/quantize.py) weighs each channel's rounding error by it
  (llama.cpp's importance matrix);
- activation-aware channel scales (AWQ, Lin et al. 2024): a weight's input channels are multiplied by
  s before it is quantized and its input divided by s, which is folded, exactly, into the op that
  makes that input: the pre-norm's scale for the fused QKV and gate/up projections, the value rows
  of the QKV projection for the output projection (one scale per value channel, shared by the
  query heads of its group), the up rows of the gate/up projection for the down projection. The
  channels that carry large activations get more of their block's grid. s = m^alpha / sqrt(max m^alpha
  * min m^alpha) for m the channels' RMS activation, alpha on a grid of 20 from 0 (no scaling):
  the one with the least importance-weighted error of round-to-nearest wins (AutoAWQ's search,
  with llama.cpp's diagonal error in place of sampled outputs), and is kept only if the weight's
  own method (the scale search) also has less error with it than without. The float model
  computes the same function; the artifact's graphs store the scaled norms and weights.

Not scaled: the LM head (tied to the embedding in most checkpoints), a post-norm model's QKV and
gate/up (no norm on their input: OLMo 2), a mixture of experts' gate/up (the router and every expert
read the one norm). Both the export's weights writer and the quantized reference apply the scales
with `Calibration.apply_`, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pathlib import Path

import numpy as np
import torch

ALPHAS = np.arange(20) / 20
FLOOR = 1e-2  # a channel's magnitude counts as at least this share of the largest: the scales span <= 10x
SEARCH_COLUMNS = 2048
FOLDED = {"attn_norm.weight": "attn.wqkv.weight", "ffn_norm.weight": "ffn.w_gate_up.weight"}  # norm -> its reader  # output columns the alpha search quantizes (strided): its time stays bounded on 1B weights


@dataclass
class Calibration:
    """importance: our weight name -> [K] mean squared input activation; scales: our weight name ->
    [K] the factors its input channels are multiplied by (only where the search chose scaling)."""

    importance: dict[str, np.ndarray]
    scales: dict[str, np.ndarray] = field(default_factory=dict)

    def importance_of(self, name: str) -> np.ndarray | None:
        """The importance a stored weight is quantized with: its input is x / s, so imp / s^2."""
        imp = self.importance.get(name)
        if imp is None or name not in self.scales:
            return imp
        return (imp / np.square(self.scales[name])).astype(np.float32)

    def apply_(self, cfg, name: str, t: torch.Tensor) -> torch.Tensor:
        """Parameter `name` (ours, e.g. layers.0.attn_norm.weight, layers.0.attn.wqkv.weight [N, K] or
        its bias) with the scales applied, in place; -> t. Norms are scaled as `offset + weight`."""
        if not self.scales:
            return t
        for factor, rows in _factors(cfg, name, self.scales):
            f = torch.from_numpy(factor)
            if name.endswith("norm.weight"):
                off = cfg.norm_offset
                t.copy_((t.float() + off) * f - off)
            elif rows is None:  # the weight's own input columns
                t.copy_(t.float() * f[None, :])
            else:
                part = t[rows]
                part.copy_(part.float() * (f[:, None] if part.dim() == 2 else f))
        return t

    def scale_(self, model) -> None:
        """Apply the scales to a loaded Decoder's parameters, in place."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                self.apply_(model.config, name, p.data)


def _factors(cfg, name: str, scales: dict[str, np.ndarray]):
    """(factor, rows) for each scale that touches parameter `name`: a norm (divided; rows None), a
    weight's input columns (multiplied; rows None), or the rows that make another weight's input
    (divided)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return
    layer = f"layers.{parts[1]}."
    rest = ".".join(parts[2:])
    if rest in FOLDED and layer + FOLDED[rest] in scales:
        yield 1 / scales[layer + FOLDED[rest]], None
        return
    if name.endswith(".weight") and name in scales:
        yield scales[name], None
    if rest in ("attn.wqkv.weight", "attn.wqkv.bias") and layer + "attn.wo.weight" in scales:
        kind = cfg.layer(int(parts[1]))
        start, size = cfg.num_heads * kind.head_dim + kind.kv_heads * kind.head_dim, kind.kv_heads * kind.head_dim
        yield 1 / value_scales(cfg, scales[layer + "attn.wo.weight"], kind), slice(start, start + size)
    if name.endswith(("w_gate_up.weight", "w_gate_up.bias")):
        down = name.rsplit(".", 2)[0] + ".w_down.weight"
        if down in scales:
            size = len(scales[down])  # the up rows: the second half
            yield 1 / scales[down], slice(size, 2 * size)


def value_scales(cfg, o_scales: np.ndarray, kind) -> np.ndarray:
    """The output projection's [H * D] input scales -> the [Hkv * D] value channels' (equal within a group), of a
    layer of `kind` (its own head sizes: Gemma 4's full layers)."""
    return o_scales.reshape(kind.kv_heads, -1, kind.head_dim)[:, 0].reshape(-1)


def folds_into_values(cfg, layer: int) -> bool:
    """Whether the output projection's input scales can go into the layer's value rows: not where the values are
    RMS-normed (the norm undoes a scale: Gemma 4), are the keys' projection or another layer's (KV-shared)."""
    kind = cfg.layer(layer)
    return not (cfg.value_norm or kind.values_from_keys or kind.reads is not None)


def channel_scales(model, plan: dict, importance: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The scales of every weight `plan` quantizes that can take them (see the module docstring),
    searched on the loaded full-precision `model` (not changed) with calibration's `importance`."""
    cfg, scales = model.config, {}
    pre_norm = cfg.norm_placement != "post"
    found = Calibration(importance, scales)

    def weight(name: str) -> np.ndarray:  # [K, N], with the scales found so far on its rows
        t = model.get_submodule(name.removesuffix(".weight")).weight.detach().float().clone()
        return found.apply_(cfg, name, t).T.numpy()

    for i in range(cfg.num_layers):
        p, kind = f"layers.{i}.", cfg.layer(i)
        names = [p + "attn.wo.weight"] if folds_into_values(cfg, i) else []
        names += [n for n in plan if n.startswith(p) and n.endswith("w_down.weight")]
        names += [p + "attn.wqkv.weight"] if pre_norm else []  # after wo: the value rows are scaled by then
        names += [p + "ffn.w_gate_up.weight"] if pre_norm and not cfg.layer(i).moe else []
        for name in names:
            if name not in plan or name not in importance:
                continue
            group = cfg.num_heads // kind.kv_heads if name.endswith("wo.weight") else 1
            s = _search_alpha(weight(name), importance[name], plan[name], group, kind.head_dim)
            if s is not None:
                scales[name] = s
    return scales


def _search_alpha(w_t: np.ndarray, imp: np.ndarray, scheme, group: int, head_dim: int) -> np.ndarray | None:
    """The scales that minimize sum_k imp_k sum_n (Q(w s)_kn / s_k - w_kn)^2 with round-to-nearest in
    `scheme`'s bits, block and zero points, if `scheme` itself (its method: the search) also has less
    error with them than without; else None. Channels k of the same head dimension in `group`
    consecutive heads share one scale."""
    from tk.models.quant.quantize import Scheme, dequantize, quantize

    rtn = Scheme(scheme.bits, scheme.block, "rtn", scheme.zero_points)
    step = -(-w_t.shape[1] // SEARCH_COLUMNS)
    w = np.ascontiguousarray(w_t[:, ::step])
    imp = np.maximum(imp.astype(np.float64), 0)
    m = np.sqrt(imp)
    if group > 1:  # the value channel's magnitude: the mean over the query heads that read it
        m = np.broadcast_to(m.reshape(-1, group, head_dim).mean(1, keepdims=True),
                            (len(m) // (group * head_dim), group, head_dim)).reshape(-1)
    m = np.maximum(m, m.max() * FLOOR + 1e-30)

    def error(s, how) -> float:  # the importance-weighted error of w stored scaled by s under `how`
        d = dequantize(quantize(w * s[:, None], how, (imp / np.square(s)).astype(np.float32)), how.block) / s[:, None]
        return float((imp[:, None] * np.square(d - w, dtype=np.float64)).sum())

    candidates = [(s / np.sqrt(s.max() * s.min())).astype(np.float32) for s in (m ** a for a in ALPHAS)]
    errors = [error(s, rtn) for s in candidates]
    best = candidates[int(np.argmin(errors))]
    if np.argmin(errors) == 0 or error(best, scheme) >= error(candidates[0], scheme):
        return None  # no scaling (alpha 0), or none under the method that stores the weight
    return best


# The artifact keeps the statistics and scales (tk export --calibration) so that its quantized
# reference is rebuilt exactly: one .npz, our weight names (importance) and SCALES + name (scales).
CALIBRATION_FILE = "calibration.npz"
SCALES = "scales:"

def save(folder: Path, calibration: Calibration) -> None:
    np.savez(folder / CALIBRATION_FILE, **calibration.importance,
             **{SCALES + name: s for name, s in calibration.scales.items()})


def load(folder: Path) -> Calibration | None:
    path = Path(folder) / CALIBRATION_FILE
    if not path.is_file():
        return None
    with np.load(path) as data:
        return Calibration({k: data[k] for k in data.files if not k.startswith(SCALES)},
                           {k.removeprefix(SCALES): data[k] for k in data.files if k.startswith(SCALES)})
