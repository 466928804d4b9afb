"""Where tokens sit: RoPE (the tables, cos/sin, the rotation in Hugging Face's half-split layout),
the attention masks built from the contract's 2D attention_mask (causal, sliding window, a static
cache's buffer or ring), and the static cache's write, one custom op (`tk::kv_write`, eager: a
scatter) so that the exporter can name it. Pure functions over tensors; the layers that use them are
models/reference/decoder.py.
"""

from __future__ import annotations

import math

import torch

from tk.models.spec.config import DecoderConfig


def rope_inv_freq(cfg: DecoderConfig, table: str = "global") -> torch.Tensor:
    """Inverse frequencies as Hugging Face's ROPE_INIT_FUNCTIONS compute them (float32), over the table's
    rotated width (cfg.rope_dim: Gemma 4's global table is as wide as its full layers' heads); the "local"
    table (Gemma 3's, Gemma 4's and OLMo 3's sliding layers) has its own base and is never scaled."""
    dim = cfg.rope_dim(table)
    theta = cfg.rope_local_theta if table == "local" else cfg.rope_theta
    scaling = (cfg.rope_scaling if table == "global" else None) or {}
    kind = scaling.get("rope_type", "default")
    if kind == "proportional":  # Gemma 4: the first share of the frequencies rotate, the rest are 0 (cos 1, sin 0)
        angles = int(scaling.get("partial_rotary_factor", 1.0) * dim // 2)
        inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
        return torch.cat([inv, torch.zeros(dim // 2 - angles)]) / scaling.get("factor", 1.0)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(scaling, dim, theta, cfg.max_position_embeddings)
    return inv


def _yarn_factor(scaling: dict, max_positions: int) -> float:
    return scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"]


def _yarn_inv_freq(scaling: dict, dim: int, theta: float, max_positions: int) -> torch.Tensor:
    """YaRN's frequencies as transformers' _compute_yarn_parameters computes them: extrapolated (unscaled) above
    beta_fast rotations over the original context, interpolated (divided by the factor) below beta_slow, a linear
    ramp between (its bounds floored and ceiled unless `truncate` is false: gpt-oss)."""
    factor, original = _yarn_factor(scaling, max_positions), scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers: prevents a singularity)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep


def rope_attention_factor(cfg: DecoderConfig, table: str = "global") -> float:
    """What a table's cos and sin are multiplied by: YaRN's attention factor (given, or from the factor and
    mscale / mscale_all_dim as the paper's Eq. 21), 1 for every other table."""
    scaling = (cfg.rope_scaling if table == "global" else None) or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, cfg.max_position_embeddings)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0):
    freqs = position_ids[..., None].float() * inv_freq  # (B, S, R/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, S, R): HF half-split layout
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:  # YaRN's attention factor, in float32 before the cast (as transformers)
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # (B, 1, S, R)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # slices, as Hugging Face writes it: the exporter fuses this into RotaryEmbedding
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]  # partial rotary (Phi-3): rotate the leading dims only
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


def causal_mask(attention_mask: torch.Tensor, q_len: int, sliding_window: int | None,
                write_index: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) 0/1 mask over the cache -> (B, 1, S, T) bool, True = may attend.

    Query i sits at cache index (T - S) + i (lower-right alignment), or at write_index[b] + i in
    a static-capacity cache whose T is its capacity. It sees keys at or before it, within the
    sliding window if any, and never a padding key except itself, so a padding row attends to
    something and stays finite (its output is never used).
    """
    total = attention_mask.shape[-1]
    k_idx = torch.arange(total, device=attention_mask.device)  # (T,)
    q_idx = torch.arange(q_len, device=attention_mask.device)  # (S,)
    if write_index is None:
        dist = ((q_idx + (total - q_len))[:, None] - k_idx)[None]  # (1, S, T)
    else:
        dist = (write_index[:, None] + q_idx)[:, :, None] - k_idx  # (B, S, T)
    visible = dist >= 0
    if sliding_window is not None:
        visible = visible & (dist < sliding_window)
    real = attention_mask[:, None, :].bool()  # (B, 1, T)
    return (visible & (real | (dist == 0)))[:, None]  # (B, 1, S, T)


def ring_mask(attention_mask: torch.Tensor, q_len: int, sliding_window: int, write_index: torch.Tensor,
              slots: int) -> torch.Tensor:
    """The mask of a sliding layer whose static cache is a ring of `slots` positions, read after this
    step's S new tokens were written at cache index write_index[b] + i, slot (write_index[b] + i) % slots:
    (B, 1, S, slots) bool. Slot j holds the newest cache index p_j = j (mod slots) written so far (p_j < 0:
    none yet); query i (at write_index[b] + i) sees it when it is real, not after the query and within
    the window. A step takes at most slots - window + 1 tokens, so no slot a query needs is overwritten."""
    last = (write_index + q_len - 1)[:, None]  # (B, 1): the newest index written
    held = last - torch.remainder(last - torch.arange(slots, device=write_index.device), slots)  # (B, slots)
    q_at = write_index[:, None] + torch.arange(q_len, device=write_index.device)  # (B, S)
    dist = q_at[:, :, None] - held[:, None, :]  # (B, S, slots)
    real = attention_mask.gather(1, held.clamp(min=0)).bool() & (held >= 0)  # (B, slots)
    visible = (dist >= 0) & (dist < sliding_window) & (real[:, None, :] | (dist == 0))
    return visible[:, None]  # (B, 1, S, slots)


@torch.library.custom_op("tk::kv_write", mutates_args=())
def kv_write(cache: torch.Tensor, update: torch.Tensor, write_index: torch.Tensor, circular: bool = False
             ) -> torch.Tensor:
    """cache (B, H, C, D) with update (B, H, S, D) written at positions write_index[b] .. + S (each
    modulo C when `circular`: a ring).

    The static-capacity cache update: exported as ONNX TensorScatter (opset 24, mode linear or
    circular), which ORT runs in place when the same buffer is bound as input and output and TensorRT
    maps to its KV-cache update layer. Eager torch returns a new tensor.
    """
    B, H, S, D = update.shape
    pos = write_index[:, None] + torch.arange(S, device=update.device)  # (B, S)
    if circular:
        pos = torch.remainder(pos, cache.shape[2])
    return cache.scatter(2, pos[:, None, :, None].expand(B, H, S, D), update)


@kv_write.register_fake
def _(cache, update, write_index, circular=False):
    return torch.empty_like(cache)
