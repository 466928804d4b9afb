"""The tables of what a `DecoderConfig` (models/spec/config.py) may say, the checks it passes when it is made, and
the normalizations they make (derived sizes filled only where unset, per-layer lists of all-true spelled None).
A bad field is a one-line ValueError; a family tk does not implement, an UnsupportedModelError.
"""

from __future__ import annotations

from tk.models.spec.errors import TkError

# "yarn": gpt-oss, OLMo 3's full layers (its attention factor scales cos and sin); "proportional": Gemma 4's full
# layers (a leading share of each head's frequencies rotate, the rest are 0: the whole head in the half-split layout)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# what mixes a layer's tokens (DecoderConfig.layer_types): attention over a KV cache, or a layer whose state
# is not a cache that grows: LFM2's gated short convolution ("conv": a carry of conv_kernel - 1 positions),
# the gated DeltaNet of Qwen3.5 / Qwen3-Next ("gdn": a carry and a d_k x d_v matrix per value head), and
# Mamba2 ("mamba": a carry and a d_state x head_dim matrix per head, Granite 4.0-H)
MIXERS = ("attention", "conv", "gdn", "mamba")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
QK_NORMS = ("head", "projection")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
PER_LAYER = ("rope_layers", "sliding_layers", "moe_layers")  # list fields with one entry per layer
# how a router turns its logits into weights: a softmax over every expert then the top k (renormalized when
# renormalize_experts), or the top k logits then a softmax over them (gpt-oss)
ROUTINGS = ("softmax_topk", "topk_softmax")


class UnsupportedModelError(TkError, ValueError):
    """The checkpoint describes a model tk does not implement."""


def check_config(cfg) -> None:
    """Every check of `cfg` (a DecoderConfig being made: it calls this), in the order a field's derived values need."""
    _sizes(cfg)
    _per_layer(cfg)
    _experts(cfg)
    if isinstance(cfg.qk_norm, bool):  # manifests written before "projection" existed
        cfg.qk_norm = "head" if cfg.qk_norm else None
    for name, value, allowed in (("qk_norm", cfg.qk_norm, (None, *QK_NORMS)),
                                 ("norm_placement", cfg.norm_placement, NORM_PLACEMENTS),
                                 ("routing", cfg.routing, ROUTINGS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_scale", "attn_softcap",
                 "final_softcap", "swiglu_limit"):
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    _mixers(cfg)
    _layer_heads(cfg)
    if cfg.hidden_act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"activation {cfg.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )
    rope_type = (cfg.rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"),
             "yarn": ("original_max_position_embeddings",)}.get(rope_type, ())
    missing = [key for key in needs if (cfg.rope_scaling or {}).get(key) is None]
    if missing:
        raise ValueError(f"rope type {rope_type} needs {', '.join(missing)} in its parameters")


def _sizes(cfg) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "max_position_embeddings"):
        _require_positive(name, getattr(cfg, name))
    if cfg.num_kv_heads is None:
        cfg.num_kv_heads = cfg.num_heads
    _require_positive("num_kv_heads", cfg.num_kv_heads)
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"num_heads ({cfg.num_heads}) must be divisible by num_kv_heads ({cfg.num_kv_heads})"
        )
    if cfg.head_dim is None:
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(
                f"hidden_size ({cfg.hidden_size}) is not divisible by num_heads ({cfg.num_heads}); "
                "set head_dim explicitly"
            )
        cfg.head_dim = cfg.hidden_size // cfg.num_heads
    _require_positive("head_dim", cfg.head_dim)
    if cfg.rms_norm_eps <= 0:
        raise ValueError(f"rms_norm_eps must be positive, got {cfg.rms_norm_eps}")
    if not 0.0 < cfg.partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {cfg.partial_rotary_factor}")
    if cfg.rotary_dim % 2:
        raise ValueError(f"rotary dim head_dim * partial_rotary_factor = {cfg.rotary_dim} must be even")
    if cfg.sliding_window is not None:
        _require_positive("sliding_window", cfg.sliding_window)
    if cfg.rope_local_theta is not None and not cfg.rope_local_theta > 0:
        raise ValueError(f"rope_local_theta must be positive, got {cfg.rope_local_theta!r}")


