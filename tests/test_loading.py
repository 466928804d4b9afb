"""Config translation and validation, checkpoint formats, and every way a checkpoint can be bad."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_close
from hf_models import load_hf
from tk.models.spec.config import DecoderConfig, UnsupportedModelError
from tk.models.checkpoint.families import config_from_hf
from tk.models.spec.contract import position_ids_from_mask
from tk.models.checkpoint.loading import CheckpointError, load_decoder


def _cfg(**kw):
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)
    return DecoderConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, field", [
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(hidden_size=66), "hidden_size"),
    (dict(num_layers=-1), "num_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(head_dim=-8), "head_dim"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
])
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        _cfg(**kw)


def test_explicit_head_dim_is_kept():
    cfg = _cfg(hidden_size=64, num_heads=4, head_dim=24)  # Qwen3-style: head_dim != hidden / heads
    assert cfg.head_dim == 24 and cfg.q_size == 96
    assert _cfg(hidden_size=66, num_heads=4, head_dim=16).head_dim == 16  # explicit head_dim rescues it


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedModelError, match=r"architecture FalconForCausalLM is not supported; supported: "
                                                     r"LlamaForCausalLM, MistralForCausalLM"):
        config_from_hf({"architectures": ["FalconForCausalLM"]})


def test_unsupported_rope_type():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"type": "dynamic", "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic' is not supported; supported: default, linear, "
                                                    "llama3, yarn, proportional"):
        config_from_hf(hf)
    hf["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="rope type yarn needs original_max_position_embeddings"):
        config_from_hf(hf)


def test_v4_style_rope_config():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, "eos_token_id": [1, 2]}
    cfg = config_from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3" and cfg.eos_token_ids == [1, 2]


def test_sharded_checkpoint_loads_the_same(checkpoints, tmp_path):
    hf = load_hf(checkpoints("llama"))
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, b = load_decoder(checkpoints("llama")), load_decoder(tmp_path)
    ids = torch.randint(0, 300, (1, 8))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert_close(a(ids, mask, position_ids_from_mask(mask))[0], b(ids, mask, position_ids_from_mask(mask))[0],
                     0.0, "sharded")


def _copy(checkpoints, tmp_path, family="llama"):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints(family), dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_decoder(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_decoder(tmp_path)


def test_folder_without_weights(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    (d / "model.safetensors").unlink()
    torch.save({}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"has no model.safetensors .*pytorch_model.bin: tk loads safetensors only"):
        load_decoder(d)


def test_corrupt_safetensors(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_decoder(d)


def test_truncated_safetensors(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="safetensors"):
        load_decoder(d)


def test_weights_that_do_not_match_config(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \[96, 64\] "
                                              r"but config.json implies \[128, 64\]"):
        load_decoder(d)


def test_missing_and_extra_tensors(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    from safetensors.torch import load_file

    sd = load_file(d / "model.safetensors")
    del sd["model.norm.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks 1 tensor.*model.norm.weight"):
        load_decoder(d)
    sd["model.norm.weight"] = torch.ones(64)
    sd["model.layers.9.extra"] = torch.ones(2)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not describe, e.g. model.layers.9.extra"):
        load_decoder(d)


def test_bad_config_json(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_decoder(d)
    cfg = json.loads((checkpoints("llama") / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
        load_decoder(d)


def test_tiny_preset_roundtrip(tiny):
    model = load_decoder(tiny)
    assert model.config.architecture == "LlamaForCausalLM"
    assert (tiny / "tokenizer.json").is_file()
    # every vector is jittered: a loader that dropped a norm weight would not notice ones
    assert not torch.allclose(model.layers[0].attn_norm.weight, torch.ones(64))


def test_bf16_checkpoint_loads_in_float32(checkpoints, tmp_path):
    """Real checkpoints usually ship bf16 safetensors; loading them in fp32 upcasts exactly."""
    hf = load_hf(checkpoints("qwen3")).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    hf32 = load_hf(tmp_path)  # transformers upcasts the bf16 weights to fp32
    ours = load_decoder(tmp_path, "fp32")
    assert ours.embed.weight.dtype == torch.float32
    ids = torch.randint(0, 300, (1, 10))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert_close(ours(ids, mask, position_ids_from_mask(mask))[0],
                     hf32(input_ids=ids, attention_mask=mask).logits, 1e-4, "bf16 checkpoint")


def _hf(arch: str, **kw) -> dict:
    return {"architectures": [arch], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2, **kw}


def test_granite_multipliers_and_their_defaults():
    cfg = config_from_hf(_hf("GraniteForCausalLM", embedding_multiplier=12, residual_multiplier=0.22,
                             attention_multiplier=0.0078125, logits_scaling=16))
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (
        12.0, 0.22, 0.0078125, 16.0)
    bare = config_from_hf(_hf("GraniteForCausalLM"))  # GraniteConfig's defaults: 1.0, the attention scale too
    assert (bare.embedding_multiplier, bare.residual_multiplier, bare.attention_scale, bare.logits_scaling) == (
        1.0, 1.0, 1.0, 1.0)
    assert config_from_hf(_hf("LlamaForCausalLM", logits_scaling=16)).logits_scaling == 1.0  # not a Llama key


def test_olmo2_is_post_norm_with_projection_qk_norms():
    cfg = config_from_hf(_hf("Olmo2ForCausalLM"))
    assert (cfg.norm_placement, cfg.qk_norm, cfg.tie_embeddings) == ("post", "projection", False)
    assert DecoderConfig.from_dict({**cfg.to_dict(), "qk_norm": True}).qk_norm == "head"  # an older manifest
    assert DecoderConfig.from_dict({**cfg.to_dict(), "qk_norm": False}).qk_norm is None


def test_smollm3_rope_layers_read_as_transformers_reads_them():
    """no_rope_layers[i] == 1 means layer i *uses* RoPE (SmolLM3Attention.use_rope); left out,
    every no_rope_layer_interval-th layer (default 4) goes without."""
    cfg = config_from_hf(_hf("SmolLM3ForCausalLM", no_rope_layers=[1, 0, 1, 1]))
    assert cfg.rope_layers == [True, False, True, True] and cfg.tie_embeddings  # SmolLM3Config ties by default
    assert [cfg.layer_rope(i) for i in range(4)] == [True, False, True, True]
    assert config_from_hf(_hf("SmolLM3ForCausalLM")).rope_layers == [True, True, True, False]
    assert config_from_hf(_hf("SmolLM3ForCausalLM", no_rope_layer_interval=2)).rope_layers == [True, False] * 2
    assert config_from_hf(_hf("SmolLM3ForCausalLM", no_rope_layers=[1] * 4)).rope_layers is None  # RoPE everywhere
    with pytest.raises(ValueError, match="rope_layers has 3 entries for 4 layers"):
        config_from_hf(_hf("SmolLM3ForCausalLM", no_rope_layers=[1, 0, 1]))


def test_smollm3_sliding_window_follows_layer_types():
    """A layer slides when use_sliding_window is set and layer_types says sliding_attention (by
    default: the NoPE layers), every layer or some."""
    off = config_from_hf(_hf("SmolLM3ForCausalLM", sliding_window=16, layer_types=["sliding_attention"] * 4))
    assert off.sliding_window is None  # use_sliding_window false: every layer attends fully
    every = config_from_hf(_hf("SmolLM3ForCausalLM", use_sliding_window=True, sliding_window=16,
                               layer_types=["sliding_attention"] * 4))
    assert (every.sliding_window, every.sliding_layers, every.windows) == (16, None, [16] * 4)
    some = config_from_hf(_hf("SmolLM3ForCausalLM", use_sliding_window=True, sliding_window=16))  # the NoPE layer
    assert some.windows == [None, None, None, 16] and not some.uniform_layers
    alternate = config_from_hf(_hf("SmolLM3ForCausalLM", use_sliding_window=True, sliding_window=16,
                                   layer_types=["full_attention", "sliding_attention"] * 2))
    assert alternate.windows == [None, 16, None, 16]


def test_gemma2_and_3_layer_kinds_as_transformers_derives_them():
    """Gemma 2: even layers slide (layer_types' default), scale query_pre_attn_scalar ** -0.5, both softcaps.
    Gemma 3: every sliding_window_pattern-th layer is global, sliding layers take rope_local_base_freq
    unscaled, attn_logit_softcapping is ignored; v5 configs nest RoPE by layer type."""
    g2 = config_from_hf(_hf("Gemma2ForCausalLM", sliding_window=4, query_pre_attn_scalar=144,
                            attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    assert g2.windows == [4, None, 4, None] and (g2.attn_softcap, g2.final_softcap) == (50.0, 30.0)
    assert g2.attention_scale == 144 ** -0.5 and g2.norm_placement == "sandwich" and g2.tie_embeddings
    assert [g2.layer(i).rope for i in range(4)] == ["global"] * 4  # one RoPE table
    g3 = config_from_hf(_hf("Gemma3ForCausalLM", num_hidden_layers=6, sliding_window=4, rope_theta=1e6,
                            rope_local_base_freq=1e4, attn_logit_softcapping=50.0,
                            rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert g3.windows == [4] * 5 + [None] and g3.attn_softcap is None and g3.qk_norm == "head"
    assert [g3.layer(i).rope for i in range(6)] == ["local"] * 5 + ["global"]
    assert (g3.rope_theta, g3.rope_scaling["factor"], g3.rope_local_theta) == (1e6, 8.0, 1e4)
    nested = config_from_hf(_hf("Gemma3ForCausalLM", sliding_window=4, layer_types=["sliding_attention"] * 3
                                + ["full_attention"], rope_parameters={
                                    "full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}))
    assert (nested.rope_theta, nested.rope_local_theta, nested.windows) == (5e5, 50.0, [4, 4, 4, None])
    with pytest.raises(UnsupportedModelError, match="bidirectional attention"):
        config_from_hf(_hf("Gemma3ForCausalLM", use_bidirectional_attention=True))


def test_gemma3_image_text_checkpoint_reads_its_text_config_with_transformers_defaults():
    """Gemma 3 4B and up: the decoder's config is text_config, which names a few keys; the rest are
    Gemma3TextConfig's defaults (not tk's: vocab 262208, head_dim 256, scalar 256, theta 1e6 / 1e4), and
    its logits are never softcapped (Gemma3ForConditionalGeneration has no final softcap)."""
    cfg = config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                          "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 12,
                                          "sliding_window": 1024, "final_logit_softcapping": 30.0,
                                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                          "vision_config": {"hidden_size": 1152}})
    assert (cfg.vocab_size, cfg.head_dim, cfg.attention_scale, cfg.num_kv_heads) == (262208, 256, 256 ** -0.5, 4)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert cfg.windows == [1024] * 5 + [None] + [1024] * 5 + [None] and cfg.final_softcap is None
    assert cfg.tie_embeddings and cfg.architecture == "Gemma3ForConditionalGeneration"


def test_mixtures_of_experts_read_as_transformers_reads_them():
    """Mixtral routes every layer, renormalized; Qwen-MoE only the layers decoder_sparse_step and
    mlp_only_layers leave sparse, renormalized by norm_topk_prob, with Qwen2's gated shared expert."""
    mix = config_from_hf(_hf("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2, sliding_window=32))
    assert (mix.num_experts, mix.experts_per_token, mix.expert_size, mix.renormalize_experts) == (8, 2, 8, True)
    assert mix.moe_layers is None and mix.windows == [32] * 4 and mix.uniform_layers
    qwen = config_from_hf(_hf("Qwen2MoeForCausalLM", num_experts=60, num_experts_per_tok=4, moe_intermediate_size=16,
                              shared_expert_intermediate_size=80, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [qwen.layer(i).moe for i in range(4)] == [False, True, False, False]
    assert (qwen.expert_size, qwen.shared_expert_size, qwen.renormalize_experts, qwen.qkv_bias) == (16, 80, False, True)
    q3 = config_from_hf(_hf("Qwen3MoeForCausalLM", num_local_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            moe_intermediate_size=16))  # Qwen3MoeConfig saves num_local_experts
    assert (q3.num_experts, q3.renormalize_experts, q3.shared_expert_size, q3.qk_norm) == (8, True, 0, "head")
    assert config_from_hf(_hf("Qwen2MoeForCausalLM", num_experts=4, mlp_only_layers=[0, 1, 2, 3])).num_experts == 0
    with pytest.raises(ValueError, match=r"experts_per_token \(3\) exceeds num_experts \(2\)"):
        config_from_hf(_hf("MixtralForCausalLM", num_local_experts=2, num_experts_per_tok=3))


@pytest.mark.parametrize("kw, message", [
    (dict(qk_norm="both"), "qk_norm must be one of None, head, projection"),
    (dict(norm_placement="bottom"), "norm_placement must be one of pre, post, sandwich"),
    (dict(sliding_layers=[True, False, True]), "sliding_layers has 3 entries for 2 layers"),
    (dict(sliding_layers=[True, False]), "sliding_layers needs sliding_window"),
    (dict(attn_softcap=0.0), "attn_softcap must be positive"),
    (dict(moe_layers=[True, False]), "moe_layers and shared_expert_size describe experts"),
    (dict(residual_multiplier=0.0), "residual_multiplier must be positive"),
    (dict(attention_scale=-1.0), "attention_scale must be positive"),
])
def test_new_fields_are_validated(kw, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**kw)


def test_olmo2_checkpoint_tensor_names(checkpoints):
    """OLMo 2's block norms are post_attention_layernorm and post_feedforward_layernorm (no
    input_layernorm), its q/k norms as wide as the projections."""
    from tk.models.checkpoint.names import Part, weight_map

    cfg = load_decoder(checkpoints("olmo2")).config
    m = weight_map(cfg)
    assert m["layers.0.attn_norm.weight"] == [Part("model.layers.0.post_attention_layernorm.weight", 64)]
    assert m["layers.0.ffn_norm.weight"] == [Part("model.layers.0.post_feedforward_layernorm.weight", 64)]
    assert m["layers.0.attn.q_norm.weight"] == [Part("model.layers.0.self_attn.q_norm.weight", cfg.q_size)]
    assert m["layers.0.attn.k_norm.weight"] == [Part("model.layers.0.self_attn.k_norm.weight", cfg.kv_size)]


@pytest.mark.parametrize("embedding", [False, True])
def test_quantized_reference_writes_over_its_weights_and_keeps_a_float_tied_embedding(embedding):
    """The quantized reference dequantizes over each float weight in place, except a tied LM head
    whose embedding stays float (--no-quantize-embedding): that head gets a table of its own, and
    the embedding keeps the checkpoint's values."""
    from tk.models.checkpoint.loading import quantize_weights_
    from tk.models.quant.quantize import Scheme, dequantize, quantize
    from tk.models.reference.decoder import Decoder
    from tk.models.spec.manifest import Precision

    torch.manual_seed(0)
    model = Decoder(_cfg(tie_embeddings=True)).eval()
    table = model.embed.weight.detach().clone()
    wq = model.layers[0].attn.wqkv.weight
    before = wq.detach().clone()
    p = Precision("int4", block_size=32, quantized_lm_head=True, quantized_embedding=embedding)
    quantize_weights_(model, p)
    assert model.layers[0].attn.wqkv.weight.data_ptr() == wq.data_ptr()  # written over, not copied
    expected = dequantize(quantize(before.T.numpy(), Scheme("int4", 32)), 32).T
    assert torch.equal(model.layers[0].attn.wqkv.weight, torch.from_numpy(np.ascontiguousarray(expected)))
    head = torch.from_numpy(np.ascontiguousarray(dequantize(quantize(table.T.numpy(), Scheme("int4", 32)), 32).T))
    assert torch.equal(model.lm_head.weight, head)
    assert torch.equal(model.embed.weight, head if embedding else table)
