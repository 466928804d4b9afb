"""tk export --target ort (ONNX Runtime's fused kernels) and --prefill-logits last.

The fused graphs keep the contract's inputs and outputs; what changes is how the decoder is
written into ONNX. Both are checked for real: the eager fused path against the reference
layers, the exported graphs against torch (parity) and transformers (tokens).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from hf_models import ci_picks, hf_greedy
from test_parity import _drop_mask
from tk.models.spec import contract
from tk.models.reference import ort_kernels
from tk.models.spec.manifest import Manifest
from tk.models.spec.contract import position_ids_from_mask
from tk.models.checkpoint.loading import load_decoder
from tk.runtimes.decoding.generate import generate, left_pad
from tk.runtimes.base import InputError
from tk.runtimes.backends.ort import OrtRuntime
from tk.runtimes.slots import Slots
from tk.runtimes.backends.torch import TorchRuntime
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.cli.main import main
from tk.toolkit.verify.tolerance import tolerance_for
from tk.toolkit.verify.compare import parity
from tk.toolkit.verify.probes import run_probes

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 3, 8], [42, 8, 300, 12, 77, 150, 9, 61, 33, 7, 21, 64, 90, 2]]  # 14 > mistral's window 12


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _decode_both(model, ids, mask, steps, capacity=None):
    """Prefill, then `steps` decode steps through the reference layers and through the fused ops,
    with the same tokens; -> max |diff| over logits and caches."""
    worst = 0.0
    with torch.no_grad():
        pos = position_ids_from_mask(mask)
        a, cache_a = model(ids, mask, pos)
        b, cache_b = ort_kernels.forward(model, ids, mask, pos)
        worst = max(worst, (a - b).abs().max().item())
        B, T = mask.shape
        if capacity is not None:  # static: the caches as fixed-capacity buffers
            widen = lambda c: [tuple(torch.nn.functional.pad(t, (0, 0, 0, capacity - T)) for t in kv) for kv in c]
            cache_a, cache_b = widen(cache_a), widen(cache_b)
        for step in range(steps):
            token = a[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
            pos = mask.sum(-1, keepdim=True) - 1
            if capacity is None:
                args = (mask, pos)
                write = None
            else:
                args = (torch.nn.functional.pad(mask, (0, capacity - mask.shape[1])), pos)
                write = torch.full((B,), T + step)
            a, cache_a = model(token, *args, cache_a, write)
            b, cache_b = ort_kernels.forward(model, token, *args, cache_b, write)
            worst = max(worst, (a - b).abs().max().item(),
                        max((x - y).abs().max().item() for ka, kb in zip(cache_a, cache_b) for x, y in zip(ka, kb)))
    return worst


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma"])
@pytest.mark.parametrize("capacity", [None, 32], ids=["dynamic", "static"])
def test_fused_ops_compute_what_the_reference_layers_compute(checkpoints, family, capacity):
    """The eager bodies of tk::add_rms_norm and tk::gqa against the reference layers, on a
    left-padded batch long enough to cross Mistral's sliding window (12)."""
    model = load_decoder(checkpoints(family))
    ids, mask = (torch.from_numpy(a) for a in left_pad(PROMPTS))
    assert _decode_both(model, ids, mask, steps=6, capacity=capacity) < 1e-5


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma"])
def test_fused_decode_step_prefills_a_row_as_the_reference_does(checkpoints, family):
    """The unpadded static decode step with S new tokens (what a decode graph that also prefills
    runs, with no attention bias): each row's prompt alone, from cache index 0, gives the
    reference's logits and cache for the left-padded batch, and decoding on from there too
    (Mistral's prompt of 14 crosses its window of 12)."""
    model = load_decoder(checkpoints(family))
    ids, mask = (torch.from_numpy(a) for a in left_pad(PROMPTS))
    B, T, capacity = *ids.shape, 32
    c = model.config
    with torch.no_grad():
        ref, ref_cache = model(ids, mask, position_ids_from_mask(mask))
        token = ref[:, -1].argmax(-1, keepdim=True)
        mask2 = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
        ref2, _ = model(token, mask2, mask2.sum(-1, keepdim=True) - 1, ref_cache)
        for b in range(B):
            n = int(mask[b].sum())
            row_mask = torch.zeros(1, capacity, dtype=torch.int64)
            row_mask[0, :n] = 1
            past = [tuple(torch.zeros(1, c.num_kv_heads, capacity, c.head_dim) for _ in range(2))] * c.num_layers
            logits, cache = ort_kernels.forward(model, ids[b:b + 1, T - n:], row_mask, torch.arange(n)[None], past,
                                                torch.tensor([0]), last_only=True, decode_prefills=True)
            assert (logits[0, -1] - ref[b, -1]).abs().max() < 1e-5 * ref.abs().max()
            for (k, v), (rk, rv) in zip(cache, ref_cache):
                assert (k[0, :, :n] - rk[b, :, T - n:]).abs().max() < 1e-5
                assert (v[0, :, :n] - rv[b, :, T - n:]).abs().max() < 1e-5
                assert not k[0, :, n:].any()  # nothing written past the row's tokens
            row_mask[0, n] = 1
            logits, _ = ort_kernels.forward(model, token[b:b + 1], row_mask, torch.tensor([[n]]), cache,
                                            torch.tensor([n]), last_only=True, decode_prefills=True)
            assert (logits[0, -1] - ref2[b, -1]).abs().max() < 1e-5 * ref2.abs().max()


