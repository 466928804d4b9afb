"""The reference decoder: LLaMA-style, written to export cleanly and to match Hugging Face.

Owns the layers (RMSNorm, RoPE as pure functions, Attention with MHA/GQA/MQA, gated FFN, mixture of
experts, Block) and `Decoder`. What families change are config fields read by small pieces, never a
family's name: q/k norms per head or per projection, the attention scale and softcap, pre-, post- or
sandwich-norm branches, Granite's multipliers, and per layer (`DecoderConfig.layer`) its RoPE table
(global, local, none), its sliding window and whether its FFN is a mixture of experts. Layers of one
kind share what `Decoder.layer_inputs` computes once (RoPE's cos/sin, the mask). `Decoder.forward`
has no hidden state: the past cache comes in, the present cache goes out, exactly the graph contract
(models/spec/contract.py), where a sliding layer's static cache may be a ring of fewer positions than the
others'. It knows nothing about checkpoints (models/checkpoint/loading.py) or ONNX (exporters/).

Projections are stored concatenated (`wqkv`, `w_gate_up`): one matmul each in every backend.
The loader concatenates families that store them apart.

Where tokens sit (RoPE, the masks, the static cache's write) is models/reference/positions.py. ONNX Runtime's
fused kernels (tk export --target ort) live in models/reference/ort_kernels.py, which drives these same layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tk.models.spec.config import DecoderConfig
from tk.models.reference.positions import apply_rope, causal_mask, kv_write, ring_mask, rope_cos_sin, rope_inv_freq
from tk.models.reference.recurrent import MIXERS

# per layer, its state: (key, value) of an attention layer, each (B, Hkv, T, D); a recurrent layer's carry
# (and matrix state): models/reference/recurrent.py
KVCache = list[tuple[torch.Tensor, ...]]

_ACT = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class RMSNorm(nn.Module):
    """Computed in float32 and cast back, scaled by (offset + weight): offset 1 for Gemma."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def scale(self) -> torch.Tensor:
        return self.weight.float() if self.offset == 0 else self.offset + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The scale goes into rms_norm itself: one RMSNormalization node in the graph, no extra Mul.
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).to(x.dtype)


def times(x: torch.Tensor, s: float) -> torch.Tensor:
    """x * s for a Python float s as transformers computes it: in float32, rounded once to x's
    dtype. (Traced as a plain `x * s`, ONNX would multiply by s rounded to half precision first.)"""
    return (x.float() * s).to(x.dtype)


@dataclass
class LayerInputs:
    """What a layer reads besides its hidden state and cache; layers of one kind share one."""

    cos: torch.Tensor | None  # (B, 1, S, R) RoPE of the layer's table, or None (NoPE)
    sin: torch.Tensor | None
    mask: torch.Tensor | None  # (B, 1, S, T) bool, True = may attend (None: a recurrent layer's)
    circular: bool = False  # the layer's static cache is a ring (kv_write wraps around)
    token_mask: torch.Tensor | None = None  # (B, S): a recurrent layer's real tokens (None: all real)


