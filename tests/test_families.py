"""Granite, OLMo 2 and SmolLM3 end to end: what each brings to the decoder reaches both ONNX
targets, and their tokens are transformers' through ONNX Runtime and the torch backend.

These families are exported here once each (portable, then `--for ort-cpu`), not by every
per-family export test over hf_models.FAMILIES: each export costs CI ~10-20 s. Their torch-only
parity with transformers (logits, greedy, the cache) is in tests/test_models.py with every family.
"""

from __future__ import annotations

import onnx
import pytest
import torch

from hf_models import EXPORTED_ONCE, hf_greedy
from test_ort_target import PROMPTS, _decode_both
from tk.exporters.onnx_export import traced_layers
from tk.exporters.replicate import TRACED_LAYERS
from tk.models import ort_kernels
from tk.models.artifact import Manifest
from tk.models.options import ExportOptions
from tk.models.config import DecoderConfig
from tk.models.loading import load_decoder, read_config
from tk.runtimes.generate import generate, left_pad
from tk.toolkit.backends import open_runtime
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.verify.compare import parity

NEW = list(EXPORTED_ONCE)
PROMPT = [7, 300, 42, 11, 96, 5, 250, 13, 64]


@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("capacity", [None, 32], ids=["dynamic", "static"])
def test_fused_ops_compute_what_the_reference_layers_compute(checkpoints, family, capacity):
    """The ort target's eager fused forward (post-norm adds, projection q/k norms on the packed
    qkv, do_rotary off in NoPE layers, Granite's scale and multipliers) is the reference's math."""
    model = load_decoder(checkpoints(family))
    assert ort_kernels.unsupported(model.config) == []
    ExportOptions.from_flags(profile="ort-cpu").for_model(model.config).check(model.config)  # not refused
    ids, mask = (torch.from_numpy(a) for a in left_pad(PROMPTS))
    assert _decode_both(model, ids, mask, steps=6, capacity=capacity) < 1e-5


def test_layers_that_differ_are_all_traced():
    """The exporter copies a traced layer only when every layer is the same function: SmolLM3's
    NoPE layers make a deep model's layers differ, so each is traced."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=8, num_heads=4)
    assert traced_layers(DecoderConfig(**base)) == TRACED_LAYERS
    nope = DecoderConfig(**base, rope_layers=[1, 1, 1, 0] * 2)
    assert not nope.uniform_layers and traced_layers(nope) == 8
    assert traced_layers(DecoderConfig(**base, rope_layers=[1] * 8)) == TRACED_LAYERS  # RoPE everywhere
    assert DecoderConfig(**base, rope_layers=[0] * 8).first_layers(4).rope_layers == [False] * 4


@pytest.fixture(scope="module")
def fused(tmp_path_factory, checkpoints):
    """family -> its `--for ort-cpu` artifact (exported and validated once per module)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = tmp_path_factory.mktemp(f"ort-cpu-{family}") / "artifact"
            export_artifact(checkpoints(family), cache[family], profile="ort-cpu")
        return cache[family]

    return get


def _tokens(artifact, backend: str, n: int) -> list[int]:
    with open_runtime(artifact, backend) as rt:
        return generate(rt, [PROMPT], n, ignore_eos=True).rows[0].tokens


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
def test_exports_validate_and_generate_transformers_tokens(checkpoints, artifacts, fused, family):
    """Portable and fused exports both pass export validation (ONNX Runtime against torch) and tk
    parity with its probes, and greedy decoding through ONNX Runtime (each artifact) and the torch backend gives transformers'
    24 tokens. The fused decode graph carries each layer's RoPE and the model's softmax scale."""
    portable, ort_cpu = artifacts(family), fused(family)
    for art in (portable, ort_cpu):
        assert Manifest.read(art).validation["passed"]
        report = parity(art, ["ort"], steps=8)  # and tk parity's probes: leaks, drift, cache vs recompute
        assert report.passed and all(p.passed for p in report.backends["ort"].probes), report.backends["ort"]
    expected = hf_greedy(checkpoints(family), PROMPT, 24)
    assert len(set(expected)) > 3
    assert _tokens(portable, "ort", 24) == expected
    assert _tokens(ort_cpu, "ort", 24) == expected
    assert _tokens(portable, "torch", 24) == expected

    cfg = read_config(checkpoints(family))
    decode = onnx.load(str(ort_cpu / "decode.onnx"), load_external_data=False)
    gqa = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
           for n in decode.graph.node if n.op_type == "GroupQueryAttention"]
    assert [bool(g["do_rotary"]) for g in gqa] == [cfg.layer_rope(i) for i in range(cfg.num_layers)]
    scale = cfg.attention_scale or cfg.head_dim ** -0.5
    assert all(g["scale"] == pytest.approx(scale) for g in gqa)


@pytest.mark.slow
def test_int4_granite_validates_and_fuses(checkpoints, tmp_path):
    """Weight-only int4 on the family whose multipliers move every activation's scale: the graphs
    match the quantized reference and every linear (LM head included) fuses into MatMulNBits."""
    manifest = export_artifact(checkpoints("granite"), tmp_path / "artifact", weights="int4")
    v = manifest.validation
    layers = manifest.config["num_layers"]
    assert v["passed"] and v["reference"] == "torch float32, quantized weights"
    assert v["fused_matmulnbits"] == {"prefill": 4 * layers + 1, "decode": 4 * layers + 1}
