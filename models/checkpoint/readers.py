"""How a family's config.json keys become `DecoderConfig` fields where that is more than a lookup: the
reader functions a row of models/checkpoint/families.py names (its layers' kinds, its experts, a hybrid's
recurrent layers), each as transformers' config class derives them. Nothing here knows about weights.
"""

from __future__ import annotations

from tk.models.spec.config import UnsupportedModelError


def smollm3_layer_types(hf: dict, rope_layers: list[bool] | None) -> list[str]:
    """SmolLM3Config's default: the layers without RoPE slide."""
    return ["sliding_attention" if not r else "full_attention" for r in rope_layers or []]


def gemma_layer_types(pattern_key: str | None, pattern: int):
    """Gemma 2 (every second layer global) and Gemma 3 (every `sliding_window_pattern`-th, 6 by default):
    layer i slides unless (i + 1) % pattern == 0 (Gemma2Config / Gemma3TextConfig.__init__)."""
    def types(hf: dict, rope_layers) -> list[str]:
        every = int(hf.get(pattern_key, hf.get("_" + pattern_key, pattern)) if pattern_key else pattern)
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(hf["num_hidden_layers"])]
    return types


def moe_mixtral(hf: dict, num_layers: int) -> dict:
    """Mixtral: every layer routes over num_local_experts FFNs of intermediate_size, renormalized top-k."""
    return dict(num_experts=hf.get("num_local_experts", hf.get("num_experts")), experts_per_token=hf.get("num_experts_per_tok"),
                expert_size=hf.get("intermediate_size"), renormalize_experts=True)


def moe_qwen(hf: dict, num_layers: int) -> dict:
    """Qwen2-MoE and Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, on every
    decoder_sparse_step-th layer (the others are dense FFNs of intermediate_size); experts of
    moe_intermediate_size, renormalized when norm_topk_prob; a gated shared expert (Qwen2-MoE)."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # Qwen3MoeConfig saves the latter
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    layers = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    if not any(layers):
        return {}
    return dict(num_experts=experts, experts_per_token=hf.get("num_experts_per_tok"),
                expert_size=hf.get("moe_intermediate_size"), renormalize_experts=bool(hf.get("norm_topk_prob", False)),
                shared_expert_size=hf.get("shared_expert_intermediate_size") or 0, moe_layers=layers)


def moe_qwen35(hf: dict, num_layers: int) -> dict:
    """Qwen3.5-MoE: every layer routes, top-k always renormalized (its router has no norm_topk_prob), a gated
    shared expert."""
    return moe_qwen({**hf, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}, num_layers)


def layer_types(hf: dict, linear: str, attention_every: int | None = None) -> list[str]:
    """A hybrid's mixers (models/spec/config.py MIXERS) from its config's layer_types, where transformers 5
    calls every recurrent layer "linear_attention" (an older config: "mamba", "conv") and every attention
    layer "full_attention" ("attention"); without layer_types, every `attention_every`-th layer attends."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or hf.get("layers_block_type")
    if not types:
        every = attention_every or 1
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    mixers = {"full_attention": "attention", "attention": "attention", "linear_attention": linear, "mamba": linear,
              "conv": linear}
    unknown = [t for t in types if t not in mixers]
    if unknown:
        raise UnsupportedModelError(f"layer type {unknown[0]!r} is not supported in {hf['architectures'][0]}")
    return [mixers[t] for t in types]