def softcapped_attention(q, k, v, mask, scale: float | None, softcap: float) -> torch.Tensor:
    """Attention whose scaled scores go through tanh(s / softcap) * softcap before the mask (Gemma 2;
    SDPA has no softcap), softmax in float32 as transformers computes it. (B, H, S, D) out."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # GQA: each kv head serves rep query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, S, T)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.splits = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        # Qwen3.5: each head's q rows are followed by as many rows of its output gate (one projection)
        self.gated = cfg.attn_output_gate
        rows = sum(self.splits) + (cfg.q_size if self.gated else 0)
        self.wqkv = nn.Linear(cfg.hidden_size, rows, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # q/k norms over each head's D (Qwen3, Gemma 3), or over the whole projections (OLMo 2)
        self.norm_projections = cfg.qk_norm == "projection"
        q_dim, k_dim = (cfg.q_size, cfg.kv_size) if self.norm_projections else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.rope = cfg.layer(layer).rope is not None  # False: a NoPE layer (SmolLM3)
        self.scale = cfg.attention_scale  # None: SDPA's 1/sqrt(D)
        self.softcap = cfg.attn_softcap

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed q, k, v (B, S, (H + 2 Hkv) D) with the q/k norms applied: over the whole projections
        (before the head split: H*D and Hkv*D), or over each head's D (what a kernel taking packed qkv,
        GroupQueryAttention, reads as well); and the output gate (B, S, H D), or None."""
        qkv = self.wqkv(x)  # (B, S, (H + 2 Hkv) * D), Qwen3.5's gates among the q rows
        B, S, _ = qkv.shape
        gate = None
        if self.gated:
            qg, k, v = qkv.split([2 * self.splits[0], *self.splits[1:]], dim=-1)
            qg = qg.view(B, S, self.n_heads, 2 * self.head_dim)
            q, gate = (t.reshape(B, S, -1) for t in qg.split(self.head_dim, dim=-1))  # (B, S, H D) each
            qkv = torch.cat([q, k, v], dim=-1)
        if self.q_norm is None:
            return qkv, gate
        q, k, v = qkv.split(self.splits, dim=-1)
        if self.norm_projections:
            return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1), gate
        q = self.q_norm(q.view(B, S, self.n_heads, self.head_dim)).view(B, S, -1)
        k = self.k_norm(k.view(B, S, self.n_kv, self.head_dim)).view(B, S, -1)
        return torch.cat([q, k, v], dim=-1), gate

    def output(self, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The heads' output (B, S, H D), gated where the family gates it, projected."""
        return self.wo(y if gate is None else y * torch.sigmoid(gate))

    def forward(self, x, inputs: LayerInputs, past: tuple[torch.Tensor, torch.Tensor] | None,
                write_index: torch.Tensor | None = None):
        B, S, _ = x.shape
        qkv, gate = self.project(x)  # (B, S, (H + 2 Hkv) * D), every q/k norm applied
        # One new token (S is a plain 1 when the decode graph is traced, a symbol for prefill):
        # moving a size-1 axis is a reshape, so all heads go to (B, H + 2 Hkv, 1, D) in one node
        # and split there: 2 nodes instead of 7 per layer in the decode graph.
        single = isinstance(S, int) and S == 1
        if single:
            heads = qkv.reshape(B, self.n_heads + 2 * self.n_kv, 1, self.head_dim)
            q, k, v = heads.split([self.n_heads, self.n_kv, self.n_kv], dim=1)  # (B, H, 1, D)
        else:
            q, k, v = (t.view(B, S, -1, self.head_dim).transpose(1, 2) for t in qkv.split(self.splits, dim=-1))
        if self.rope:
            q = apply_rope(q, inputs.cos, inputs.sin)  # (B, H, S, D)
            k = apply_rope(k, inputs.cos, inputs.sin)  # (B, Hkv, S, D)
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
        if self.softcap is not None:
            y = softcapped_attention(q, k, v, inputs.mask, self.scale, self.softcap)  # (B, H, S, D)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=inputs.mask, scale=self.scale,
                                               enable_gqa=self.n_heads != self.n_kv)
        y = (y if single else y.transpose(1, 2)).reshape(B, S, self.n_heads * self.head_dim)  # (B, S, H*D)
        return self.output(y, gate), present


class FeedForward(nn.Module):
    """Gated FFN: SwiGLU (silu) or GeGLU (gelu-tanh), `size` wide (default: intermediate_size)."""

    def __init__(self, cfg: DecoderConfig, size: int | None = None):
        super().__init__()
        size = size or cfg.intermediate_size
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * size, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = _ACT[cfg.hidden_act]

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(self.act(gate) * up)