@pytest.fixture(scope="module")
def fused_llama(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("fused") / "artifact"
    export_artifact(checkpoints("llama"), out, kv_cache="static", max_seq_len=64, target="ort",
                    prefill_logits="last")
    return out


def test_fused_graphs_use_ort_kernels_and_keep_the_contract(fused_llama):
    manifest = Manifest.read(fused_llama)
    assert manifest.variant.target == "ort" and manifest.dims.variant.prefill_logits == "last"
    assert manifest.validation.passed
    assert not manifest.trt_lint["ok"]  # contrib ops: TensorRT cannot parse them, and the lint says so
    assert any(p["rule"] == "domain" for p in manifest.trt_lint["problems"])
    ops = {}
    for graph in contract.GRAPHS:
        model = onnx.load(str(fused_llama / contract.GRAPH_FILES[graph]), load_external_data=False)
        ops[graph] = [(n.domain, n.op_type) for n in model.graph.node]
    ms = "com.microsoft"
    assert ops["decode"].count((ms, "GroupQueryAttention")) == 2  # one per layer: RoPE, cache write, attention
    assert ops["decode"].count((ms, "SkipSimplifiedLayerNormalization")) == 4  # residual add + norm, fused
    assert ops["prefill"].count((ms, "SkipSimplifiedLayerNormalization")) == 4
    assert not {"TensorScatter", "Attention", "RotaryEmbedding"} & {op for _, op in ops["decode"]}
    prefill = onnx.load(str(fused_llama / "prefill.onnx"), load_external_data=False)
    logits = prefill.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in logits] == ["batch_size", 1, 384]
    decode = onnx.load(str(fused_llama / "decode.onnx"), load_external_data=False)
    assert manifest.variant.decode_prefills and manifest.dims.max_run is None
    assert [d.dim_param or d.dim_value for d in decode.graph.input[0].type.tensor_type.shape.dim] == [
        "batch_size", "sequence_length"]  # a run of new tokens: the decode graph also prefills
    assert [d.dim_param or d.dim_value for d in decode.graph.output[0].type.tensor_type.shape.dim] == [
        "batch_size", "kept_sequence_length", 384]  # the positions logits_to_keep names (a run's last, or a verify run's)
    assert [i.name for i in decode.graph.input][3:5] == ["write_indices", "logits_to_keep"]
    # export validation judged both ways of prefilling: through the decode graph and prefill.onnx
    assert {c["backend"] for c in manifest.validation.comparisons} == {"ort", "ort/pre"}


def test_one_session_prefills_through_the_decode_graph(fused_llama):
    """On the CPU, ORT holds only the decode graph's session (one packed copy of the weights) and
    prefills each row through it; its logits, caches and tokens equal prefill.onnx's."""
    with OrtRuntime(fused_llama) as one, OrtRuntime(fused_llama, prefill_via="prefill") as two:
        assert one.prefill_via == "decode" and set(one.sessions) == {"decode"}
        assert two.prefill_via == "prefill" and set(two.sessions) == {"prefill", "decode"}
        ids, mask = left_pad(PROMPTS)
        (a, sa), (b, sb) = one.start(ids, mask, room=4), two.start(ids, mask, room=4)
        with sa, sb:
            np.testing.assert_allclose(a.logits, b.logits, atol=1e-4)
            real = mask.astype(bool)
            for x, y in zip(one.cache_arrays(sa), two.cache_arrays(sb)):
                np.testing.assert_allclose(x.transpose(0, 2, 1, 3)[real], y.transpose(0, 2, 1, 3)[real], atol=1e-5)
            for token in ([3, 4], [5, 6]):
                np.testing.assert_allclose(one.step(sa, token).logits, two.step(sb, token).logits, atol=1e-4)
        assert ([r.tokens for r in generate(one, PROMPTS, 16, ignore_eos=True).rows]
                == [r.tokens for r in generate(two, PROMPTS, 16, ignore_eos=True).rows])
        with Slots(one, 3) as slots:
            first = slots.admit(2, PROMPTS[1])
        np.testing.assert_allclose(first.logits[0, -1], b.logits[1, -1], atol=1e-4)
        with pytest.raises(InputError, match="left padding"):
            one.start(np.array([[5, 6, 7]]), np.array([[1, 0, 1]]))


