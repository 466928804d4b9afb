"""The families of the families issue end to end: what each brings to the decoder reaches both
ONNX targets, and their tokens are transformers' through ONNX Runtime and the torch backend.

Granite, OLMo 2 and SmolLM3 are exported here once each (portable, then `--for ort-cpu`), not by
every per-family export test over hf_models.FAMILIES: each export costs CI ~10-20 s. Of the windowed
and mixture-of-experts families (hf_models.WINDOWED: Gemma 2/3, Mixtral, Qwen2/3-MoE), CI exports one
Gemma-style and one MoE model (CI_GATES); `pytest -m families` runs the whole matrix (each family:
portable, fastest-CPU and int4 exports, tk parity with probes, transformers' tokens past the window).
Their torch-only parity with transformers (logits, greedy, the cache) is in tests/test_models.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from hf_models import EXPORTED_ONCE, MULTIMODAL, WINDOWED, ci_picks, hf_greedy
from test_batching import SLOTS, _mix, _solo
from test_ort_target import PROMPTS, _decode_both
from tk.exporters.onnx_export import traced_layers
from tk.exporters.replicate import TRACED_LAYERS
from tk.models.spec.limits import fused_unsupported
from tk.models.spec.manifest import Manifest
from tk.models.spec.options import ExportOptions
from tk.models.spec.config import DecoderConfig
from tk.models.checkpoint.loading import load_decoder, read_config
from tk.models.quant.plan import quantized_layers
from tk.runtimes.backends.torch import TorchRuntime
from tk.toolkit.tools.describe import inspect_path
from tk.runtimes.serving.batching import Batcher, BatcherLimits, Request, wait_all
from tk.runtimes.decoding.generate import generate, left_pad
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.verify.compare import parity

NEW = list(EXPORTED_ONCE)
PROMPT = [7, 300, 42, 11, 96, 5, 250, 13, 64]  # + 24 new tokens: 33 positions, past a window of 8 three times
# CI's gates: a Gemma-style model through the fastest CPU export (fused kernels, rings filled by runs of
# prompt tokens) and a mixture of experts through the serving export (portable graphs, rings everywhere)
CI_GATES = {"gemma3": dict(profile="ort-cpu", max_seq_len=256), "mixtral": dict(profile="serve", max_seq_len=256)}


@pytest.mark.parametrize("family", NEW + list(WINDOWED))
@pytest.mark.parametrize("capacity", [None, 32], ids=["dynamic", "static"])
def test_fused_ops_compute_what_the_reference_layers_compute(checkpoints, family, capacity):
    """The ort target's eager fused forward (post-norm adds, projection q/k norms on the packed
    qkv, do_rotary off in NoPE layers, Granite's scale and multipliers) is the reference's math."""
    model = load_decoder(checkpoints(family))
    assert fused_unsupported(model.config) == []
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


def _exported_once(tmp_path_factory, checkpoints, kind: str, options):
    """family -> its artifact exported with options(family), exported and validated on first use."""
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = tmp_path_factory.mktemp(f"{kind}-{family}") / "artifact"
            export_artifact(checkpoints(family), cache[family], **options(family))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def fused(tmp_path_factory, checkpoints):
    """family -> its `--for ort-cpu` artifact (once per module)."""
    return _exported_once(tmp_path_factory, checkpoints, "ort-cpu", lambda family: {"profile": "ort-cpu"})


def _tokens(artifact, backend: str, n: int, prompt: list[int] = PROMPT, static: bool = False) -> list[int]:
    with open_runtime(artifact, backend, BackendOptions(static_cache=static)) as rt:
        return generate(rt, [prompt], n, ignore_eos=True).rows[0].tokens


def _validated_with_probes(artifact) -> None:
    """Export validation passed, and tk parity with its probes (leaks, drift, cache vs recompute)."""
    assert Manifest.read(artifact).validation.passed
    report = parity(artifact, ["ort"], steps=8)
    assert report.passed and all(p.passed for p in report.backends["ort"].probes), report.backends["ort"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ci_picks(NEW, {"olmo2"}))  # Granite and SmolLM3: -m families
def test_exports_validate_and_generate_transformers_tokens(checkpoints, artifacts, fused, family):
    """Portable and fused exports both pass export validation (ONNX Runtime against torch) and tk
    parity with its probes, and greedy decoding through ONNX Runtime (each artifact) and the torch backend gives transformers'
    24 tokens. The fused decode graph carries each layer's RoPE and the model's softmax scale."""
    portable, ort_cpu = artifacts(family), fused(family)
    for art in (portable, ort_cpu):
        _validated_with_probes(art)
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
    layers = manifest.config.num_layers
    assert v.passed and v.reference == "torch float32, quantized weights"
    assert v.fused_matmulnbits == {"prefill": 4 * layers + 1, "decode": 4 * layers + 1}


@pytest.fixture(scope="module")
def gate(tmp_path_factory, checkpoints):
    """family -> its CI_GATES artifact (once per module)."""
    return _exported_once(tmp_path_factory, checkpoints, "gate", CI_GATES.get)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CI_GATES))
def test_gate_windowed_and_expert_families_decode_past_the_window(checkpoints, gate, family):
    """One export each, CI's gate: validated with probes, transformers' tokens through ONNX Runtime and
    the torch backend (prompts of 9 and 150 tokens, the latter prefilled in runs of 128 through the
    fused decode graph), a ring of window slots in each sliding layer, the TensorRT lint's verdict."""
    folder, art = checkpoints(family), gate(family)
    manifest = Manifest.read(art)
    _validated_with_probes(art)
    long = (PROMPT * 17)[:150]
    for prompt in (PROMPT, long):
        expected = hf_greedy(folder, prompt, 24)
        assert len(set(expected)) > 3
        assert _tokens(art, "ort", 24, prompt) == expected
        assert _tokens(art, "torch", 24, prompt, static=True) == expected  # the static cache, rings included
    cfg = read_config(folder)
    run = 128 if manifest.variant.decode_prefills else 1  # what a decode step may write at once
    assert manifest.dims.ring == tuple(None if w is None else w + run - 1 for w in cfg.windows)
    lint = manifest.trt_lint
    if manifest.variant.target == "portable":  # a ring written one token at a time: a linear write at index mod slots
        assert lint["ok"], lint["problems"]
    else:
        assert not lint["ok"]  # the fused graphs' contrib ops (and circular writes) are ONNX Runtime's


