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
LAYERS = {"gemma3": 3, "gemma3_mm": 3}  # fixtures deeper than 2 layers (Gemma 3's global layer is its third)
# A second Llama: linear rope scaling, tied embeddings, MQA.
EXTRA = {
    "llama-linear-tied-mqa": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
}
ALL = {**FAMILIES, **EXPORTED_ONCE, **WINDOWED, **MULTIMODAL, **EXTRA}


def jitter_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() > 1:
                p.copy_(0.2 * noise)
            elif "norm" in name:
                base = 0.0 if type(model).__name__.startswith("Gemma") else 1.0
                p.copy_(base + 0.1 * noise)
            else:
                p.copy_(0.05 * noise)


def make_checkpoint(family: str, folder: Path, seed: int = 0, layers: int | None = None) -> Path:
    """Save a jittered tiny `transformers` model of `family` with a trained tokenizer."""
    import transformers

    cfg_cls, model_cls, extra = ALL[family]
    common = {**_COMMON, "num_hidden_layers": layers or LAYERS.get(family, 2)}
    if "text_config" in extra:  # a multimodal checkpoint: the decoder's config is nested
        extra, common = {**extra, "text_config": {**common, **extra["text_config"]}}, {}
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
