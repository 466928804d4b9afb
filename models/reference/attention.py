"""Attention as the reference decoder computes it: per layer, over its cache (dynamic, static or a ring), with the
layer's own head sizes, q/k (and Gemma 4's value) norms, the softmax scale, softcap (Gemma 2) and sinks (gpt-oss);
a KV-shared layer (Gemma 4) attends over its source layer's cache. Where tokens sit (RoPE, masks, the cache
write) is positions.py; the layers that hold it, decoder.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tk.models.spec.config import DecoderConfig
from tk.models.reference.layers import RMSNorm
from tk.models.reference.positions import apply_rope, kv_write


@dataclass
class LayerInputs:
    """What a layer reads besides its hidden state and cache; layers of one kind share one."""

    cos: torch.Tensor | None  # (B, 1, S, R) RoPE of the layer's table, or None (NoPE)
    sin: torch.Tensor | None
    mask: torch.Tensor | None  # (B, 1, S, T) bool, True = may attend (None: a recurrent layer's)
    circular: bool = False  # the layer's static cache is a ring (kv_write wraps around)
    token_mask: torch.Tensor | None = None  # (B, S): a recurrent layer's real tokens (None: all real)


def explicit_attention(q, k, v, mask, scale: float | None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention written out (SDPA has neither): scaled scores through tanh(s / softcap) * softcap before the
    mask (Gemma 2), and a learned logit per head beside each query's scores in the softmax's denominator, read
    from no value (gpt-oss's sinks); softmax in float32 as transformers computes it. (B, H, S, D) out."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # GQA: each kv head serves rep query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, S, T)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(q.dtype) @ v
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, S, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share is dropped
    return probs.to(q.dtype) @ v


def stacks_heads(q: torch.Tensor, k: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None) -> bool:
    """Whether `attend` runs GQA as each kv head's attention over its query heads stacked along the sequence
    axis: wherever SDPA serves (no softcap, no sinks) and several query heads share a kv head."""
    return softcap is None and sinks is None and q.shape[1] != k.shape[1]


def attend(q, k, v, mask, scale: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA (the exporter's ONNX Attention), or attention written out where a softcap or sinks need it.

    GQA goes to SDPA as attention of the kv heads, each over its rep query heads stacked along the sequence
    axis (B, Hkv, rep S, D), the mask repeated alike (the heads' rows see what their position sees): one
    GEMM a kv head reads its keys once, where ONNX Runtime's CPU Attention runs one a query head and reads
    them rep times (half the time of a decode step's attention, measured), and no GEMM has one row, so a
    row's attention is the same bits in a one-token step and in a verify run without padding its queries
    (Variant.pad_queries). The same numbers as SDPA's own GQA, in the order of its several-row kernel."""
    if softcap is not None or sinks is not None:
        return explicit_attention(q, k, v, mask, scale, softcap, sinks)
    if not stacks_heads(q, k, softcap, sinks):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    rep = q.shape[1] // k.shape[1]
    stacked = q.unflatten(1, (k.shape[1], rep)).flatten(2, 3)  # (B, Hkv, rep S, D): head-major, positions within
    if mask is not None:  # (B, 1, S, T) -> (B, 1, rep S, T)
        mask = mask.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(2, 3)
    y = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask, scale=scale)  # (B, Hkv, rep S, Dv)
    return y.unflatten(2, (rep, -1)).flatten(1, 2)  # (B, H, S, Dv)


