"""The quantizers themselves (models/quant/quantize.py), on weights drawn heavy-tailed like a trained
model's: partial blocks, integer ranges, zero points that store 0 exactly, a search that never does
worse than round-to-nearest and does better overall, calibration's weights reaching the channels
they weight, the per-tensor plan of mixed precision, and tk eval's KL divergence."""

from __future__ import annotations

import numpy as np
import pytest

from tk.models.spec.manifest import Precision
from tk.models.quant.plan import quant_plan, sensitive_layers
from tk.models.quant.quantize import QTensor, Scheme, dequantize, pack_int4, quantize, unpack_int4


def heavy(k: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_t(3, (k, n)).astype(np.float32) * 0.02
    w[rng.integers(0, k, 3)] *= 8  # a few outlier input channels, as trained weights have
    return w


def weighted_error(w, qt: QTensor, block: int, weights=None) -> float:
    d = dequantize(qt, block) - w
    return float(((weights if weights is not None else 1.0) * d * d).sum())


@pytest.mark.parametrize("scheme", [Scheme("int4", 16, m, z) for m in ("rtn", "search") for z in (False, True)]
                         + [Scheme("int8", 32, "search", True)])
def test_partial_blocks_ranges_and_exact_zeros(scheme):
    w = heavy(50, 24)  # 50 rows: blocks of 16 leave a last block of 2
    w[5] = 0.0
    qt = quantize(w, scheme)
    nb = -(-50 // scheme.block)
    assert qt.q.shape == (50, 24) and qt.scales.shape == (nb, 24) and (qt.scales > 0).all()
    if scheme.zero_points:
        top = 15 if scheme.bits == "int4" else 255
        assert qt.q.dtype == np.uint8 and qt.zeros.shape == (nb, 24) and qt.q.max() <= top and qt.zeros.max() <= top
    else:
        lo, hi = (-8, 7) if scheme.bits == "int4" else (-128, 127)
        assert qt.q.dtype == np.int8 and qt.zeros is None and lo <= qt.q.min() and qt.q.max() <= hi
    d = dequantize(qt, scheme.block)
    assert (d[5] == 0).all()  # zero stays exactly zero
    assert np.abs(d - w).max() <= 1.01 * np.abs(w).max() / (7 if scheme.bits == "int4" else 127)


@pytest.mark.parametrize("block,zero_points", [(16, True), (32, False), (128, True)])
def test_dequantize_in_pieces_into_a_transposed_weight_is_the_whole_tensor_at_once(monkeypatch, block, zero_points):
    """The export's reference writes an LM head's dequantized values over its own float weight
    ([N, K], so through a transposed view) a few columns at a time: the same float32 values as
    (q - z) * s over the whole tensor, with a partial last block and a partial last piece."""
    import tk.models.quant.quantize as quant

    w = heavy(300, 40, seed=3)  # 300 rows: a partial last block for every block size here
    qt = quantize(w, Scheme("int4", block, "rtn", zero_points))
    s = np.repeat(qt.scales, block, axis=0)[:300]
    z = 0 if qt.zeros is None else np.repeat(qt.zeros.astype(np.float32), block, axis=0)[:300]
    whole = (qt.q.astype(np.float32) - z) * s
    monkeypatch.setattr(quant, "DEQUANT_COLUMNS", 7)  # pieces of 7 columns, the last of 5
    weight = np.full((40, 300), np.nan, dtype=np.float32)
    assert dequantize(qt, block, out=weight.T) is not None and np.array_equal(weight.T, whole)
    assert np.array_equal(dequantize(qt, block), whole)


@pytest.mark.parametrize("zero_points", [False, True])
def test_search_never_worse_than_rtn_and_better_overall(zero_points):
    w = heavy(256, 64, seed=1)
    rtn = quantize(w, Scheme("int4", 32, "rtn", zero_points))
    search = quantize(w, Scheme("int4", 32, "search", zero_points))
    per_block = lambda qt: ((dequantize(qt, 32) - w) ** 2 * (np.abs(w) + 1e-3)).reshape(8, 32, 64).sum(1)
    # the search minimizes its own weighted error per block; rtn is its first candidate
    x2 = w.reshape(8, 32, 64) ** 2
    wt = (np.sqrt(x2.mean(1, keepdims=True)) + np.abs(w.reshape(8, 32, 64))).reshape(256, 64)
    err = lambda qt: ((dequantize(qt, 32) - w) ** 2 * wt).reshape(8, 32, 64).sum(1)
    assert (err(search) <= err(rtn) * (1 + 1e-5)).all()
    assert err(search).sum() < 0.95 * err(rtn).sum()
    assert weighted_error(w, search, 32) < weighted_error(w, rtn, 32)  # the plain squared error too
    assert per_block(search).sum() < per_block(rtn).sum()


def test_importance_weights_the_channels_it_names():
    w = heavy(128, 64, seed=2)
    importance = np.ones(128, np.float32)
    importance[::4] = 100.0  # channels 0, 4, 8, ... carry most of the activation energy
    plain = quantize(w, Scheme("int4", 32, "search", True))
    weighted = quantize(w, Scheme("int4", 32, "search", True), importance)
    on = lambda qt: float(((dequantize(qt, 32) - w)[::4] ** 2).sum())
    assert on(weighted) < 0.9 * on(plain)


def test_pack_int4_round_trips_signed_and_unsigned():
    rng = np.random.default_rng(3)
    for signed, lo, hi in ((True, -8, 8), (False, 0, 16)):
        q = rng.integers(lo, hi, 77).astype(np.int8 if signed else np.uint8)
        np.testing.assert_array_equal(unpack_int4(pack_int4(q), 77, signed=signed), q)


def test_mixed_precision_plan():
    from tk.models.spec.config import DecoderConfig

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=24, num_heads=4,
                        num_kv_heads=2, tie_embeddings=False)
    assert sensitive_layers(24) == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]  # onnxruntime-genai's mixed_layers
    p = Precision(weights="int4", block_size=32, quantized_lm_head=True, method="search", zero_points=True,
                  mixed="sensitive", quantized_embedding=True)
    plan = quant_plan(cfg, p)
    int8 = {n for n, s in plan.items() if s.bits == "int8"}
    assert int8 == {"lm_head.weight"} | {f"layers.{i}.{w}" for i in sensitive_layers(24)
                                         for w in ("attn.wqkv.weight", "ffn.w_down.weight")}
    assert plan["embed.weight"] == Scheme("int4", 32, "search", True)  # untied: 4 bits, as llama.cpp keeps token_embd
    assert plan["layers.3.attn.wo.weight"] == Scheme("int4", 32, "search", True)
    tied = quant_plan(DecoderConfig(**{**cfg.to_dict(), "tie_embeddings": True}), p)
    assert "embed.weight" not in tied  # a tied embedding is read from the LM head's table


