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
    """`rows` rows of Hugging Face tensor `name`, from row `start`; of its slice `expert` where the tensor
    stacks `experts` of them ([experts, rows, ...])."""

    name: str
    rows: int
    start: int = 0
    expert: int | None = None
    experts: int = 0


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
    for i in range(cfg.num_layers):
        hf, us = f"{fam.prefix}layers.{i}.", f"layers.{i}."
        for ours, theirs in (names.norms or BLOCK_NORMS[cfg.norm_placement]).items():
            m[us + ours + ".weight"] = [Part(hf + theirs + ".weight", C)]
        if cfg.mixer(i) == "attention":
            _attention(m, us + "attn.", hf + names.attn, cfg, names)
        else:
            _mixer(m, us + "mixer.", hf + names.mixer, cfg, cfg.mixer(i), names)
        if cfg.layer(i).moe:
            _experts(m, us + "ffn.", hf, cfg, fam.experts, cfg.architecture)
        else:
            _ffn(m, us + "ffn.", hf + names.mlp, names.ffn, cfg.intermediate_size, C, cfg, names.fused_ffn)
    return m


def _attention(m: dict, us: str, hf: str, cfg: DecoderConfig, names: Names) -> None:
    C = cfg.hidden_size
    q_rows = cfg.q_size * (2 if cfg.attn_output_gate else 1)  # Qwen3.5: each head's q, then its gate
    qkv = [("q", q_rows), ("k", cfg.kv_size), ("v", cfg.kv_size)]
    for kind, on in (("weight", True), ("bias", cfg.qkv_bias)):
        if not on:
            continue
        if cfg.fused_projections:
            m[us + f"wqkv.{kind}"] = [Part(hf + f"qkv_proj.{kind}", cfg.q_size + 2 * cfg.kv_size)]
        else:
            m[us + f"wqkv.{kind}"] = [Part(hf + f"{p}_proj.{kind}", n) for p, n in qkv]
    m[us + "wo.weight"] = [Part(hf + names.o_proj + ".weight", C)]
    if cfg.o_bias:
        m[us + "wo.bias"] = [Part(hf + names.o_proj + ".bias", C)]
    if cfg.qk_norm:  # per head (D), or over the whole projection (OLMo 2: H*D and Hkv*D)
        q_dim, k_dim = (cfg.q_size, cfg.kv_size) if cfg.qk_norm == "projection" else (cfg.head_dim, cfg.head_dim)
        m[us + "q_norm.weight"] = [Part(hf + names.q_norm + ".weight", q_dim)]
        m[us + "k_norm.weight"] = [Part(hf + names.k_norm + ".weight", k_dim)]


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
    for e in range(E):
        if names.stacked:  # [experts, rows, hidden] tensors: expert e's slice
            m[f"{ours}experts.{e}.w_gate_up.weight"] = [Part(block + names.gate + ".weight", 2 * cfg.expert_size, 0, e, E)]
            m[f"{ours}experts.{e}.w_down.weight"] = [Part(block + names.down + ".weight", C, 0, e, E)]
        else:
            _ffn(m, f"{ours}experts.{e}.", f"{block}experts.{e}.", (names.gate, names.up, names.down), cfg.expert_size,
                 C, cfg)
    if cfg.shared_expert_size:  # Qwen2-MoE, Qwen3-Next (gated), Granite 4.0-H (added)
        _ffn(m, ours + "shared.", hf + names.shared, ("gate_proj", "up_proj", "down_proj"), cfg.shared_expert_size,
             C, cfg, names.shared_fused)
        if cfg.shared_expert_gated:
            m[ours + "shared_gate.weight"] = [Part(hf + names.shared_gate + ".weight", 1)]


def hf_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The shape every Hugging Face tensor must have for this config: its parts' rows (one expert's,
    times the experts it stacks)."""
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in Decoder(cfg).state_dict().items()}
    rows: dict[str, int] = {}
    rest: dict[str, tuple[int, ...]] = {}
    stacked: dict[str, int] = {}
    for key, parts in weight_map(cfg).items():
        for p in parts:
            if p.expert not in (None, 0):
                continue  # one expert's rows give the stacked tensor's
            rows[p.name] = rows.get(p.name, 0) + p.rows
            rest[p.name] = ours[key][1:]
            if p.experts:
                stacked[p.name] = p.experts
    return {n: ((stacked[n],) if n in stacked else ()) + (rows[n], *rest[n]) for n in rows}
