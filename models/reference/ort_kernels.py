"""Mirrors of ONNX Runtime's fused kernels, for tk export --target ort.

Custom ops mark where ONNX Runtime has a kernel that fuses several of the reference's layers:
`tk::add_rms_norm` (residual add + RMSNorm -> SkipSimplifiedLayerNormalization), `tk::gqa`
(RoPE, cache write and attention of one decode step -> GroupQueryAttention, in ONNX Runtime's
calling convention), and a recurrent layer's two steps on its state (`FUSED`): `tk::causal_conv`
(-> CausalConvWithState) and `tk::linear_attention` (the gated and gated delta rules ->
LinearAttention, q/k/v packed [B, T, H*D]). Their eager bodies are the reference math, so the fused forward below
computes what `Decoder.forward` computes (tested), and the exporter translates the two ops.
What they cannot express is `fused_unsupported(cfg)` (models/spec/limits.py), which `tk export` checks before any weight is read.
The reference model (models/reference/decoder.py) knows nothing of any of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tk.models.reference.attention import explicit_attention
from tk.models.reference.decoder import Block, Decoder, KVCache
from tk.models.reference.layers import RMSNorm
from tk.models.reference.positions import apply_rope, kv_write
from tk.models.reference.recurrent import Kernels, causal_conv, linear_attention


@torch.library.custom_op("tk::add_rms_norm", mutates_args=())
def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h + delta) * scale, h + delta): ONNX Runtime's SkipSimplifiedLayerNormalization."""
    s = h + delta
    return F.rms_norm(s.float(), (s.shape[-1],), scale.float(), eps).to(s.dtype), s


@add_rms_norm.register_fake
def _(h, delta, scale, eps):
    return torch.empty_like(h), torch.empty_like(h)


def add_norm(norm: RMSNorm, h: torch.Tensor, delta: torch.Tensor | None):
    """The residual stream is carried as (h, delta): norm(h + delta) and h + delta, in one kernel."""
    if delta is None:
        return norm(h), h
    return add_rms_norm(h, delta, norm.scale().to(h.dtype), norm.eps)


def branch_input(layer: Block, norm: RMSNorm, h: torch.Tensor, delta: torch.Tensor | None):
    """(a branch's input, the residual stream h + delta): one fused add + norm before a pre-norm (or
    sandwich) branch; a plain add before a post-norm one (OLMo 2), whose norm is on its output
    (Block.branch_out)."""
    if layer.pre_norm:
        return add_norm(norm, h, delta)
    h = h if delta is None else h + delta
    return h, h


@torch.library.custom_op("tk::causal_conv", mutates_args=())
def causal_conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                   silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ONNX Runtime's CausalConvWithState: recurrent.causal_conv (x (B, C, T), carry (B, C, k - 1))."""
    y, carry = causal_conv(x, weight, bias, state, silu)
    return y, carry.contiguous()


@causal_conv_op.register_fake
def _(x, weight, bias, state, silu):
    return torch.empty_like(x), torch.empty_like(state)


