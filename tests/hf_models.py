"""Tiny Hugging Face checkpoints for every supported family, made with `transformers` itself.

Weights are drawn much wider than HF's default init (std 0.2 at hidden 64, i.e. 1.6/sqrt(hidden);
at 0.08 several families' greedy output collapses to one repeated token) and every vector is
jittered, so logits are not flat, greedy ties are rare, generation is varied enough to expose a
cache bug, and a loader that ignores a norm weight or a bias fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tk.models.fixtures.presets import train_tokenizer

VOCAB = 384
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               max_position_embeddings=256, eos_token_id=0, pad_token_id=1, bos_token_id=None)

# family -> (transformers config class name, model class name, extra config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, sliding_window=12, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True,
        use_sliding_window=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
        tie_word_embeddings=False, sliding_window=None)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, hidden_activation="gelu_pytorch_tanh",
        hidden_act="gelu_pytorch_tanh")),
}
# Families exported once each by tests/test_families.py (portable and --for ort-cpu), not by every
# per-family export test over FAMILIES (test_export, test_parity, test_quantized: 10-20 s an export);
# the torch-only tests over ALL (tests/test_models.py) cover them like the rest.
EXPORTED_ONCE = {
    # every multiplier away from 1, and the attention scale away from 1/sqrt(D) = 0.25
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0)),
    # post-norm blocks, q/k norms over the whole projections
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    # no_rope_layers from the interval: 1, 0, 1, 0, ... (layer 1 has no RoPE), at any depth
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, no_rope_layer_interval=2,
        use_sliding_window=False)),
}
# The families of the families issue (docs/families.md): sliding windows of 8, so that a prompt of 9 and 24
# new tokens cross a window three times; exported by tests/test_families.py (the acceptance matrix runs
# with -m families; CI's gate exports one Gemma-style and one MoE model).
WINDOWED = {
    # sandwich norms, both softcaps, query_pre_attn_scalar != head_dim, layer 0 slides. Untied: with a tied head
    # and post-norms a tiny random Gemma echoes its last token (its scaled embedding outweighs every branch)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        tie_word_embeddings=False,
        attn_logit_softcapping=5.0, final_logit_softcapping=7.0, hidden_activation="gelu_pytorch_tanh")),
    # per-head (1 + w) q/k norms, a local RoPE base of its own (the global one scaled), 2 local : 1 global
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        tie_word_embeddings=False,
        sliding_window_pattern=3, final_logit_softcapping=9.0, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # 4 experts, top 2 renormalized, a window on every layer
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        tie_word_embeddings=False)),
    # top 2 not renormalized, a gated shared expert, layer 1 dense (mlp_only_layers)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
        tie_word_embeddings=False, use_sliding_window=False)),
    # per-head q/k norms, head_dim != hidden / heads (32: GroupQueryAttention takes multiples of 16), top 2
    # renormalized
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=False, use_sliding_window=False)),
}
# Gemma 3's image-text checkpoint (4B and up): the decoder's config nested as text_config, its tensors under
# language_model., beside a vision tower tk ignores; no final softcap (Gemma3ForConditionalGeneration has none)
MULTIMODAL = {
    "gemma3_mm": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        text_config=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         query_pre_attn_scalar=24, sliding_window_pattern=3, final_logit_softcapping=9.0,
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=383, boi_token_index=381, eoi_token_index=382,
        tie_word_embeddings=False)),
}
# The hybrids (tests/test_hybrids.py): layers whose state is not a KV cache, each family with an attention layer
# among its recurrent ones, and a context of 2048 (prompts of 1,100 tokens). Qwen3.5's partial rotary (a quarter)
# of a head_dim of 64 is 16 dims, what GroupQueryAttention rotates.
_QWEN35 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
               max_position_embeddings=2048)
HYBRIDS = {
    # short convolutions (conv_L_cache 3) and one attention layer; the FFN width adjusted as LFM2's (128 here)
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=192, block_multiple_of=32,
        layer_types=["conv", "full_attention", "conv", "conv"], max_position_embeddings=2048)),
    # three gated DeltaNet layers (2 key heads, 4 value heads), then a gated attention layer
    "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _QWEN35),
    # the same with experts and a gated shared expert, its DeltaNet projections grouped by key head
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _QWEN35, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    # Mamba2 layers in 2 groups of B and C, one attention layer without RoPE, experts beside a shared MLP, and
    # every multiplier away from 1
    "granite_h": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "mamba", "attention", "mamba"],
        mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48, embedding_multiplier=4.0,
        residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0, tie_word_embeddings=False,
        max_position_embeddings=2048)),
}
# loaded the way users have them, compared with transformers on the torch backend (tests/test_hybrids.py)
HYBRIDS_LOADED = {
    "qwen35_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        _QWEN35, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "qwen35_mm": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
        text_config=_QWEN35, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                out_hidden_size=64))),
}
# The attention families of 2026 (tests/test_attention_2026.py): windows of 8 (prompts cross them several times) and
# a context of 2048 (prompts of 1,100 tokens). gpt-oss: sinks, biased attention, a sliding then a full layer, YaRN,
# 4 experts (top 2, 64 wide: MXFP4 blocks are 32) with a router bias and a SwiGLU clamped at 1.5 (so that the clamp
# bites at these sizes).
# Gemma 4: per-layer inputs, full layers with a head twice as wide (32) and one kv head whose values are their keys'
# projection (attention_k_eq_v), the last two layers reading layers 0's and 1's caches with FFNs twice as wide, a
# final softcap; untied (tied, a tiny random Gemma echoes one token: WINDOWED's note on Gemma 2). OLMo 3: three sliding layers to one full, YaRN on the full one only, with its own attention factor.
ATTENTION_2026 = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=64, sliding_window=8, swiglu_limit=1.5, tie_word_embeddings=False, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 512, "rope_theta": 10000.0})),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=9.0, tie_word_embeddings=False, max_position_embeddings=2048)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False,
        max_position_embeddings=2048,
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                                            "attention_factor": 1.2, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}
# Gemma 4's image-text checkpoint: its text model alone (tensors under model.language_model., beside a vision
# tower tk ignores), compared with transformers on the torch backend
ATTENTION_2026_LOADED = {
    "gemma4_mm": ("Gemma4Config", "Gemma4ForConditionalGeneration", dict(
        text_config=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, final_logit_softcapping=9.0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        audio_config=None, tie_word_embeddings=False)),
}
LAYERS = {"gemma3": 3, "gemma3_mm": 3, **{f: 4 for f in [*HYBRIDS, *HYBRIDS_LOADED]}, "gemma4": 4, "olmo3": 4,
          "gemma4_mm": 3}  # deeper than 2 layers
# A second Llama: linear rope scaling, tied embeddings, MQA.
EXTRA = {
    "llama-linear-tied-mqa": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
}
ALL = {**FAMILIES, **EXPORTED_ONCE, **WINDOWED, **MULTIMODAL, **EXTRA, **HYBRIDS, **HYBRIDS_LOADED, **ATTENTION_2026,
       **ATTENTION_2026_LOADED}
# families whose RMSNorms scale by (1 + w) (their weights start at zero), but for Qwen's gated norm and Gemma 4's
# (plain weights)
_OFFSET_NORMS = ("Gemma", "Qwen3_5", "Qwen3Next")


def jitter_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() > 1:
                p.copy_(0.2 * noise)
            elif "norm" in name:
                kind = type(model).__name__
                offset = kind.startswith(_OFFSET_NORMS) and not kind.startswith("Gemma4") and "linear_attn.norm" not in name
                p.copy_((0.0 if offset else 1.0) + 0.1 * noise)
            elif name.endswith("sinks"):  # gpt-oss: a logit per head beside the scores, of their size
                p.copy_(noise)
            else:
                p.copy_(0.05 * noise)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4: each layer's output times its own scalar (1 at init)
                b.copy_(0.75 + 0.5 * torch.rand(b.shape, generator=g))


def make_checkpoint(family: str, folder: Path, seed: int = 0, layers: int | None = None) -> Path:
    """Save a jittered tiny `transformers` model of `family` with a trained tokenizer."""
    import transformers

    cfg_cls, model_cls, extra = ALL[family]
    common = {**_COMMON, "num_hidden_layers": layers or LAYERS.get(family, 2)}
    if "text_config" in extra:  # a multimodal checkpoint: the decoder's config is nested
        extra, common = {**extra, "text_config": {**common, **extra["text_config"]}}, {}
    common = {k: v for k, v in common.items() if k not in extra}  # a family's own value wins
    cfg = getattr(transformers, cfg_cls)(**common, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    jitter_(model, seed)
    folder = Path(folder)
    model.save_pretrained(folder)
    train_tokenizer(folder, VOCAB)
    return folder


def load_hf(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(folder: Path, prompt: list[int], n: int, hf=None) -> list[int]:
    """transformers' own greedy `generate`: exactly n new tokens for one unpadded prompt."""
    hf = hf or load_hf(folder)
    hf.generation_config.eos_token_id = None  # exactly n tokens, as tk with ignore_eos
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=1)
    return out[0, ids.shape[1]:].tolist()


def hf_model_logits(folder: Path, ids: list[int]):
    """transformers' own float32 logits (S, V) for one unpadded sequence."""
    hf = load_hf(folder)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def ci_picks(values, keep) -> list:
    """`values` as parameters of which CI runs those in `keep`; the rest are marked `families` (the
    matrix `pytest -m families` runs: README, "Tests"), so that every case still runs somewhere."""
    return [v if v in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.families)
            for v in values]
