"""How a Hugging Face checkpoint's tensors become ours: `weight_map`, the one table of names.

Each of our parameters is made of parts concatenated along dim 0. A part is rows of one Hugging Face
tensor (`Part`): all of it, a range of its rows (Qwen3-Next's in_proj_qkvz keeps q, k, v and z
interleaved by key head), or one expert's slice of a tensor that stacks every expert (Granite
4.0-H's block_sparse_moe.input_linear: [experts, rows, hidden]). `hf_shapes` is the shape each
Hugging Face tensor must have; the reader (models/checkpoint/loading.py) and the presets
(models/fixtures/presets.py) read and write through the same table. A family's own names are its
row's `Names` (models/checkpoint/families.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tk.models.checkpoint.families import FAMILIES, ExpertNames, Names
from tk.models.reference.decoder import Decoder
from tk.models.spec.config import DecoderConfig, UnsupportedModelError

# a block's norms (ours -> Hugging Face's) by where they sit: before each branch, after (OLMo 2), or both
# (Gemma 2/3: there post_attention_layernorm is the attention's *output* norm)
BLOCK_NORMS = {"pre": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
               "post": {"attn_norm": "post_attention_layernorm", "ffn_norm": "post_feedforward_layernorm"},
               "sandwich": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                            "ffn_norm": "pre_feedforward_layernorm", "ffn_post_norm": "post_feedforward_layernorm"}}


class Part(NamedTuple):
    """`rows` rows of Hugging Face tensor `name`, from row `start`, every `step`-th (gpt-oss's gate and up rows
    alternate); of its slice `expert` where the tensor stacks `experts` of them ([experts, rows, ...]). With
    `transposed` the tensor (each expert's matrix) is stored [in, out]: our rows are its columns."""

    name: str
    rows: int
    start: int = 0
    expert: int | None = None
    experts: int = 0
    step: int = 1
    transposed: bool = False


def weight_map(cfg: DecoderConfig) -> dict[str, list[Part]]:
    """Our parameter name -> the Hugging Face tensors' rows concatenated (along dim 0) to make it.
    Fused families store the concatenation already."""
    C, V = cfg.hidden_size, cfg.vocab_size
    fam = FAMILIES[cfg.architecture]
    names = fam.names
    m: dict[str, list[Part]] = {"embed.weight": [Part(fam.prefix + "embed_tokens.weight", V)],
                                "norm.weight": [Part(fam.prefix + names.final_norm + ".weight", C)]}
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = [Part(fam.lm_head, V)]
    if cfg.per_layer_input_size:  # Gemma 4's per-layer inputs: their embedding, projection and its norm
        width = cfg.num_layers * cfg.per_layer_input_size
        m["embed_per_layer.weight"] = [Part(fam.prefix + "embed_tokens_per_layer.weight", cfg.per_layer_vocab_size)]
        m["per_layer_proj.weight"] = [Part(fam.prefix + "per_layer_model_projection.weight", width)]
        m["per_layer_norm.weight"] = [Part(fam.prefix + "per_layer_projection_norm.weight", cfg.per_layer_input_size)]
    for i in range(cfg.num_layers):
        hf, us = f"{fam.prefix}layers.{i}.", f"layers.{i}."
        for ours, theirs in (names.norms or BLOCK_NORMS[cfg.norm_placement]).items():
            m[us + ours + ".weight"] = [Part(hf + theirs + ".weight", C)]
        if cfg.mixer(i) == "attention":
            _attention(m, us + "attn.", hf + names.attn, cfg, i, names)
        else:
            _mixer(m, us + "mixer.", hf + names.mixer, cfg, cfg.mixer(i), names)
        if cfg.layer(i).moe:
            _experts(m, us + "ffn.", hf, cfg, fam.experts, cfg.architecture)
        else:
            _ffn(m, us + "ffn.", hf + names.mlp, names.ffn, cfg.ffn_size(i), C, cfg, names.fused_ffn)
        if cfg.per_layer_input_size:
            m[us + "ple.gate.weight"] = [Part(hf + "per_layer_input_gate.weight", cfg.per_layer_input_size)]
            m[us + "ple.proj.weight"] = [Part(hf + "per_layer_projection.weight", C)]
            m[us + "ple.norm.weight"] = [Part(hf + "post_per_layer_input_norm.weight", C)]
        if cfg.layer_scalars:
            m[us + "layer_scale"] = [Part(hf + "layer_scalar", 1)]
    return m


def _attention(m: dict, us: str, hf: str, cfg: DecoderConfig, layer: int, names: Names) -> None:
    """An attention layer's projections (a KV-shared layer's q alone; Gemma 4's full layers may take their values
    from the keys' projection), their norms and its sinks (gpt-oss)."""
    C, kind = cfg.hidden_size, cfg.layer(layer)
    q_size, kv_size = cfg.num_heads * kind.head_dim, kind.kv_heads * kind.head_dim
    q_rows = q_size * (2 if cfg.attn_output_gate else 1)  # Qwen3.5: each head's q, then its gate
    qkv = [("q", q_rows)] + ([] if kind.reads is not None else [("k", kv_size)] + [("v", kv_size)] * (not kind.values_from_keys))
    for what, on in (("weight", True), ("bias", cfg.qkv_bias)):
        if not on:
            continue
        if cfg.fused_projections:
            m[us + f"wqkv.{what}"] = [Part(hf + f"qkv_proj.{what}", q_size + 2 * kv_size)]
        else:
            m[us + f"wqkv.{what}"] = [Part(hf + f"{p}_proj.{what}", n) for p, n in qkv]
    m[us + "wo.weight"] = [Part(hf + names.o_proj + ".weight", C)]
    if cfg.o_bias:
        m[us + "wo.bias"] = [Part(hf + names.o_proj + ".bias", C)]
    if cfg.qk_norm:  # per head (D), or over the whole projection (OLMo 2: H*D and Hkv*D)
        q_dim, k_dim = (q_size, kv_size) if cfg.qk_norm == "projection" else (kind.head_dim, kind.head_dim)
        m[us + "q_norm.weight"] = [Part(hf + names.q_norm + ".weight", q_dim)]
        if kind.reads is None:
            m[us + "k_norm.weight"] = [Part(hf + names.k_norm + ".weight", k_dim)]
    if cfg.attention_sinks:
        m[us + "sinks"] = [Part(hf + "sinks", cfg.num_heads)]


def _mixer(m: dict, us: str, hf: str, cfg: DecoderConfig, kind: str, names: Names) -> None:
    """A recurrent layer's tensors (models/reference/recurrent.py): one input projection (w_in), the
    depthwise convolution, its per-head parameters, the gated norm, out_proj (w_out)."""
    C = cfg.hidden_size
    if kind == "conv":  # LFM2: in_proj (B, C, x), conv, out_proj, biases when conv_bias
        m[us + "w_in.weight"] = [Part(hf + "in_proj.weight", 3 * C)]
        m[us + "conv_weight"] = [Part(hf + "conv.weight", C)]
        m[us + "w_out.weight"] = [Part(hf + "out_proj.weight", C)]
        if cfg.conv_bias:
            m[us + "w_in.bias"] = [Part(hf + "in_proj.bias", 3 * C)]
            m[us + "conv_bias"] = [Part(hf + "conv.bias", C)]
            m[us + "w_out.bias"] = [Part(hf + "out_proj.bias", C)]
        return
    if kind == "gdn":
        hk, hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        if names.gdn_grouped:  # Qwen3-Next: per key head, (q, k, v, z) rows and (b, a) rows
            rep = hv // hk
            group, ba = 2 * dk + 2 * rep * dv, 2 * rep
            qkvz, ab = hf + "in_proj_qkvz.weight", hf + "in_proj_ba.weight"
            spans = [(0, dk), (dk, dk), (2 * dk, rep * dv), (2 * dk + rep * dv, rep * dv)]
            w_in = [Part(qkvz, n, g * group + at) for at, n in spans for g in range(hk)]
            w_in += [Part(ab, rep, g * ba + at) for at in (0, rep) for g in range(hk)]
        else:  # Qwen3.5: q, k and v in one projection, then z, b and a
            w_in = [Part(hf + f"in_proj_{p}.weight", n) for p, n in
                    (("qkv", cfg.gdn_conv_channels), ("z", hv * dv), ("b", hv), ("a", hv))]
        m[us + "w_in.weight"] = w_in
        m[us + "conv_weight"] = [Part(hf + "conv1d.weight", cfg.gdn_conv_channels)]
        m[us + "norm_gated.weight"] = [Part(hf + "norm.weight", dv)]
        m[us + "w_out.weight"] = [Part(hf + "out_proj.weight", C)]
        heads = hv
    else:  # Mamba2: in_proj (z, x B C, dt), conv1d (with its bias), D, norm over the inner size, out_proj
        inner = cfg.mamba_heads * cfg.mamba_head_dim
        rows = {"in_proj": inner + cfg.mamba_conv_channels + cfg.mamba_heads, "out_proj": C}
        for p, ours in (("in_proj", "w_in"), ("out_proj", "w_out")):
            m[us + f"{ours}.weight"] = [Part(hf + f"{p}.weight", rows[p])]
            if cfg.mamba_proj_bias:
                m[us + f"{ours}.bias"] = [Part(hf + f"{p}.bias", rows[p])]
        m[us + "conv_weight"] = [Part(hf + "conv1d.weight", cfg.mamba_conv_channels)]
        if cfg.conv_bias:
            m[us + "conv_bias"] = [Part(hf + "conv1d.bias", cfg.mamba_conv_channels)]
        m[us + "D"] = [Part(hf + "D", cfg.mamba_heads)]
        m[us + "norm_gated.weight"] = [Part(hf + "norm.weight", inner)]
        heads = cfg.mamba_heads
    m[us + "dt_bias"] = [Part(hf + "dt_bias", heads)]
    m[us + "A_log"] = [Part(hf + "A_log", heads)]


def _ffn(m: dict, ours: str, hf: str, names: tuple[str, str, str], width: int, hidden: int, cfg: DecoderConfig,
         fused: tuple[str, str] | None = None) -> None:
    """A gated FFN's entries: w_gate_up from gate and up (or a fused gate_up_proj, or the family's own
    fused pair: Granite 4.0-H's input_linear / output_linear), w_down."""
    gate, up, down = names
    if fused is not None:
        m[ours + "w_gate_up.weight"] = [Part(hf + f"{fused[0]}.weight", 2 * width)]
        m[ours + "w_down.weight"] = [Part(hf + f"{fused[1]}.weight", hidden)]
        return
    for kind, on in (("weight", True), ("bias", cfg.mlp_bias)):
        if not on:
            continue
        if cfg.fused_projections:
            m[ours + f"w_gate_up.{kind}"] = [Part(hf + f"gate_up_proj.{kind}", 2 * width)]
        else:
            m[ours + f"w_gate_up.{kind}"] = [Part(hf + f"{p}.{kind}", width) for p in (gate, up)]
        m[ours + f"w_down.{kind}"] = [Part(hf + f"{down}.{kind}", hidden)]


def _experts(m: dict, ours: str, hf: str, cfg: DecoderConfig, names: ExpertNames | None, arch: str) -> None:
    """An MoE layer: the router, each expert (its own tensors, or its slice of stacked ones), a shared expert."""
    if names is None:
        raise UnsupportedModelError(f"{arch} has no mixture-of-experts tensor names; tk reads "
                                    f"experts of {', '.join(a for a, f in FAMILIES.items() if f.experts)}")
    C, E = cfg.hidden_size, cfg.num_experts
    block = f"{hf}{names.block}."
    m[ours + "router.weight"] = [Part(block + names.router + ".weight", E)]
    if cfg.router_bias:
        m[ours + "router.bias"] = [Part(block + names.router + ".bias", E)]
    for e in range(E):
        if names.stacked:  # [experts, rows, hidden] tensors (or [experts, hidden, rows], transposed): expert e's
            _stacked_expert(m, f"{ours}experts.{e}.", block, names, e, cfg)
        else:
            _ffn(m, f"{ours}experts.{e}.", f"{block}experts.{e}.", (names.gate, names.up, names.down), cfg.expert_size,
                 C, cfg)
    if cfg.shared_expert_size:  # Qwen2-MoE, Qwen3-Next (gated), Granite 4.0-H (added)
        _ffn(m, ours + "shared.", hf + names.shared, ("gate_proj", "up_proj", "down_proj"), cfg.shared_expert_size,
             C, cfg, names.shared_fused)
        if cfg.shared_expert_gated:
            m[ours + "shared_gate.weight"] = [Part(hf + names.shared_gate + ".weight", 1)]


def _stacked_expert(m: dict, ours: str, block: str, names: ExpertNames, e: int, cfg: DecoderConfig) -> None:
    """Expert e's slices of the stacked tensors: gate and up (one after the other, or interleaved row by row),
    down, and their biases (gpt-oss)."""
    I, E = cfg.expert_size, cfg.num_experts
    for what, suffix, transposed in (("weight", names.suffixes[0], names.transposed), ("bias", names.suffixes[1], False)):
        if what == "bias" and not cfg.mlp_bias:
            continue
        gate_up = block + names.gate + suffix
        m[f"{ours}w_gate_up.{what}"] = ([Part(gate_up, I, start, e, E, 2, transposed) for start in (0, 1)]
                                        if names.interleaved else [Part(gate_up, 2 * I, 0, e, E, 1, transposed)])
        m[f"{ours}w_down.{what}"] = [Part(block + names.down + suffix, cfg.hidden_size, 0, e, E, 1, transposed)]


def hf_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The shape every Hugging Face tensor must have for this config: its parts' rows (one expert's,
    times the experts it stacks; a transposed tensor's rows last)."""
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in Decoder(cfg).state_dict().items()}
    rows: dict[str, int] = {}
    rest: dict[str, tuple[int, ...]] = {}
    stacked: dict[str, int] = {}
    transposed: set[str] = set()
    for key, parts in weight_map(cfg).items():
        for p in parts:
            if p.expert not in (None, 0):
                continue  # one expert's rows give the stacked tensor's
            rows[p.name] = rows.get(p.name, 0) + p.rows
            rest[p.name] = ours[key][1:]
            if p.experts:
                stacked[p.name] = p.experts
            if p.transposed:
                transposed.add(p.name)
    return {n: ((stacked[n],) if n in stacked else ()) + ((*rest[n], rows[n]) if n in transposed else (rows[n], *rest[n]))
            for n in rows}