@torch.library.custom_op("tk::linear_attention", mutates_args=())
def linear_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, decay: torch.Tensor,
                        beta: torch.Tensor | None, heads: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ONNX Runtime's LinearAttention in its calling convention: q, k (B, T, H dk), v (B, T, H dv), state
    (B, H, dk, dv), decay and beta (B, T, H) -> (o (B, T, H dv), the new state); the gated delta rule with
    beta, the gated rule without (recurrent.linear_attention)."""
    B, T, _ = q.shape
    heads_of = lambda t: t.reshape(B, T, heads, -1).transpose(1, 2)  # noqa: E731  (B, H, T, d)
    o, new = linear_attention(heads_of(q), heads_of(k), heads_of(v), state, decay.transpose(1, 2),
                              None if beta is None else beta.transpose(1, 2), scale)
    return o.transpose(1, 2).reshape(B, T, -1), new


@linear_attention_op.register_fake
def _(q, k, v, state, decay, beta, heads, scale):
    return v.new_empty(v.shape, dtype=torch.float32), torch.empty_like(state)


def _fused_attend(q, k, v, state, decay, beta, scale):
    """recurrent.linear_attention's signature over ONNX Runtime's LinearAttention (q, k, v (B, H, T, d))."""
    B, H, T, dv = v.shape
    packed = [t.transpose(1, 2).reshape(B, T, -1) for t in (q, k, v)]
    o, new = linear_attention_op(*packed, state, decay.transpose(1, 2), None if beta is None else beta.transpose(1, 2),
                                 H, scale)
    return o.reshape(B, T, H, dv).transpose(1, 2), new


FUSED = Kernels(causal_conv_op, _fused_attend)  # a recurrent layer's steps through ONNX Runtime's kernels


@dataclass
class FusedAttentionInputs:
    """What GroupQueryAttention takes besides qkv and the cache, computed once per decode step."""

    seqlens_k: torch.Tensor  # (B,) int32: cache index of the newest token (GQA: total length - 1)
    total: torch.Tensor  # () int32: the mask's width (the static capacity, or past + 1)
    cos_cache: dict[str, torch.Tensor]  # RoPE table name -> (N, D/2): over every position the cache can hold
    sin_cache: dict[str, torch.Tensor]
    position_ids: torch.Tensor  # (B, S) int64
    bias: torch.Tensor | None  # (B, 1, S, total) additive: 0 where a query may attend, dtype's min elsewhere
    static: bool  # the cache is a fixed-capacity buffer (present has the past's shape)


@torch.library.custom_op("tk::gqa", mutates_args=())
def gqa(qkv: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, seqlens_k: torch.Tensor, total: torch.Tensor,
        cos_cache: torch.Tensor, sin_cache: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor | None,
        sinks: torch.Tensor | None, num_heads: int, kv_num_heads: int, local_window: int, static: bool, rotary: bool,
        scale: float | None, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One attention step as ONNX Runtime's GroupQueryAttention computes it, from packed qkv
    (B, S, (H + 2 Hkv) D): RoPE (half-split) at position_ids unless not `rotary` (do_rotary), k and
    v written into the cache at seqlens_k - S + 1, causal attention (softmax scale `scale`, None:
    1/sqrt(D); scores through tanh(s / softcap) * softcap first when softcap > 0; with `sinks`, its head_sink
    input, a logit per head in each softmax's denominator) over the cache up to each row's seqlens_k, over the
    last `local_window` keys (local_window_size, the query's own included) when >= 0, where `bias` (when given)
    is 0. Returns (y (B, S, H D), present_k, present_v); present is max(total, past) long."""
    B, S, _ = qkv.shape
    D = past_k.shape[-1]
    q, k, v = (t.view(B, S, -1, D).transpose(1, 2)
               for t in qkv.split([num_heads * D, kv_num_heads * D, kv_num_heads * D], dim=-1))
    if rotary:
        cos, sin = (torch.cat([t[position_ids]] * 2, dim=-1)[:, None].to(qkv.dtype)  # (B, 1, S, D)
                    for t in (cos_cache, sin_cache))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    T = int(total)
    grow = T - past_k.shape[2]
    if grow > 0:
        past_k, past_v = (F.pad(t, (0, 0, 0, grow)) for t in (past_k, past_v))
    start = seqlens_k.long() - S + 1
    present_k, present_v = kv_write(past_k, k, start), kv_write(past_v, v, start)
    # causal within the step, nothing past a row's newest token, nothing beyond the window
    query_at = start[:, None, None] + torch.arange(S, device=qkv.device)[:, None]  # (B, S, 1)
    dist = query_at - torch.arange(T, device=qkv.device)  # (B, S, T)
    hidden = (dist < 0) | ((dist >= local_window) if local_window >= 0 else False)
    allowed = ~hidden[:, None] if bias is None else (bias[..., :T] == 0) & ~hidden[:, None]  # (B, 1, S, T)
    k, v = present_k[:, :, :T], present_v[:, :, :T]
    if softcap > 0 or sinks is not None:
        y = explicit_attention(q, k, v, allowed, scale, softcap if softcap > 0 else None, sinks)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=num_heads != kv_num_heads)
    return y.transpose(1, 2).reshape(B, S, num_heads * D), present_k, present_v


@gqa.register_fake
def _(qkv, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, position_ids, bias, sinks, num_heads, kv_num_heads,
      local_window, static, rotary, scale, softcap=0.0):
    B, S, _ = qkv.shape
    shape = past_k.shape if static else (B, past_k.shape[1], past_k.shape[2] + S, past_k.shape[3])
    return qkv.new_empty(B, S, num_heads * past_k.shape[-1]), past_k.new_empty(shape), past_v.new_empty(shape)


