"""The attention families of 2026 (issue 44): gpt-oss, Gemma 4 and OLMo 3 end to end.

What each brings, checked where it is computed: gpt-oss's sinks in the fused kernel's head_sink input and in the
portable graphs' explicit attention, YaRN, the router bias and the clamped SwiGLU, its MXFP4 experts dequantized
exactly; Gemma 4's per-layer inputs, wider full-attention heads (contract 7: per-layer head sizes) and KV-shared
layers (no cache of their own; tk inspect says whose they read); OLMo 3's windows. Then each family exported
portable and `--for ort-cpu`: validated, `tk parity` with its probes, transformers' greedy tokens after a prompt
that crosses every window several times and after one of 1,100 tokens; int4 exports validate; speculation gives
the plain tokens; what is refused is refused in one line.

CI exports gpt-oss and Gemma 4 through `--for ort-cpu` (the fused sinks, the shared layers over rings);
`pytest -m families` runs the whole matrix. The logits against transformers on the torch backend, every family
and checkpoint layout (Gemma 4's image-text one too), are tests/test_models.py's.
"""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file, save_file

from clitools import run
from hf_models import ATTENTION_2026, ci_picks, hf_greedy, load_hf
from test_batching import SLOTS, _mix, _solo
from test_ort_target import PROMPTS, _decode_both
from tk.models.checkpoint import mxfp4
from tk.models.checkpoint.loading import CheckpointError, load_decoder, read_config
from tk.models.quant.quantize import Scheme, dequantize, quantize
from tk.models.spec import contract
from tk.models.spec.config import DecoderConfig
from tk.models.spec.limits import fused_unsupported
from tk.models.spec.manifest import Manifest, Precision
from tk.models.spec.variant import Variant
from tk.runtimes.backends.ort import OrtRuntime
from tk.runtimes.decoding.generate import generate, left_pad
from tk.runtimes.decoding.speculative import PromptLookup, Speculation
from tk.runtimes.serving.batching import Batcher, BatcherLimits, Request, wait_all
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.verify.compare import parity

FAMILIES = list(ATTENTION_2026)


def _tokens(artifact, backend: str, prompt: list[int], n: int) -> list[int]:
    with open_runtime(artifact, backend, BackendOptions()) as rt:
        return generate(rt, [prompt], n, ignore_eos=True).rows[0].tokens


def test_configs_read_as_transformers_builds_them(checkpoints):
    """gpt-oss: sinks, biases, alternating windows, YaRN, the router. Gemma 4: the full layers' heads (from
    transformers 5.25's per_layer_config), the shared layers' sources, per-layer inputs. OLMo 3: 3 : 1 windows,
    YaRN on the full layer alone (the sliding ones keep an unscaled table of their own)."""
    oss = read_config(checkpoints("gpt_oss"))
    assert (oss.attention_sinks, oss.qkv_bias, oss.o_bias, oss.router_bias, oss.routing) == (True, True, True, True,
                                                                                            "topk_softmax")
    assert oss.windows == [8, None] and oss.rope_scaling["rope_type"] == "yarn" and oss.swiglu_limit == 1.5
    g4 = read_config(checkpoints("gemma4"))
    kinds = [g4.layer(i) for i in range(4)]
    assert [(k.head_dim, k.kv_heads, k.reads, k.values_from_keys) for k in kinds] == [
        (16, 2, None, False), (32, 1, None, True), (16, 2, 0, False), (32, 1, 1, False)]
    assert (g4.per_layer_input_size, g4.norm_offset, g4.attention_scale, g4.ffn_size(1), g4.ffn_size(2)) == (
        8, 0.0, 1.0, 96, 192)
    assert g4.rope_dim("global") == 32 and g4.rope_dim("local") == 16 and g4.rope_scaling["partial_rotary_factor"] == 0.25
    olmo = read_config(checkpoints("olmo3"))
    assert olmo.windows == [8, 8, 8, None] and [olmo.layer(i).rope for i in range(4)] == ["local"] * 3 + ["global"]
    dims = contract.GraphDims.of(g4, Precision(), Variant())
    assert [s.name for s in dims.inputs(contract.DECODE)][-2:] == ["past_key_values.1.key", "past_key_values.1.value"]
    assert [s.dims for s in dims.outputs(contract.PREFILL) if s.name == "present.1.key"] == [(contract.BATCH, 1,
                                                                                               contract.SEQ, 32)]