class MoE(nn.Module):
    """A mixture of experts (Mixtral, Qwen2/3-MoE, Qwen3-Next, Granite 4.0-H): the router's softmax over all experts in float32,
    each token's top experts_per_token (renormalized to sum to 1 when the family does), each expert
    run on its own tokens only, so a step costs the active experts, not all of them; plus a shared
    expert scaled by sigmoid(its gate) (Qwen2-MoE). Experts are plain FFNs: one matmul pair each."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.experts_per_token, cfg.renormalize_experts
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(cfg, cfg.expert_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_size
        self.shared = FeedForward(cfg, shared) if shared else None
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared and cfg.shared_expert_gated else None

    def routing(self, h: torch.Tensor) -> torch.Tensor:
        """(T, C) -> (E, T): each expert's weight for each token, 0 where the token does not take it."""
        probs = F.softmax(self.router(h).float(), dim=-1)  # (T, E), over every expert
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (T, k)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, chosen, weights).T  # (E, T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        h = x.reshape(B * S, C)  # (T, C)
        routing = self.routing(h).to(h.dtype)  # (E, T)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = routing[e].nonzero().reshape(-1)  # (n,): the tokens that take expert e (none: nothing runs)
            y = expert(h.index_select(0, rows)) * routing[e].index_select(0, rows)[:, None]  # (n, C)
            out = out.index_put((rows,), out.index_select(0, rows) + y)  # rows are distinct: a plain scatter
        if self.shared is not None:  # scaled by sigmoid(its gate) (Qwen), or added as it is (Granite 4.0-H)
            shared = self.shared(h)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(h)) * shared)
        return out.reshape(B, S, C)


