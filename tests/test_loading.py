"""Config translation and validation, checkpoint formats, and every way a checkpoint can be bad."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_close
from hf_models import load_hf
from tk.models.config import DecoderConfig, UnsupportedModelError, config_from_hf
from tk.models.contract import position_ids_from_mask
from tk.models.loading import CheckpointError, load_decoder


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
          "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn' is not supported; supported: default, linear, llama3"):
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