def test_yarn_and_proportional_tables_are_transformers(checkpoints):
    """The inverse frequencies and YaRN's attention factor, as transformers' own rotary embedding computes them."""
    from tk.models.reference.positions import rope_attention_factor, rope_inv_freq

    for family, table, hf_table in (("gpt_oss", "global", None), ("olmo3", "global", "full_attention"),
                                    ("olmo3", "local", "sliding_attention"), ("gemma4", "global", "full_attention"),
                                    ("gemma4", "local", "sliding_attention")):
        cfg, rotary = read_config(checkpoints(family)), load_hf(checkpoints(family)).model.rotary_emb
        inv = rotary.inv_freq if hf_table is None else getattr(rotary, f"{hf_table}_inv_freq")
        factor = rotary.attention_scaling if hf_table is None else getattr(rotary, f"{hf_table}_attention_scaling")
        assert torch.equal(rope_inv_freq(cfg, table), inv), (family, table)
        assert rope_attention_factor(cfg, table) == factor, (family, table)
    assert rope_attention_factor(read_config(checkpoints("gpt_oss"))) > 1  # YaRN's mscale for a factor of 4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("capacity", [None, 32], ids=["dynamic", "static"])
def test_fused_ops_compute_what_the_reference_layers_compute(checkpoints, family, capacity):
    """The ort target's eager forward (sinks through GroupQueryAttention's head_sink, Gemma 4's value norm on the
    packed qkv, shared layers over their source's cache, per-layer inputs after the fused adds) is the reference's."""
    model = load_decoder(checkpoints(family))
    assert fused_unsupported(model.config) == []
    ids, mask = (torch.from_numpy(a) for a in left_pad(PROMPTS))
    assert _decode_both(model, ids, mask, steps=6, capacity=capacity) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family, profile", ci_picks(
    [(f, p) for f in FAMILIES for p in (None, "ort-cpu")], {("gpt_oss", "ort-cpu"), ("gemma4", "ort-cpu")}))
def test_exports_pass_parity_and_give_transformers_tokens(checkpoints, exported, family, profile):
    """Validated, tk parity with its probes (leaks, drift, cache vs recompute), and greedy tokens equal to
    transformers' after a prompt of 40 (with 24 new tokens it crosses every window of 8 seven times) and after
    one of 1,100, through ONNX Runtime (and the torch backend for the first). The fused graphs run sinks in
    GroupQueryAttention's head_sink input; the portable ones have no contrib op."""
    art = exported(family, profile)
    manifest = Manifest.read(art)
    assert manifest.validation.passed and manifest.contract_version == 7
    report = parity(art, ["ort"], steps=8)
    assert report.passed and all(p.passed for p in report.backends["ort"].probes), report.backends["ort"]
    rng = np.random.default_rng(0)
    hf = load_hf(checkpoints(family))
    for length in (40, 1100):
        prompt = rng.integers(2, manifest.config.vocab_size, length).tolist()
        expected = hf_greedy(checkpoints(family), prompt, 24, hf)
        assert _tokens(art, "ort", prompt, 24) == expected, length
        if length < 1100:
            assert _tokens(art, "torch", prompt, 24) == expected, length
    nodes = [n for g in manifest.dims.graphs for n in onnx.load(str(art / f"{g}.onnx"), load_external_data=False).graph.node]
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    if profile is None:
        assert not gqa and all(n.domain in ("", "ai.onnx") for n in nodes)
    elif family == "gpt_oss":  # every GroupQueryAttention node takes its layer's sinks as input 11
        assert gqa and all(len(n.input) == 12 and n.input[11].endswith("attn.sinks") for n in gqa)


