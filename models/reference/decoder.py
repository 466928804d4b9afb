"""The reference decoder: LLaMA-style, written to export cleanly and to match Hugging Face.

Owns `Block` and `Decoder`; the layers they hold are attention.py's (Attention with MHA/GQA/MQA, sinks, per-layer
head sizes, KV-shared layers) and layers.py's (RMSNorm, gated FFN, mixture of experts, Gemma 4's per-layer
input). What families change are config fields read by small pieces, never a family's name: q/k norms per head
or per projection, the attention scale and softcap, pre-, post- or sandwich-norm branches, Granite's
multipliers, Gemma 4's per-layer inputs and layer scalars, and per layer (`DecoderConfig.layer`) its RoPE table
(global, local, none), its sliding window, its head sizes, whose cache it reads and whether its FFN is a
mixture of experts. Layers of one kind share what `Decoder.layer_inputs` computes once (RoPE's cos/sin, the
mask). `Decoder.forward` has no hidden state: the past cache comes in, the present cache goes out, exactly the
graph contract (models/spec/contract.py), where a sliding layer's static cache may be a ring of fewer positions
than the others' and a KV-shared layer has none. It knows nothing about checkpoints (models/checkpoint/loading.py)
or ONNX (exporters/).

Projections are stored concatenated (`wqkv`, `w_gate_up`): one matmul each in every backend.
The loader concatenates families that store them apart.

Where tokens sit (RoPE, the masks, the static cache's write) is models/reference/positions.py. ONNX Runtime's
fused kernels (tk export --target ort) live in models/reference/ort_kernels.py, which drives these same layers.
"""

from __future__ import annotations

import torch
from torch import nn

from tk.models.spec.config import DecoderConfig
from tk.models.reference.attention import Attention, LayerInputs
from tk.models.reference.layers import FeedForward, MoE, PerLayerInput, RMSNorm, times
from tk.models.reference.positions import causal_mask, ring_mask, rope_attention_factor, rope_cos_sin, rope_inv_freq
from tk.models.reference.recurrent import MIXERS

# per layer, its state: (key, value) of an attention layer, each (B, Hkv, T, D); a recurrent layer's carry
# (and matrix state): models/reference/recurrent.py
KVCache = list[tuple[torch.Tensor, ...]]