class Block(nn.Module):
    """Attention (or, in a hybrid's other layers, a recurrent mixer: `mixer`) then FFN, each a residual
    branch x + residual_multiplier * branch(x) whose RMSNorm is on the branch's input (pre-norm), on its
    output (post-norm: OLMo 2), or both (sandwich: Gemma 2/3, whose output norms are `attn_post_norm` and
    `ffn_post_norm`)."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        placement, norm = cfg.norm_placement, lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.attn_norm = norm()
        kind = cfg.mixer(layer)
        self.attn = Attention(cfg, layer) if kind == "attention" else None
        self.mixer = MIXERS[kind](cfg) if kind != "attention" else None
        self.attn_post_norm = norm() if placement == "sandwich" else None
        self.ffn_norm = norm()
        self.ffn = MoE(cfg) if cfg.layer(layer).moe else FeedForward(cfg)
        self.ffn_post_norm = norm() if placement == "sandwich" else None
        self.pre_norm = placement != "post"
        self.residual_multiplier = cfg.residual_multiplier

    def branch_in(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x) if self.pre_norm else x

    def branch_out(self, norm: RMSNorm, post: RMSNorm | None, y: torch.Tensor) -> torch.Tensor:
        """What a branch (its norm, its output norm if sandwiched) adds to the residual stream."""
        if post is not None:
            y = post(y)
        elif not self.pre_norm:
            y = norm(y)
        return y if self.residual_multiplier == 1.0 else times(y, self.residual_multiplier)

    def mix(self, x, inputs: LayerInputs, past, write_index=None):
        """The token mixer on the normed input -> (its output, the layer's present state)."""
        if self.attn is not None:
            return self.attn(x, inputs, past, write_index)
        return self.mixer(x, inputs.token_mask, past)

    def forward(self, x, inputs: LayerInputs, past, write_index=None):
        a, present = self.mix(self.branch_in(self.attn_norm, x), inputs, past, write_index)
        h = x + self.branch_out(self.attn_norm, self.attn_post_norm, a)
        y = self.ffn(self.branch_in(self.ffn_norm, h))
        return h + self.branch_out(self.ffn_norm, self.ffn_post_norm, y), present


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.rope_local_theta is not None:  # Gemma 3's sliding layers
            self.register_buffer("inv_freq_local", rope_inv_freq(cfg, "local"), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def group(self, flat) -> KVCache:
        """Cache tensors in the contract's order -> per layer, its key and value, or its recurrent state."""
        out, at = [], 0
        for i in range(self.config.num_layers):
            n = 2 if self.config.mixer(i) == "attention" else len(self.config.layer_state(i))
            out.append(tuple(flat[at:at + n]))
            at += n
        return out

    def embed_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # (B, S, C)
        if self.config.embed_scale:  # Gemma: the normalizer is rounded to the activation dtype first
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        if self.config.embedding_multiplier != 1.0:  # Granite
            x = times(x, self.config.embedding_multiplier)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden state (B, S, C) -> logits (B, S, V), float32 in every precision."""
        logits = self.lm_head(x)
        if self.config.logits_scaling != 1.0:  # Granite: a division, rounded to the model's dtype as in transformers
            logits = (logits.float() / self.config.logits_scaling).to(logits.dtype)
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2/3, in the model's dtype as in transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def rope_table(self, table: str) -> torch.Tensor:
        return self.inv_freq_local if table == "local" else self.inv_freq

    def layer_inputs(self, attention_mask: torch.Tensor, position_ids: torch.Tensor, q_len: int, dtype: torch.dtype,
                     write_index: torch.Tensor | None = None, past: KVCache | None = None) -> list[LayerInputs]:
        """Each layer's LayerInputs, computed once per kind of layer: RoPE's cos/sin per table, the mask
        per window. Over a static cache (write_index) a sliding layer whose buffer is shorter than the
        mask is a ring (models/spec/contract.py sizes it)."""
        tables, masks, out = {}, {}, []
        # a recurrent layer's real tokens: every new one in a static cache (its rows are never padded)
        tokens = attention_mask[:, -q_len:] if write_index is None else None
        for i in range(self.config.num_layers):
            kind = self.config.layer(i)
            if kind.mixer != "attention":
                out.append(LayerInputs(None, None, None, token_mask=tokens))
                continue
            if kind.rope is not None and kind.rope not in tables:
                tables[kind.rope] = rope_cos_sin(position_ids, self.rope_table(kind.rope), dtype)
            slots = past[i][0].shape[2] if write_index is not None else None
            ring = slots is not None and kind.window is not None and slots < attention_mask.shape[1]
            key = (kind.window, slots if ring else None)
            if key not in masks:
                masks[key] = (ring_mask(attention_mask, q_len, kind.window, write_index, slots) if ring
                              else causal_mask(attention_mask, q_len, kind.window, write_index))
            out.append(LayerInputs(*tables.get(kind.rope, (None, None)), masks[key], ring))
        return out

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, S) int64
        attention_mask: torch.Tensor,  # (B, T) int64, T = past + S; 1 = real, 0 = left padding
        position_ids: torch.Tensor,  # (B, S) int64, computed by the caller
        past_key_values: KVCache | None = None,
        write_index: torch.Tensor | None = None,  # (B,) int64: static-capacity cache, write position per row
        output_hidden: bool = False,  # also return each layer's output (B, S, C) in float32, for localization
        last_only: bool = False,  # logits for the last position only (B, 1, V): what generation needs
        keep: torch.Tensor | None = None,  # (K,) int64: logits for these positions of the S only (B, K, V)
    ) -> tuple[torch.Tensor, KVCache] | tuple[torch.Tensor, KVCache, list[torch.Tensor]]:
        x = self.embed_inputs(input_ids)  # (B, S, C)
        inputs = self.layer_inputs(attention_mask, position_ids, input_ids.shape[1], x.dtype, write_index,
                                   past_key_values)
        present: KVCache = []
        hidden = []
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values is not None else None
            x, kv = layer(x, inputs[i], past, write_index)
            present.append(kv)
            if output_hidden:
                hidden.append(x.float())
        if last_only:  # left padding puts every row's newest token last
            x = x[:, -1:]
        elif keep is not None:  # a verify step's positions (contract.inputs' logits_to_keep)
            x = x.index_select(1, keep)
        logits = self.logits(self.norm(x))  # (B, S, V)
        return (logits, present, hidden) if output_hidden else (logits, present)