def test_inspect_says_each_layers_cache_and_whose_a_shared_layer_reads(exported):
    result = run("inspect", exported("gemma4", "ort-cpu"))
    assert result.exit_code == 0, result.output
    assert "KV caches per layer: layer 0: 2 kv heads x head_dim 16; layer 1: 1 kv heads x head_dim 32" in result.output
    assert "KV-shared layers (no cache of their own): layer 2 reads layer 0's, layer 3 reads layer 1's" in result.output
    assert "present.2.key" not in result.output and "past_key_values.1.key        float32  ['batch_size', 1, 2048, 32]" \
        in result.output


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_greedy_speculation_is_the_plain_output(exported, family):
    """A verify run over sinks, rings and KV-shared layers: prompt lookup's guesses, rejected and accepted, give
    the plain run's tokens."""
    rt = OrtRuntime(exported(family, "ort-cpu")).activate()
    assert rt.verify_problem is None
    prompts = [[5, 9, 5, 9, 5, 9, 7, 11, 5, 9, 5, 9, 7, 11] * 3]
    plain = generate(rt, prompts, 40, ignore_eos=True)
    spec = generate(rt, prompts, 40, ignore_eos=True, speculation=Speculation(PromptLookup(1, 3), 4))
    assert spec.rows[0].tokens == plain.rows[0].tokens and spec.speculation.proposed > 0


def test_served_rows_over_shared_layers_and_rings_equal_their_solo_runs(exported, caplog):
    """12 requests on 3 slots, prompts in chunks (a row sits decode steps out mid-prompt), rows entering and
    leaving, some sampled: each request's tokens are its solo run's. Rings turn prefix caching off, in one line."""
    art = exported("gemma4", "ort-cpu")
    m = Manifest.read(art)
    prompts, budgets, sampling = _mix(m.config.vocab_size, 12, seed=3)
    solo = _solo(art, "ort", prompts, budgets, sampling, m.eos_token_ids)
    with caplog.at_level(logging.INFO), Batcher(open_runtime(art, "ort", SLOTS), limits=BatcherLimits(
            slots=3, max_queue=12, step_tokens=16), eos_ids=m.eos_token_ids) as batcher:
        with ThreadPoolExecutor(12) as pool:
            requests = list(pool.map(lambda a: batcher.submit(Request(*a)), zip(prompts, budgets, sampling)))
        assert wait_all(requests, 120)
    for i, (r, s) in enumerate(zip(requests, solo)):
        assert (r.tokens, r.finish_reason) == (s.tokens, s.finish_reason), i
    assert batcher.chunked and batcher.prefix is None
    assert any(r.message.startswith("prefix caching is off: a sliding layer's cache is a ring") for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_the_api_scores_prompts_and_follows_a_schema_over_sinks_and_shared_layers(checkpoints, exported, family):
    """tk serve over these graphs: echoed log-probabilities of a prompt that crosses every window are transformers'
    log-softmax (prompts scored in runs through rings, sinks and shared layers), and a JSON schema is followed."""
    pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
    pytest.importorskip("llguidance", reason="structured outputs need llguidance: pip install -e '.[serve]'")
    from test_serve_api import _call
    from tk.toolkit.serving.openai.process import ServeOptions, in_thread, open_server

    srv, sock = open_server(exported(family, "ort-cpu"), "ort", BackendOptions(), ServeOptions(
        port=0, limits=BatcherLimits(slots=2), model_name="m", drain_s=1.0))
    sock.close()
    prompt = np.random.default_rng(2).integers(3, 384, 40).tolist()
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    with in_thread(srv) as url:
        status, scored = _call(url, "/v1/completions", {"model": "m", "prompt": [prompt], "echo": True, "logprobs": 1,
                                                        "max_tokens": 1, "temperature": 0, "return_token_ids": True},
                               key=None)
        _, shaped = _call(url, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 40, "temperature": 0,
                                                   "response_format": {"type": "json_schema", "json_schema": {
                                                       "name": "a", "schema": schema, "strict": True}}}, key=None)
    srv.batcher.close()
    assert status == 200, scored
    (new,) = scored["choices"][0]["token_ids"]
    with torch.no_grad():
        want = torch.log_softmax(load_hf(checkpoints(family))(torch.tensor([prompt + [new]])).logits[0], -1).numpy()
    np.testing.assert_allclose(scored["choices"][0]["logprobs"]["token_logprobs"][1:],
                               want[np.arange(len(prompt)), prompt[1:] + [new]], atol=1e-4)
    assert json.loads(shaped["choices"][0]["text"])["answer"] in ("yes", "no")