class Block(nn.Module):
    """Attention (or, in a hybrid's other layers, a recurrent mixer: `mixer`) then FFN, each a residual
    branch x + residual_multiplier * branch(x) whose RMSNorm is on the branch's input (pre-norm), on its
    output (post-norm: OLMo 2), or both (sandwich: Gemma 2/3/4, whose output norms are `attn_post_norm` and
    `ffn_post_norm`); then, in Gemma 4, the layer's per-layer input (`ple`) and a learned scalar (`tail`)."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        placement, norm = cfg.norm_placement, lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.attn_norm = norm()
        kind = cfg.mixer(layer)
        self.attn = Attention(cfg, layer) if kind == "attention" else None
        self.mixer = MIXERS[kind](cfg) if kind != "attention" else None
        self.attn_post_norm = norm() if placement == "sandwich" else None
        self.ffn_norm = norm()
        self.ffn = MoE(cfg) if cfg.layer(layer).moe else FeedForward(cfg, cfg.ffn_size(layer))
        self.ffn_post_norm = norm() if placement == "sandwich" else None
        self.pre_norm = placement != "post"
        self.residual_multiplier = cfg.residual_multiplier
        self.ple = PerLayerInput(cfg) if cfg.per_layer_input_size else None
        self.layer_scale = nn.Parameter(torch.ones(1)) if cfg.layer_scalars else None
        self.reads = cfg.layer(layer).reads  # a KV-shared layer: whose cache it reads

    def branch_in(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x) if self.pre_norm else x

    def branch_out(self, norm: RMSNorm, post: RMSNorm | None, y: torch.Tensor) -> torch.Tensor:
        """What a branch (its norm, its output norm if sandwiched) adds to the residual stream."""
        if post is not None:
            y = post(y)
        elif not self.pre_norm:
            y = norm(y)
        return y if self.residual_multiplier == 1.0 else times(y, self.residual_multiplier)

    def mix(self, x, inputs: LayerInputs, past, write_index=None, shared=None):
        """The token mixer on the normed input -> (its output, the layer's present state)."""
        if self.attn is not None:
            return self.attn(x, inputs, past, write_index, shared)
        return self.mixer(x, inputs.token_mask, past)

    @property
    def has_tail(self) -> bool:
        return self.ple is not None or self.layer_scale is not None

    def tail(self, h: torch.Tensor, per_layer: torch.Tensor | None) -> torch.Tensor:
        """What follows the FFN's residual add (Gemma 4): the per-layer input's branch, the layer's scalar."""
        if self.ple is not None:
            h = self.ple(h, per_layer)
        return h if self.layer_scale is None else h * self.layer_scale

    def forward(self, x, inputs: LayerInputs, past, write_index=None, shared=None, per_layer=None):
        a, present = self.mix(self.branch_in(self.attn_norm, x), inputs, past, write_index, shared)
        h = x + self.branch_out(self.attn_norm, self.attn_post_norm, a)
        y = self.ffn(self.branch_in(self.ffn_norm, h))
        return self.tail(h + self.branch_out(self.ffn_norm, self.ffn_post_norm, y), per_layer), present


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
        if cfg.per_layer_input_size:  # Gemma 4: a second embedding, num_layers inputs of per_layer_input_size a token
            width = cfg.num_layers * cfg.per_layer_input_size
            self.embed_per_layer = nn.Embedding(cfg.per_layer_vocab_size, width)
            self.per_layer_proj = nn.Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_norm = RMSNorm(cfg.per_layer_input_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.rope_local_theta is not None:  # the sliding layers' own table (Gemma 3, Gemma 4, OLMo 3)
            self.register_buffer("inv_freq_local", rope_inv_freq(cfg, "local"), persistent=False)
        self.rope_factors = {t: rope_attention_factor(cfg, t) for t in ("global", "local")}  # YaRN's on cos and sin

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def group(self, flat) -> KVCache:
        """Cache tensors in the contract's order -> per layer, its key and value, or its recurrent state."""
        out, at = [], 0
        for i in range(self.config.num_layers):
            n = self.config.cache_tensors(i)
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

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4's per-layer inputs (B, S, L, P): the token's own (a second embedding, scaled by sqrt(P) rounded
        to the dtype) plus the embeddings' projection (scaled by 1/sqrt(C), RMS-normed over P), times 1/sqrt(2)
        (Gemma4TextModel.get_per_layer_inputs and project_per_layer_inputs)."""
        cfg = self.config
        if not cfg.per_layer_input_size:
            return None
        shape = (*input_ids.shape, cfg.num_layers, cfg.per_layer_input_size)
        tokens = self.embed_per_layer(input_ids) * torch.tensor(cfg.per_layer_input_size**0.5, dtype=x.dtype)
        context = self.per_layer_norm(times(self.per_layer_proj(x), cfg.hidden_size**-0.5).reshape(shape))
        return times(context + tokens.reshape(shape), 2**-0.5)

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
                tables[kind.rope] = rope_cos_sin(position_ids, self.rope_table(kind.rope), dtype,
                                                 self.rope_factors[kind.rope])
            # a KV-shared layer reads its source's buffer (a ring where the source's is)
            slots = past[i if kind.reads is None else kind.reads][0].shape[2] if write_index is not None else None
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
        per_layer = self.per_layer_inputs(input_ids, x)  # (B, S, L, P) (Gemma 4), or None
        inputs = self.layer_inputs(attention_mask, position_ids, input_ids.shape[1], x.dtype, write_index,
                                   past_key_values)
        present: KVCache = []
        hidden = []
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values is not None else None
            shared = None if layer.reads is None else present[layer.reads]  # what its source wrote this step
            x, kv = layer(x, inputs[i], past, write_index, shared, None if per_layer is None else per_layer[:, :, i])
            present.append(kv)
            if output_hidden:
                hidden.append(x.float())
        if last_only:  # left padding puts every row's newest token last
            x = x[:, -1:]
        elif keep is not None:  # a verify step's positions (contract.inputs' logits_to_keep)
            x = x.index_select(1, keep)
        logits = self.logits(self.norm(x))  # (B, S, V)
        return (logits, present, hidden) if output_hidden else (logits, present)