def test_fused_tokens_equal_portable_and_transformers(checkpoints, artifacts, fused_llama):
    with OrtRuntime(fused_llama) as fused, OrtRuntime(artifacts("llama")) as portable:
        a = [r.tokens for r in generate(fused, PROMPTS, 24, ignore_eos=True).rows]
        b = [r.tokens for r in generate(portable, PROMPTS, 24, ignore_eos=True).rows]
        ids, mask = left_pad(PROMPTS)
        last, session = fused.start(ids, mask)
        full, _ = portable.start(ids, mask)
        assert last.logits.shape == (2, 1, 384)
        np.testing.assert_allclose(last.logits[:, 0], full.logits[:, -1], atol=1e-4)
        buffer = session.cache[0]
        fused.step(session, [9, 9])
        assert session.cache[0] is buffer and buffer[:, :, 14].any()  # GroupQueryAttention wrote into tk's buffer
    assert a == b
    assert a[1] == hf_greedy(checkpoints("llama"), PROMPTS[1], 24)


def test_fused_parity_and_probes_pass(fused_llama):
    report = parity(fused_llama, ["ort"], steps=12)
    assert report.passed, report.backends["ort"].first_divergence
    probes = {p.name: p for p in report.backends["ort"].probes}
    assert "the cache at 0..5 compared" in probes["future_leak"].detail


@pytest.mark.parametrize("family, static", ci_picks(  # CI: one dynamic, one static (the rest: -m families)
    [("mistral", False), ("gemma", False), ("qwen2", False), ("llama-linear-tied-mqa", False), ("mistral", True),
     ("llama-linear-tied-mqa", True)], {("gemma", False), ("llama-linear-tied-mqa", True)}))
def test_fused_graphs_on_other_families(checkpoints, tmp_path, family, static):
    """Mistral's window is GroupQueryAttention's local_window_size (12 + 16 steps cross it), also
    with the unpadded static cache a decode graph that prefills reads; Gemma brings GeGLU, a norm
    offset and a scaled embedding; Qwen2 qkv biases; MQA one KV head."""
    out = tmp_path / family
    options = dict(kv_cache="static", max_seq_len=64, prefill_logits="last") if static else {}
    manifest = export_artifact(checkpoints(family), out, target="ort", **options)
    assert manifest.validation.passed and manifest.variant.decode_prefills == static
    report = parity(out, ["ort"], steps=16)
    assert report.passed, report.backends["ort"].first_divergence


@pytest.mark.parametrize("family, why", [("qwen3", "head_dim 24 (GroupQueryAttention takes multiples of 16)"),
                                         ("phi3", "a rotary dim of 8 (GroupQueryAttention rotates multiples "
                                                  "of 16)")])
def test_ort_target_refuses_what_its_kernels_cannot_express(checkpoints, tmp_path, family, why):
    result = run("export", checkpoints(family), "-o", tmp_path / "out", "--target", "ort")
    assert result.exit_code == 2  # refused from config.json, before any weight is read
    assert result.stderr.strip().splitlines()[-1].startswith(f"Error: --target ort does not support {why}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--target", "tensorrt"], "Error: Invalid value for '--target': 'tensorrt' is not one of 'portable', 'ort'."),
    (["--prefill-logits", "first"], "Error: Invalid value for '--prefill-logits': 'first' is not one of 'all', "
                                    "'last'."),
    (["--target", "ort", "--debug-outputs"], "Error: --debug-outputs works with the dynamic cache and the portable "
                                             "target; drop --kv-cache static and --target for a debug export"),
])
def test_export_option_errors(tiny, tmp_path, args, message):
    result = run("export", tiny, "-o", tmp_path / "out", *args)
    assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1] == message
    assert not (tmp_path / "out").exists()


def test_build_engine_refuses_an_ort_target_artifact(fused_llama):
    result = run("build-engine", fused_llama)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: {fused_llama} was exported with --target ort (ONNX Runtime's own fused kernels), which TensorRT "
        "cannot parse; export with --target portable for TensorRT")


class LastOnly(TorchRuntime):
    """A backend whose prefill returns the last position's logits only, as --prefill-logits last does."""

    def run(self, graph, feeds, past, session, in_place=False):
        out, present = super().run(graph, feeds, past, session, in_place)
        if graph == contract.PREFILL:
            out.logits = out.logits[:, -1:]
        return out, present


def test_probes_still_catch_a_leak_when_prefill_returns_the_last_position_only(checkpoints):
    healthy = LastOnly(load_decoder(checkpoints("llama"))).activate()
    tol = tolerance_for("float32", healthy.model.config)
    assert all(p.passed for p in run_probes(healthy, tol)), run_probes(healthy, tol)
    leaky = load_decoder(checkpoints("llama"))
    _drop_mask(leaky.layers[0])
    results = {p.name: p for p in run_probes(LastOnly(leaky).activate(), tol)}
    assert not results["future_leak"].passed  # seen in layer 1's cache at the earlier positions
    assert "the cache at 0..5 compared" in results["future_leak"].detail