@pytest.mark.slow
@pytest.mark.parametrize("family", ci_picks(FAMILIES, set()))
def test_int4_exports_validate(exported, family):
    """Every projection (each expert's too) in int4, fused into MatMulNBits; sinks, norms, routers and the per-layer
    embedding stay float; validated against the quantized reference, and tk parity passes."""
    art = exported(family, "ort-cpu", weights="int4")
    m = Manifest.read(art)
    assert m.validation.passed and m.validation.fused_matmulnbits
    dtypes = {n.removeprefix("model."): e.dtype for n, e in m.weights.items()}
    assert dtypes["layers.0.attn.wqkv.weight_t.quant"] == "uint4" and "layers.0.attn.wqkv.weight_t" not in dtypes
    assert parity(art, ["ort"], steps=8).passed


# --- MXFP4 ---

def _e2m1(code: int) -> float:
    """An e2m1 code's value from the format's definition: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign, exponent, mantissa = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (mantissa / 2 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2))


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> MXFP4 blocks [..., K/32, 16] and scales [..., K/32] by the OCP MX rules: a block's shared
    exponent is floor(log2(its largest magnitude)) - 2 (e2m1's largest exponent), each value divided by it and
    rounded to the nearest e2m1 value (clamped at 6); two codes a byte, the first in the low nibble."""
    values = torch.tensor([_e2m1(c) for c in range(8)])
    blocks = w.reshape(*w.shape[:-1], -1, 32).double()
    top = blocks.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126)
    exponent = torch.floor(torch.log2(top)) - 2
    scaled = (blocks / 2.0 ** exponent).clamp(-6, 6)
    codes = (scaled.abs()[..., None] - values.double()).abs().argmin(-1) + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