@pytest.mark.slow
def test_a_ring_holds_window_positions_and_decodes_as_the_dynamic_cache(checkpoints, gate):
    """Mixtral's window of 8 in a static cache of 256: each layer's buffer holds 8 positions (tk inspect
    says so, and the session's buffers are that big), and 40 new tokens equal the dynamic cache's."""
    folder, art = checkpoints("mixtral"), gate("mixtral")
    memory = inspect_path(art)["memory"]
    assert memory["kv_positions"] == [8, 8] and memory["rings"] == [True, True]
    assert memory["kv_bytes"] == 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, 8 slots, 2 kv heads, head_dim 16, fp32
    with open_runtime(art, "ort") as rt:
        out, session = rt.start(np.array([PROMPT]), np.ones((1, len(PROMPT)), np.int64))
        with session:
            assert [b.shape for b in session.cache] == [(1, 2, 8, 16)] * 4
        ring = generate(rt, [PROMPT], 40, ignore_eos=True).rows[0].tokens
    with TorchRuntime(load_decoder(folder)) as rt:  # the plain graphs' math: a dynamic cache of every position
        dynamic = generate(rt, [PROMPT], 40, ignore_eos=True).rows[0].tokens
    assert ring == dynamic


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_served_requests_through_rings_and_experts_equal_their_solo_runs(gate, backend):
    """tk serve's batcher over the Mixtral serving export: 12 requests of 1..40 tokens, budgets of
    1..40, some sampled, sharing steps at their own lengths (each ring written at its own index mod 8)."""
    artifact = gate("mixtral")
    m = Manifest.read(artifact)
    prompts, budgets, sampling = _mix(m.dims.vocab_size, 12)
    solo = _solo(artifact, backend, prompts, budgets, sampling, m.eos_token_ids)
    with Batcher(open_runtime(artifact, backend, SLOTS), limits=BatcherLimits(slots=4, max_queue=16),
                 eos_ids=m.eos_token_ids) as batcher:
        requests = [batcher.submit(Request(p, n, s)) for p, n, s in zip(prompts, budgets, sampling)]
        assert wait_all(requests, 120)
    assert [r.tokens for r in requests] == [s.tokens for s in solo]
    assert max(budgets) < batcher.steps < sum(budgets)  # they shared steps


def _matrix(family: str):
    return pytest.param(family, marks=pytest.mark.families)


@pytest.mark.slow
@pytest.mark.parametrize("family", [_matrix(f) for f in [*WINDOWED, *MULTIMODAL]])
def test_family_matrix_portable_fastest_cpu_and_int4(checkpoints, tmp_path, family):
    """`pytest -m families`: every windowed and MoE family exported portable, --for ort-cpu (static
    cache of 256: rings filled by runs) and int4, each validated with tk parity's probes; transformers'
    greedy tokens (9 + 24, past the window three times) through ONNX Runtime on both float exports and
    through the torch backend; every quantized linear (each expert's) fused into MatMulNBits."""
    folder = checkpoints(family)
    expected = hf_greedy(folder, PROMPT, 24)
    exports = {"portable": {}, "ort-cpu": dict(profile="ort-cpu", max_seq_len=256),
               "int4": dict(weights="int4", block_size=16)}
    for name, options in exports.items():
        art = tmp_path / name
        manifest = export_artifact(folder, art, **options)
        _validated_with_probes(art)
        if name == "int4":
            n = len(quantized_layers(read_config(folder), lm_head=True))
            assert manifest.validation.fused_matmulnbits == {"prefill": n, "decode": n}
        else:
            assert _tokens(art, "ort", 24) == expected
    assert _tokens(tmp_path / "portable", "torch", 24) == expected
