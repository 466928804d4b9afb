"""What a target or a quantizer needs of a `DecoderConfig` (models/spec/config.py): what ONNX Runtime's fused
kernels cannot express, and the K (input size) of every kind of quantized layer. Standard library only.
"""

from __future__ import annotations

from tk.models.spec.config import DecoderConfig


def fused_unsupported(cfg: DecoderConfig) -> list[str]:
    """What of a DecoderConfig ONNX Runtime's fused kernels cannot express (empty: the ort target can export it).
    A partial rotary embedding (Phi-3, Qwen3.5) is GroupQueryAttention's when its cos/sin tables are that narrow.
    q/k norms (over each head or the whole projections) and Gemma 4's value norm are applied to the packed qkv
    GroupQueryAttention reads; NoPE layers (SmolLM3) run it with do_rotary=0; each layer gets its own
    window (local_window_size), RoPE tables (Gemma 3, Gemma 4's wider full layers) and head sizes; Granite's and
    Gemma's scales are its `scale`, Gemma 2's softcap its `softcap`, gpt-oss's sinks its `head_sink` input; post
    and sandwich norms are plain RMSNorms; experts run as in the portable graphs; a KV-shared layer (Gemma 4),
    which writes no cache, attends with the standard ops."""
    dims = sorted({cfg.layer(i).head_dim for i in range(cfg.num_layers) if cfg.mixer(i) == "attention"})
    odd = [d for d in dims if d % 16]
    return [why for why, bad in (  # its CPU kernel: "head_size shall be a multiple of 16" (ONNX Runtime 1.32)
                                 (f"head_dim {', '.join(map(str, odd))} (GroupQueryAttention takes multiples of 16)", odd),
                                 # "cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8"
                                 (f"a rotary dim of {cfg.rotary_dim} (GroupQueryAttention rotates multiples of 16)",
                                  cfg.rotary_dim < cfg.head_dim and cfg.rotary_dim % 16)) if bad]


def layer_ks(cfg: DecoderConfig) -> dict[str, int]:
    """Each kind of quantized layer's K (its input size), named as an error message would."""
    ks = {"layers.*.attn.wqkv and layers.*.ffn.w_gate_up (hidden_size)": cfg.hidden_size,
          "layers.*.attn.wo (num_heads x head_dim)": cfg.num_heads * cfg.head_dim}
    if cfg.global_head_dim is not None:  # Gemma 4's full-attention layers
        ks["layers.*.attn.wo of full-attention layers (num_heads x global_head_dim)"] = cfg.num_heads * cfg.global_head_dim
    mixers = {cfg.mixer(i) for i in range(cfg.num_layers)}
    if "gdn" in mixers:
        ks["layers.*.mixer.w_out (linear_value_heads x linear_value_dim)"] = cfg.linear_value_heads * cfg.linear_value_dim
    if "mamba" in mixers:
        ks["layers.*.mixer.w_out (mamba_heads x mamba_head_dim)"] = cfg.mamba_heads * cfg.mamba_head_dim
    moe = [cfg.layer(i).moe for i in range(cfg.num_layers)]
    if not all(moe):
        ks["layers.*.ffn.w_down (intermediate_size)"] = cfg.intermediate_size
    if cfg.wide_shared_ffn and cfg.kv_shared_layers:
        ks["layers.*.ffn.w_down of KV-shared layers (2 x intermediate_size)"] = 2 * cfg.intermediate_size
    if any(moe):
        ks["layers.*.ffn.experts.*.w_down (expert_size)"] = cfg.expert_size
    if any(moe) and cfg.shared_expert_size:
        ks["layers.*.ffn.shared.w_down (shared_expert_size)"] = cfg.shared_expert_size
    return ks