def test_mxfp4_dequantizes_exactly_by_the_formats_rules():
    """Every code at every byte position, with scales from 2^-127 to 2^127: tk's values are the format's definition,
    computed apart in float64, bit for bit, and transformers' own dequantization's."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 64, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (2, 3, 64), generator=g, dtype=torch.uint8)
    scales[0, 0, :2] = torch.tensor([0, 254], dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales)  # (2, 3, 2048)
    table = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
    codes = torch.stack([blocks & 15, blocks >> 4], -1).long().flatten(-2)  # (..., 64, 32)
    expected = (table[codes] * 2.0 ** (scales.double()[..., None] - 127)).flatten(-2).float()
    assert torch.equal(ours, expected) and ours.abs().max() == 6 * 2.0 ** 127
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # back to [.., rows, in]
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="255, e8m0's NaN"):
        mxfp4.dequantize(blocks[:1, :1, :1], torch.full((1, 1, 1), 255, dtype=torch.uint8))


def _mxfp4_checkpoint(dense, out):
    """The dense gpt-oss checkpoint's experts in MXFP4 (as the hub ships them) -> (their exact values, by name)."""
    shutil.copytree(dense, out)
    tensors, exact = {}, {}
    for name, t in load_file(dense / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> [E, out, in] blocks
            blocks, scales = to_mxfp4(t.transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            exact[name] = mxfp4.dequantize(blocks, scales).transpose(1, 2)
        else:
            tensors[name] = t
    (out / "model.safetensors").unlink()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    return exact


def test_an_mxfp4_checkpoint_loads_bit_exactly_and_generates_as_transformers(checkpoints, tmp_path):
    """gpt-oss's experts in MXFP4 blocks and scales: each expert's gate, up and down rows (de-interleaved,
    transposed) are the format's values bit for bit; transformers with those values as dense experts generates
    what tk generates; into tk's int4 (blocks of 32), the error is measured: MXFP4 values are not on int4's grid."""
    exact = _mxfp4_checkpoint(checkpoints("gpt_oss"), tmp_path / "mxfp4")
    model = load_decoder(tmp_path / "mxfp4")
    for i in range(model.config.num_layers):
        gate_up, down = (exact[f"model.layers.{i}.mlp.experts.{p}"] for p in ("gate_up_proj", "down_proj"))
        for e, expert in enumerate(model.layers[i].ffn.experts):
            assert torch.equal(expert.w_gate_up.weight, torch.cat([gate_up[e][:, 0::2], gate_up[e][:, 1::2]], 1).T)
            assert torch.equal(expert.w_down.weight, down[e].T)
    hf = load_hf(checkpoints("gpt_oss"))
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for p in ("gate_up_proj", "down_proj"):
                getattr(layer.mlp.experts, p).copy_(exact[f"model.layers.{i}.mlp.experts.{p}"])
    prompt = np.random.default_rng(1).integers(2, 384, 40).tolist()
    assert _tokens_torch(model, prompt) == hf_greedy(checkpoints("gpt_oss"), prompt, 24, hf)
    w = model.layers[0].ffn.experts[0].w_gate_up.weight.detach().T.contiguous().numpy()  # [K, N] as tk quantizes
    back = dequantize(quantize(w, Scheme("int4", 32)), 32)
    error = np.sqrt(((back - w) ** 2).mean() / (w ** 2).mean())
    assert 0 < error < 0.15, error


def _tokens_torch(model, prompt: list[int]) -> list[int]:
    from tk.runtimes.backends.torch import TorchRuntime

    with TorchRuntime(model) as rt:
        return generate(rt, [prompt], 24, ignore_eos=True).rows[0].tokens


def test_what_these_layers_cannot_do_is_refused_in_one_line(checkpoints, tmp_path):
    """A broken MXFP4 tensor names itself; a Gemma 4 mixture-of-experts block and bidirectional attention are not
    read; a shared layer with no source of its kind, a config that cannot be."""
    out = tmp_path / "bad"
    _mxfp4_checkpoint(checkpoints("gpt_oss"), out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj_scales"][1, 0, 0] = 255
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts.down_proj \(expert 1\): an MXFP4 scale is "
                                              r"255, e8m0's NaN"):
        load_decoder(out)
    config = json.loads((checkpoints("gemma4") / "config.json").read_text())
    for key, value, why in (("enable_moe_block", True, "enable_moe_block=true"),
                            ("use_bidirectional_attention", "all", "use_bidirectional_attention='all'")):
        folder = tmp_path / key
        shutil.copytree(checkpoints("gemma4"), folder)
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        result = run("inspect", folder)
        assert result.exit_code == 1 and f"Gemma4ForCausalLM with {why}" in result.output
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2, sliding_window=4,
                sliding_layers=[1, 0, 1], kv_shared_layers=2)
    with pytest.raises(ValueError, match=r"layer 1 shares the KV cache of an earlier layer with its window \(None\), "
                                         "and there is none"):
        DecoderConfig(**base)
    assert DecoderConfig(**{**base, "kv_shared_layers": 1}).layer(2).reads == 0