def hybrid_lfm2(hf: dict) -> dict:
    """LFM2: short convolutions (conv_L_cache wide) between attention layers (layer_types, or full_attn_idxs);
    the FFN's width adjusted as Lfm2MLP does (two thirds, times block_ffn_dim_multiplier, rounded up)."""
    n = hf["num_hidden_layers"]
    if not hf.get("layer_types") and hf.get("full_attn_idxs") is not None:
        hf = {**hf, "layer_types": ["full_attention" if i in hf["full_attn_idxs"] else "conv" for i in range(n)]}
    width = hf.get("intermediate_size") or hf.get("block_ff_dim")
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if hf.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiple = hf.get("block_multiple_of", 256)
            width = int(hf.get("block_ffn_dim_multiplier", 1.0) * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return dict(layer_types=layer_types(hf, "conv"), conv_kernel=hf.get("conv_L_cache", 3),
                conv_bias=bool(hf.get("conv_bias", False)), intermediate_size=width,
                rms_norm_eps=float(hf.get("norm_eps", 1e-5)))


def hybrid_qwen35(hf: dict) -> dict:
    """Qwen3.5 and Qwen3-Next: gated DeltaNet layers, every full_attention_interval-th layer a gated attention
    one (Qwen3_5TextConfig's defaults where a key is left out)."""
    return dict(layer_types=layer_types(hf, "gdn", hf.get("full_attention_interval", 4)),
                conv_kernel=hf.get("linear_conv_kernel_dim", 4), linear_key_heads=hf.get("linear_num_key_heads", 16),
                linear_value_heads=hf.get("linear_num_value_heads", 32), linear_key_dim=hf.get("linear_key_head_dim", 128),
                linear_value_dim=hf.get("linear_value_head_dim", 128))


def hybrid_granite(hf: dict) -> dict:
    """Granite 4.0-H: Mamba2 layers (mamba_*; mamba_d_head "auto" is mamba_expand * hidden / heads) and
    attention layers, with RoPE only where position_embedding_type is "rope"; a shared MLP in every layer,
    added to the experts where num_local_experts > 0, else the layer's FFN."""
    n, heads = hf["num_hidden_layers"], hf.get("mamba_n_heads", 128)
    d_head = hf.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = hf.get("mamba_expand", 2) * hf["hidden_size"] // heads
    # transformers 5 writes infinity as {"__float__": "Infinity"}
    limit = [float(x["__float__"] if isinstance(x, dict) else x) for x in hf.get("time_step_limit") or ()]
    fields = dict(layer_types=layer_types(hf, "mamba"), conv_kernel=hf.get("mamba_d_conv", 4),
                  conv_bias=bool(hf.get("mamba_conv_bias", True)), mamba_heads=heads, mamba_head_dim=d_head,
                  mamba_state=hf.get("mamba_d_state", 256), mamba_groups=hf.get("mamba_n_groups", 1),
                  mamba_proj_bias=bool(hf.get("mamba_proj_bias", False)),
                  mamba_dt_limit=None if not limit or tuple(limit) == (0.0, float("inf")) else limit)
    if hf.get("position_embedding_type") != "rope":
        fields["rope_layers"] = [False] * n
    experts, shared = hf.get("num_local_experts", 8) or 0, hf.get("shared_intermediate_size", 1024)
    if experts:
        fields.update(num_experts=experts, experts_per_token=hf.get("num_experts_per_tok", 2),
                      expert_size=hf.get("intermediate_size"), renormalize_experts=True, shared_expert_size=shared)
    else:
        fields["intermediate_size"] = shared
    return fields


def moe_gpt_oss(hf: dict, num_layers: int) -> dict:
    """gpt-oss: every layer routes over num_local_experts FFNs of intermediate_size, a softmax over the top k
    router logits; its experts' clamped SwiGLU (GptOssExperts._apply_gate)."""
    return dict(num_experts=hf.get("num_local_experts", 128), experts_per_token=hf.get("num_experts_per_tok", 4),
                expert_size=hf.get("intermediate_size"), swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def gemma4_layer_types(hf: dict, rope_layers) -> list[str]:
    """Gemma4TextConfig's default: five sliding layers to one full, and the last layer always full."""
    types = gemma_layer_types(None, 6)(hf, rope_layers)
    return types[:-1] + ["full_attention"]


def gemma4(hf: dict) -> dict:
    """Gemma 4's text: the full-attention layers' head sizes (transformers 5.25 saves them as per_layer_config,
    released configs as global_head_dim and num_global_key_value_heads, the latter only with attention_k_eq_v),
    the KV-shared last layers, per-layer inputs and layer scalars."""
    arch = hf["architectures"][0]
    if hf.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(f"{arch} with use_bidirectional_attention='all' is not supported (a causal "
                                    "decoder's cache)")
    if hf.get("enable_moe_block"):
        raise UnsupportedModelError(f"{arch} with enable_moe_block=true (its dense FFN beside routed experts, Gemma 4 "
                                    "26B-A4B) is not supported")
    types = hf.get("layer_types") or gemma4_layer_types(hf, None)
    full = {i for i, t in enumerate(types) if t == "full_attention"}
    k_eq_v = bool(hf.get("attention_k_eq_v"))
    overrides = {int(i): o for i, o in (hf.get("per_layer_config") or {}).items()}
    if overrides:
        sizes = {(o.get("head_dim"), o.get("num_key_value_heads")) for o in overrides.values()}
        if set(overrides) != full or len(sizes) != 1 or any(set(o) - {"head_dim", "num_key_value_heads"}
                                                            for o in overrides.values()):
            raise UnsupportedModelError(f"{arch}'s per_layer_config sets more than the full-attention layers' head "
                                        "sizes, which is all tk reads")
        head_dim, kv_heads = sizes.pop()
    else:
        head_dim = hf.get("global_head_dim", 512)
        kv_heads = hf.get("num_global_key_value_heads") if k_eq_v else None
    per_layer = hf.get("hidden_size_per_layer_input") or 0
    return dict(global_head_dim=head_dim, global_kv_heads=kv_heads, kv_shared_layers=hf.get("num_kv_shared_layers") or 0,
                values_from_keys=k_eq_v, per_layer_input_size=per_layer,
                per_layer_vocab_size=hf.get("vocab_size_per_layer_input") if per_layer else None, layer_scalars=True,
                wide_shared_ffn=bool(hf.get("use_double_wide_mlp")))