def value_norm(v: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """(B, S, Hkv D) values RMS-normed per head without a scale (Gemma 4's v_norm)."""
    B, S, _ = v.shape
    return F.rms_norm(v.view(B, S, heads, -1).float(), (v.shape[-1] // heads,), None, eps).to(v.dtype).view(B, S, -1)


class Attention(nn.Module):
    """Multi-head attention over the layer's cache, of the layer's own head sizes (Gemma 4's full layers are
    wider); a KV-shared layer (`reads`: Gemma 4's last layers) projects queries alone and attends over the keys
    and values its source layer wrote this step."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        kind = cfg.layer(layer)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, kind.kv_heads, kind.head_dim
        self.reads, self.values_from_keys = kind.reads, kind.values_from_keys
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.splits = [q_size] + ([] if self.reads is not None else [kv_size] * (1 if self.values_from_keys else 2))
        # Qwen3.5: each head's q rows are followed by as many rows of its output gate (one projection)
        self.gated = cfg.attn_output_gate
        rows = sum(self.splits) + (q_size if self.gated else 0)
        self.wqkv = nn.Linear(cfg.hidden_size, rows, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        # q/k norms over each head's D (Qwen3, Gemma 3), or over the whole projections (OLMo 2)
        self.norm_projections = cfg.qk_norm == "projection"
        q_dim, k_dim = (q_size, kv_size) if self.norm_projections else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm and self.reads is None else None
        self.value_eps = cfg.rms_norm_eps if cfg.value_norm and self.reads is None else None
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attention_sinks else None  # gpt-oss
        self.rope = kind.rope is not None  # False: a NoPE layer (SmolLM3)
        self.scale = cfg.attention_scale  # None: SDPA's 1/sqrt(D)
        self.softcap = cfg.attn_softcap
        self.pad_queries = False  # set while an export with Variant.pad_queries traces the model (padded_queries)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed q, k, v (B, S, (H + 2 Hkv) D) with the q/k norms applied: over the whole projections
        (before the head split: H*D and Hkv*D), or over each head's D (what a kernel taking packed qkv,
        GroupQueryAttention, reads as well), and Gemma 4's value norm; a KV-shared layer's q alone; and the
        output gate (B, S, H D), or None."""
        qkv = self.wqkv(x)  # (B, S, (H + 2 Hkv) * D), Qwen3.5's gates among the q rows
        B, S, _ = qkv.shape
        gate = None
        if self.gated:
            qg, k, v = qkv.split([2 * self.splits[0], *self.splits[1:]], dim=-1)
            qg = qg.view(B, S, self.n_heads, 2 * self.head_dim)
            q, gate = (t.reshape(B, S, -1) for t in qg.split(self.head_dim, dim=-1))  # (B, S, H D) each
            qkv = torch.cat([q, k, v], dim=-1)
        if self.q_norm is None and self.value_eps is None and not self.values_from_keys:
            return qkv, gate
        parts = list(qkv.split(self.splits, dim=-1))  # [q], [q, k] (values from keys) or [q, k, v]
        if self.values_from_keys:
            parts.append(parts[1])  # Gemma 4's attention_k_eq_v: the keys' projection, normed apart
        if self.q_norm is not None and self.norm_projections:
            parts[:2] = self.q_norm(parts[0]), self.k_norm(parts[1])
        elif self.q_norm is not None:
            parts[0] = self.q_norm(parts[0].view(B, S, self.n_heads, self.head_dim)).view(B, S, -1)
            if self.k_norm is not None:
                parts[1] = self.k_norm(parts[1].view(B, S, self.n_kv, self.head_dim)).view(B, S, -1)
        if self.value_eps is not None:
            parts[2] = value_norm(parts[2], self.n_kv, self.value_eps)
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0], gate

    def output(self, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The heads' output (B, S, H D), gated where the family gates it, projected."""
        return self.wo(y if gate is None else y * torch.sigmoid(gate))

    def heads(self, qkv: torch.Tensor, single: bool):
        """Packed qkv -> q (B, H, S, D), k and v (B, Hkv, S, D) (None for a KV-shared layer)."""
        B, S, _ = qkv.shape
        own = self.reads is None
        if single:  # moving a size-1 axis is a reshape: all heads to (B, H + 2 Hkv, 1, D) in one node, split there
            heads = qkv.reshape(B, self.n_heads + (2 * self.n_kv if own else 0), 1, self.head_dim)
            if not own:
                return heads, None, None
            return heads.split([self.n_heads, self.n_kv, self.n_kv], dim=1)  # (B, H, 1, D)
        sizes = [self.n_heads * self.head_dim] + ([self.n_kv * self.head_dim] * 2 if own else [])
        out = [t.view(B, S, -1, self.head_dim).transpose(1, 2) for t in qkv.split(sizes, dim=-1)]
        return (*out, None, None) if not own else out

    def forward(self, x, inputs: LayerInputs, past: tuple[torch.Tensor, torch.Tensor] | None,
                write_index: torch.Tensor | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None):
        B, S, _ = x.shape
        qkv, gate = self.project(x)  # (B, S, (H + 2 Hkv) * D), every q/k norm applied
        # One new token (S is a plain 1 when the decode graph is traced, a symbol for prefill): 2 nodes instead
        # of 7 per layer in the decode graph
        single = isinstance(S, int) and S == 1
        q, k, v = self.heads(qkv, single)
        if self.rope:
            q = apply_rope(q, inputs.cos, inputs.sin)  # (B, H, S, D)
            k = k if k is None else apply_rope(k, inputs.cos, inputs.sin)  # (B, Hkv, S, D)
        if shared is not None:  # a KV-shared layer: its source's keys and values as written this step; none of its own
            (k, v), present = shared, ()
        else:
            if write_index is not None:  # static capacity: write in place, attend over the whole buffer (or ring)
                at, circular = write_index, inputs.circular
                if circular and single:  # one token never wraps: a linear write at index mod slots (TensorRT's
                    at, circular = torch.remainder(write_index, past[0].shape[2]), False  # KV-cache update is linear only)
                k = kv_write(past[0], k, at, circular)  # (B, Hkv, C, D)
                v = kv_write(past[1], v, at, circular)
            elif past is not None:  # the concat stays outside SDPA: TensorRT rejects Attention with past
                k = torch.cat([past[0], k], dim=2)  # (B, Hkv, T, D)
                v = torch.cat([past[1], v], dim=2)
            present = (k, v)
        width = None if write_index is None or inputs.mask is None else inputs.mask.shape[-1]
        if width is not None and not (isinstance(width, int) and width == k.shape[2]):
            # a narrow mask (contract.inputs' narrow_mask): attend over the positions it covers alone
            k, v = k[:, :, :width], v[:, :, :width]
        mask = inputs.mask
        # the run's queries and a copy of the last: no attention GEMM of one row (Variant.pad_queries), where
        # stacked GQA heads do not already give each GEMM several (`attend`)
        pad = self.pad_queries and not stacks_heads(q, k, self.softcap, self.sinks)
        if pad:
            q, mask = torch.cat([q, q[:, :, -1:]], dim=2), torch.cat([mask, mask[:, :, -1:]], dim=2)
        y = attend(q, k, v, mask, self.scale, self.softcap, self.sinks)  # (B, H, S, D)
        y = y[:, :, :S] if pad else y
        y = (y if single else y.transpose(1, 2)).reshape(B, S, self.n_heads * self.head_dim)  # (B, S, H*D)
        return self.output(y, gate), present


@contextmanager
def padded_queries(model: nn.Module, on: bool):
    """While it lasts, an attention whose GEMMs would have one row (no stacked GQA heads: `attend`) takes one
    query more than each run has (Variant.pad_queries): what the exporter traces; the reference computes
    without it."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.pad_queries = on
    try:
        yield
    finally:
        for m in layers:
            m.pad_queries = False