def _per_layer(cfg) -> None:
    for name in PER_LAYER:
        flags = getattr(cfg, name)
        if flags is None:
            continue
        if len(flags) != cfg.num_layers:
            raise ValueError(f"{name} has {len(flags)} entries for {cfg.num_layers} layers")
        flags = [bool(f) for f in flags]
        setattr(cfg, name, None if all(flags) else flags)  # every layer: the usual model, spelled once
    if cfg.sliding_window is None and cfg.sliding_layers is not None:
        raise ValueError("sliding_layers needs sliding_window: how many keys a sliding layer's query sees")


def _experts(cfg) -> None:
    if cfg.num_experts:
        _require_positive("num_experts", cfg.num_experts)
        _require_positive("experts_per_token", cfg.experts_per_token)
        if cfg.experts_per_token > cfg.num_experts:
            raise ValueError(f"experts_per_token ({cfg.experts_per_token}) exceeds num_experts ({cfg.num_experts})")
        if cfg.expert_size is None:
            cfg.expert_size = cfg.intermediate_size
        _require_positive("expert_size", cfg.expert_size)
    elif cfg.moe_layers is not None or cfg.shared_expert_size or cfg.router_bias:
        raise ValueError("moe_layers and shared_expert_size describe experts (and router_bias); set num_experts")


def _layer_heads(cfg) -> None:
    """Gemma 4's fields: wider full-attention heads, KV-shared layers, per-layer inputs."""
    for name in ("global_head_dim", "global_kv_heads", "per_layer_vocab_size"):
        if getattr(cfg, name) is not None:
            _require_positive(name, getattr(cfg, name))
    if cfg.global_kv_heads is not None and cfg.num_heads % cfg.global_kv_heads:
        raise ValueError(f"num_heads ({cfg.num_heads}) must be divisible by global_kv_heads ({cfg.global_kv_heads})")
    if cfg.per_layer_input_size < 0 or not 0 <= cfg.kv_shared_layers < cfg.num_layers:
        raise ValueError(f"per_layer_input_size ({cfg.per_layer_input_size}) must be >= 0 and kv_shared_layers "
                         f"({cfg.kv_shared_layers}) in [0, num_layers)")
    if cfg.per_layer_input_size and cfg.per_layer_vocab_size is None:
        cfg.per_layer_vocab_size = cfg.vocab_size
    if cfg.kv_shared_layers and cfg.stateful:
        raise UnsupportedModelError("KV-shared layers in a model with recurrent layers are not supported")
    for i in range(cfg.num_layers - cfg.kv_shared_layers, cfg.num_layers):
        cfg.kv_source(i)  # raises where no earlier layer of its kind keeps a cache
    if cfg.global_head_dim not in (None, cfg.head_dim) and cfg.rope_local_theta is None and any(
            cfg.layer(i).rope == "global" and cfg.layer(i).window is not None for i in range(cfg.num_layers)):
        raise ValueError("global_head_dim needs the sliding layers' RoPE table of their own (rope_local_theta): "
                         "a table is as wide as its layers' heads")


def _mixers(cfg) -> None:
    if cfg.layer_types is None:
        return
    if len(cfg.layer_types) != cfg.num_layers:
        raise ValueError(f"layer_types has {len(cfg.layer_types)} entries for {cfg.num_layers} layers")
    unknown = sorted(set(cfg.layer_types) - set(MIXERS))
    if unknown:
        raise UnsupportedModelError(f"layer type {unknown[0]!r} is not supported; supported: {', '.join(MIXERS)}")
    cfg.layer_types = list(cfg.layer_types)
    if all(t == "attention" for t in cfg.layer_types):
        cfg.layer_types = None  # the usual model, spelled once
        return
    _require_positive("conv_kernel", cfg.conv_kernel)
    # each recurrent mixer's sizes, and (heads, what they come in groups of)
    sizes = {"gdn": (("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim"),
                     ("linear_value_heads", "linear_key_heads")),
             "mamba": (("mamba_heads", "mamba_head_dim", "mamba_state", "mamba_groups"), ("mamba_heads", "mamba_groups"))}
    for mixer, (names, (heads, groups)) in sizes.items():
        if mixer not in cfg.layer_types:
            continue
        for name in names:
            _require_positive(name, getattr(cfg, name))
        if getattr(cfg, heads) % getattr(cfg, groups):
            raise ValueError(f"{heads} ({getattr(cfg, heads)}) must be a multiple of {groups} ({getattr(cfg, groups)})")


def _require_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