def fused_attention_inputs(model: Decoder, positions: int, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor, write_index: torch.Tensor | None,
                           dtype: torch.dtype, decode_prefills: bool = False) -> FusedAttentionInputs:
    """GroupQueryAttention's side inputs for one decode step of S new tokens per row (position_ids
    (B, S); S > 1 only over a static cache whose decode graph also prefills); positions: how many
    rows the RoPE tables need (one per table the layers use). The kernel itself is causal, never looks
    past a row's newest token (seqlens_k) and applies each layer's sliding window (local_window_size),
    so a bias carries only
    padding (hiding every padding key but each token itself). With `decode_prefills` (the cache rows of
    a decode graph that also prefills: every row's tokens from index 0, so attention_mask is 1
    exactly on the row's first seqlens_k + 1 positions) there is no bias at all: GroupQueryAttention
    then reads no mask, and the step has a dozen fewer nodes."""
    B, T = attention_mask.shape
    S = position_ids.shape[1]
    device = attention_mask.device
    cfg = model.config
    at = torch.arange(positions, dtype=torch.float32, device=device)[:, None]
    tables = ({cfg.layer(i).rope for i in range(cfg.num_layers)} - {None}) or {"global"}  # (NoPE: do_rotary=0 reads none)
    freqs = {t: at * model.rope_table(t) for t in sorted(tables)}  # (N, R/2) each
    first = torch.full((B,), T - 1, device=device) if write_index is None else write_index  # the first new token's index
    bias = None
    if not decode_prefills:
        at = first[:, None] + torch.arange(S, device=device)  # (B, S): each new token's cache index
        dist = at[:, :, None] - torch.arange(T, device=device)  # (B, S, T)
        visible = attention_mask[:, None, :].bool() | (dist == 0)
        bias = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]  # (B, 1, S, T)
    factor = model.rope_factors  # YaRN's attention factor on cos and sin
    return FusedAttentionInputs((first + S - 1).to(torch.int32), torch.full((), T, dtype=torch.int32),
                                {t: (f.cos() * factor[t]).to(dtype) for t, f in freqs.items()},
                                {t: (f.sin() * factor[t]).to(dtype) for t, f in freqs.items()}, position_ids, bias,
                                write_index is not None)


def forward(model: Decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            past_key_values: KVCache | None = None, write_index: torch.Tensor | None = None,
            last_only: bool = False, decode_prefills: bool = False,
            keep: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
    """`Decoder.forward` through the fused kernels: the residual stream carried as (h, delta) so
    each add meets the norm after it in one SkipSimplifiedLayerNormalization (in post-norm blocks
    only the final norm follows an add), and in decode (a past is given) one GroupQueryAttention
    per layer, except in a sliding layer whose static cache is a ring (GroupQueryAttention writes a
    cache linearly) and in a KV-shared layer (which writes none), which attend as the reference does.
    `decode_prefills`: see fused_attention_inputs."""
    cfg = model.config
    x = model.embed_inputs(input_ids)  # (B, S, C)
    per_layer = model.per_layer_inputs(input_ids, x)  # (B, S, L, P) (Gemma 4), or None
    inputs = model.layer_inputs(attention_mask, position_ids, input_ids.shape[1], x.dtype, write_index,
                                past_key_values)  # what a layer outside GroupQueryAttention reads
    fused = None
    if past_key_values is not None:  # decode: GroupQueryAttention does RoPE and masking itself
        positions = attention_mask.shape[1] if write_index is not None else cfg.max_position_embeddings
        fused = fused_attention_inputs(model, positions, attention_mask, position_ids, write_index, x.dtype,
                                       decode_prefills)
    present: KVCache = []
    h, delta = x, None
    for i, layer in enumerate(model.layers):
        xn, h = branch_input(layer, layer.attn_norm, h, delta)
        attn, kind = layer.attn, cfg.layer(i)
        past = past_key_values[i] if past_key_values is not None else None
        if attn is None:  # a recurrent layer: its convolution and rule through ONNX Runtime's kernels
            a, kv = layer.mixer(xn, inputs[i].token_mask, past, FUSED)
        elif fused is not None and not inputs[i].circular and layer.reads is None:
            table = kind.rope or "global"  # a NoPE layer still passes a table (do_rotary=0 ignores it)
            qkv, gate = attn.project(xn)
            y, k, v = gqa(qkv, past[0], past[1], fused.seqlens_k, fused.total,
                          fused.cos_cache[table], fused.sin_cache[table], fused.position_ids, fused.bias, attn.sinks,
                          attn.n_heads, attn.n_kv, -1 if kind.window is None else kind.window, fused.static, attn.rope,
                          attn.scale, attn.softcap or 0.0)
            a, kv = attn.output(y, gate), (k, v)
        else:
            shared = None if layer.reads is None else present[layer.reads]
            a, kv = attn(xn, inputs[i], past, write_index, shared)
        xn, h = branch_input(layer, layer.ffn_norm, h, layer.branch_out(layer.attn_norm, layer.attn_post_norm, a))
        delta = layer.branch_out(layer.ffn_norm, layer.ffn_post_norm, layer.ffn(xn))
        if layer.has_tail:  # Gemma 4's per-layer input and layer scalar follow the FFN's residual add
            h, delta = layer.tail(h + delta, None if per_layer is None else per_layer[:, :, i]), None
        present.append(kv)
    if last_only:  # left padding puts every row's newest token last
        h, delta = h[:, -1:], None if delta is None else delta[:, -1:]
    elif keep is not None:  # a verify step's positions (contract.inputs' logits_to_keep)
        h, delta = h.index_select(1, keep), None if delta is None else delta.index_select(1, keep)
    xn, _ = add_norm(model.norm, h, delta)
    return model.logits(xn), present