def test_divergence_is_kl_and_top1():
    from tk.toolkit.verify.perplexity import divergence

    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(5, 11)) * 4, rng.normal(size=(5, 11)) * 4
    p = np.exp(a) / np.exp(a).sum(-1, keepdims=True)
    q = np.exp(b) / np.exp(b).sum(-1, keepdims=True)
    kl, top1 = divergence(a, b)
    np.testing.assert_allclose(kl, (p * np.log(p / q)).sum(-1), rtol=1e-9)
    np.testing.assert_array_equal(top1, a.argmax(-1) == b.argmax(-1))
    assert (divergence(a, a)[0] < 1e-12).all()


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3", "olmo2", "qwen2_moe"])
def test_channel_scales_keep_the_function_and_lower_the_error(family, tmp_path):
    """Activation-aware scales (models/quant/calibration.py) on each kind of block: GQA and MQA value rows
    (and their biases), Gemma's (1 + w) sandwich norms, OLMo 2's post-norms (no norm to fold into:
    QKV and gate/up stay unscaled), a mixture of experts with a shared expert (each expert's down
    through its own up rows; the shared norm not folded). The scaled float model computes the same
    logits; every scaled weight has less importance-weighted round-to-nearest error than unscaled."""
    import torch

    from tk.models.quant.calibration import Calibration, channel_scales
    from tk.models.checkpoint.loading import load_decoder

    from hf_models import make_checkpoint

    model = load_decoder(make_checkpoint(family, tmp_path / family))
    cfg = model.config
    precision = Precision("int4", "float32", "float32", 16, False, "search", True)
    plan = quant_plan(cfg, precision)
    rng = np.random.default_rng(0)
    importance = {}
    for name in plan:  # activations with a few loud channels, as a trained model's are
        k = model.get_submodule(name.removesuffix(".weight")).in_features
        imp = rng.uniform(0.5, 1.5, k).astype(np.float32)
        imp[rng.choice(k, 3, replace=False)] *= 400
        importance[name] = imp
    scales = channel_scales(model, plan, importance)
    post, moe = cfg.norm_placement == "post", cfg.layer(0).moe
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        assert (p + "attn.wqkv.weight" in scales) != post
        assert (p + "ffn.w_gate_up.weight" in scales) == (not post and not cfg.layer(i).moe)
        assert p + "attn.wo.weight" in scales
    downs = [n for n in scales if n.endswith("w_down.weight")]
    assert downs and (not moe or any(".experts." in n for n in downs))
    ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (1, 24)))
    args = (ids, torch.ones_like(ids), torch.arange(24)[None])
    with torch.no_grad():
        before = model(*args)[0]
        calibration = Calibration(importance, scales)
        calibration.scale_(model)
        after = model(*args)[0]
    np.testing.assert_allclose(after.numpy(), before.numpy(), rtol=0, atol=2e-5 * float(before.abs().max()))
    rtn = Scheme("int4", 16, "rtn", True)
    for name, s in scales.items():
        w_scaled = model.get_submodule(name.removesuffix(".weight")).weight.detach().T.numpy()
        w = w_scaled / s[:, None]  # the unscaled weight (its rows may carry another weight's scales)
        imp = importance[name][:, None]
        plain = weighted_error(w, quantize(w, rtn), 16, imp)
        d = dequantize(quantize(w_scaled, rtn), 16) / s[:, None] - w
        assert float((imp * d * d).sum()) < plain, name
        search = Scheme("int4", 16, "search", True)  # and under the method that stores it
        d = dequantize(quantize(w_scaled, search, calibration.importance_of(name)), 16) / s[:, None] - w
        assert float((imp * d * d).sum()) < weighted_error(w, quantize(w, search, importance[name]), 16, imp), name
        assert np.allclose(calibration.importance_of(name), importance[name] / s**2)


def test_an_embedding_is_quantized_with_the_lm_head_by_default():
    """Tied or untied (README "Quantized weights": on a real untied checkpoint half the file for 0.7% more
    KL); not with a float LM head, an odd vocabulary in int4 (two columns a byte) or --for trt."""
    from tk.models.spec.config import DecoderConfig
    from tk.models.spec.options import ExportOptions

    untied = DecoderConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                           num_kv_heads=2, tie_embeddings=False)

    def embedding(cfg, **flags):
        return ExportOptions.from_flags(weights="int4", **flags).for_model(cfg).precision.quantized_embedding

    assert embedding(untied) and embedding(DecoderConfig(**{**untied.to_dict(), "tie_embeddings": True}))
    assert not embedding(untied, quantize_lm_head=False) and not embedding(untied, quantize_embedding=False)
    assert not embedding(DecoderConfig(**{**untied.to_dict(), "vocab_size": 65}))
    assert not embedding(untied, profile="trt")
    plan = quant_plan(untied, ExportOptions.from_flags(weights="int4", mixed_precision="lm-head")
                      .for_model(untied).precision)
    assert plan["lm_head.weight"].bits == "int8" and plan["embed.weight"].bits == "int4"
