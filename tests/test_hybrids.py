"""Hybrid decoders (LFM2, Qwen3.5, Qwen3-Next, Granite 4.0-H): layers whose state is not a KV cache.

The recurrence's math (a run in closed form, the triangular solve by blocks, runs carrying the state),
the exported graph's in-place rule, then each family end to end: exported portable and `--for
ort-cpu`, validated, `tk parity` with its probes, and transformers' greedy tokens on prompts past
the convolution, past a run and of 1,100 tokens, through ONNX Runtime and the torch backend. Then
what a user meets: seeded sampling, tk inspect's state per slot, planted state faults that parity
localizes, serving with rows entering and leaving, what is refused in one line, int4.

CI runs LFM2 (both exports), Qwen3.5 through `--for ort-cpu` and Granite 4.0-H's portable graph (each
kind of recurrent layer, each target); `pytest -m families` runs the whole matrix. The logits against
transformers on the torch backend, every family and checkpoint layout, are tests/test_models.py's.
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

from clitools import error_line, run
from hf_models import HYBRIDS, ci_picks, hf_greedy
from tk.exporters.contract_check import in_place_problems
from tk.models.reference.recurrent import causal_conv, linear_attention, unit_lower_inverse
from tk.models.spec import contract
from tk.models.spec.config import DecoderConfig
from tk.models.spec.manifest import Manifest, Precision, sha256_file
from tk.models.spec.variant import Variant
from tk.runtimes.decoding.generate import generate
from tk.runtimes.decoding.sampling import SamplingConfig
from tk.runtimes.serving.batching import Batcher, BatcherLimits, Request, wait_all
from tk.toolkit.backends import BackendOptions, open_runtime
from tk.toolkit.verify.compare import parity

SLOTS = BackendOptions(static_cache=True)


def _recurrent(q, k, v, state, g, beta, scale):
    """The rules token by token in float64: what every run of linear_attention must compute."""
    q, k, v, state, g = (t.double() for t in (q, k, v, state, g))
    out = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        kt, vt = k[:, :, t], v[:, :, t]
        if beta is not None:
            vt = (vt - (state * kt[..., None]).sum(-2)) * beta[:, :, t, None].double()
        state = state + kt[..., None] * vt[..., None, :]
        out.append((state * (scale * q[:, :, t])[..., None]).sum(-2))
    return torch.stack(out, 2), state


def _inputs(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, H, dk, dv = 2, 3, 8, 4
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731  (the DeltaNet's l2-normed q and k)
    return (unit(torch.randn(B, H, T, dk, generator=g)), unit(torch.randn(B, H, T, dk, generator=g)),
            torch.randn(B, H, T, dv, generator=g), torch.randn(B, H, dk, dv, generator=g),
            -3 * torch.rand(B, H, T, generator=g), torch.rand(B, H, T, generator=g))


@pytest.mark.parametrize("T", [1, 5, 37, 64])
def test_the_inverse_by_blocks_is_the_triangular_solve(T):
    a = torch.randn(2, T, T, dtype=torch.float64, generator=torch.Generator().manual_seed(T)).tril(-1) * 0.3
    eye = torch.eye(T, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(eye + a, eye.expand(2, T, T), upper=False, unitriangular=True)
    assert torch.allclose(unit_lower_inverse(a), expected, atol=1e-12)


@pytest.mark.parametrize("rule", ["gated_delta", "gated"])
def test_a_run_in_pieces_equals_the_run_whole_and_the_recurrence(rule):
    """150 tokens whole (eager: runs of 64), and in pieces of 1, 7, 64, 13 and 65 with the state carried
    between them: the same as the float64 recurrence, token by token."""
    q, k, v, s0, g, beta = _inputs(150)
    beta = beta if rule == "gated_delta" else None
    expected, last = _recurrent(q, k, v, s0, g, beta, 0.5)
    whole, state = linear_attention(q, k, v, s0, g, beta, 0.5)
    outs, s, at = [], s0, 0
    for n in (1, 7, 64, 13, 65):
        part = slice(at, at + n)
        o, s = linear_attention(q[:, :, part], k[:, :, part], v[:, :, part], s, g[:, :, part],
                                None if beta is None else beta[:, :, part], 0.5)
        outs.append(o)
        at += n
    for out, final in ((whole, state), (torch.cat(outs, 2), s)):
        assert (out.double() - expected).abs().max() < 2e-6 * expected.abs().max()
        assert (final.double() - last).abs().max() < 2e-6 * last.abs().max()


def test_a_convolution_in_pieces_carries_its_last_inputs():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 6, 20, generator=g), torch.randn(6, 1, 4, generator=g), torch.randn(6, generator=g)
    zero = torch.zeros(2, 6, 3)
    whole, carry = causal_conv(x, w, b, zero, silu=True)
    y1, c1 = causal_conv(x[:, :, :1], w, b, zero, silu=True)  # fewer tokens than the carry
    y2, c2 = causal_conv(x[:, :, 1:], w, b, c1, silu=True)
    assert torch.allclose(torch.cat([y1, y2], -1), whole, atol=1e-6) and torch.equal(c2, carry)
    assert torch.equal(carry, x[:, :, -3:])


def test_a_state_read_after_its_update_is_refused():
    """A runtime updates a recurrent state in place, so the exporter refuses a decode graph in which a
    node reads a state input without feeding its output (it could run after the write)."""
    cfg = DecoderConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2,
                        layer_types=["conv"], conv_kernel=3)
    dims = contract.GraphDims.of(cfg, Precision(), Variant(cache="static", capacity=8, decode_prefills=True))
    past, present = dims.past_names()[0], dims.present_names()[0]
    from onnx import TensorProto, helper

    def graph(late: bool):
        nodes = [helper.make_node("Identity", [past], ["carry"]), helper.make_node("Neg", ["carry"], [present])]
        nodes += [helper.make_node("Abs", [past], ["logits"]) if late else helper.make_node("Abs", ["carry"], ["logits"])]
        value = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 2])  # noqa: E731
        return helper.make_model(helper.make_graph(nodes, "g", [value(past)], [value("logits"), value(present)]))

    assert in_place_problems(graph(late=False), contract.DECODE, dims) == []
    (problem,) = in_place_problems(graph(late=True), contract.DECODE, dims)
    assert "reads past_key_values.0.conv but does not feed present.0.conv" in problem


@pytest.fixture(scope="module")
def hybrid(exported):
    """(family, profile or None) -> its artifact, exported and validated once per module (conftest.py)."""
    return exported


def _tokens(artifact, backend: str, prompt: list[int], n: int, sampling=SamplingConfig()) -> list[int]:
    with open_runtime(artifact, backend, BackendOptions()) as rt:
        return generate(rt, [prompt], n, sampling, ignore_eos=True).rows[0].tokens


@pytest.mark.slow
@pytest.mark.parametrize("family, profile", ci_picks(
    [(f, p) for f in HYBRIDS for p in (None, "ort-cpu")],
    {("lfm2", None), ("lfm2", "ort-cpu"), ("qwen35", "ort-cpu"), ("granite_h", None)}))
def test_exports_pass_parity_and_give_transformers_tokens(checkpoints, hybrid, family, profile):
    """One graph, decode.onnx, which takes prompts in runs: validated, tk parity with its probes (leaks,
    drift, cache and state vs recompute), and greedy tokens equal to transformers' after prompts past
    the convolution's width (5) and past a run of 64 (70), through ONNX Runtime and the torch backend."""
    art = hybrid(family, profile)
    manifest = Manifest.read(art)
    assert manifest.validation.passed and set(manifest.graphs) == {"decode"}
    assert not (art / "prefill.onnx").exists() and manifest.contract_version == contract.CONTRACT_VERSION
    report = parity(art, ["ort"], steps=8)
    assert report.passed and all(p.passed for p in report.backends["ort"].probes), report.backends["ort"]
    rng = np.random.default_rng(0)
    for length in (5, 70):
        prompt = rng.integers(2, manifest.config.vocab_size, length).tolist()
        expected = hf_greedy(checkpoints(family), prompt, 12)
        assert _tokens(art, "ort", prompt, 12) == expected, length
        assert _tokens(art, "torch", prompt, 12) == expected, length
    ops = {n.op_type for n in onnx.load(str(art / "decode.onnx"), load_external_data=False).graph.node}
    fused = {"CausalConvWithState", "LinearAttention"} & ops
    assert fused == (set() if profile is None else {"CausalConvWithState"} | ({"LinearAttention"} if family != "lfm2"
                                                                               else set()))


@pytest.mark.slow
@pytest.mark.parametrize("family, profile", ci_picks(
    [(f, p) for f in HYBRIDS for p in (None, "ort-cpu")], {("lfm2", "ort-cpu")}))
def test_a_prompt_of_1100_tokens_gives_transformers_tokens(checkpoints, hybrid, family, profile):
    """Past 17 runs of a portable graph (one run through the fused kernels), the state carried between them."""
    art = hybrid(family, profile)
    prompt = np.random.default_rng(1).integers(2, Manifest.read(art).config.vocab_size, 1100).tolist()
    assert _tokens(art, "ort", prompt, 12) == hf_greedy(checkpoints(family), prompt, 12)


def test_seeded_sampling_equals_the_torch_backend(hybrid):
    art = hybrid("lfm2", "ort-cpu")
    prompt = list(range(3, 80))
    sampling = SamplingConfig(temperature=0.9, top_k=40, top_p=0.9, seed=7)
    tokens = _tokens(art, "ort", prompt, 20, sampling)
    assert tokens == _tokens(art, "torch", prompt, 20, sampling) and tokens != _tokens(art, "ort", prompt, 20)


def test_inspect_shows_each_layers_state_per_slot(hybrid):
    art = hybrid("lfm2", "ort-cpu")
    result = run("inspect", art, "--seq-len", "4096")
    assert result.exit_code == 0, result.output
    cfg = Manifest.read(art).config
    carry = cfg.hidden_size * (cfg.conv_kernel - 1) * 4  # float32
    assert f"conv layers 0, 2, 3: conv {cfg.hidden_size}x{cfg.conv_kernel - 1}, {carry / 2**20:,.2f} MiB each" \
        in result.output
    assert "attention layers 1: keys and values of 4,096 positions" in result.output
    kv_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 4096
    assert (f"state per slot at 4,096 positions: {(3 * carry + kv_layer) / 2**20:,.2f} MiB "
            f"({3 * carry / 2**20:,.2f} MiB of it recurrent") in result.output
    assert f"attention in every layer would hold {4 * kv_layer / 2**20:,.2f} MiB" in result.output


def _plant(art, out, edit) -> None:
    """A copy of the artifact whose decode graph `edit` changed (its hash recorded again)."""
    shutil.copytree(art, out)
    model = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    edit(model.graph)
    onnx.save(model, str(out / "decode.onnx"))
    manifest = json.loads((out / contract.MANIFEST).read_text())
    manifest["graphs"]["decode"]["sha256"] = sha256_file(out / "decode.onnx")
    (out / contract.MANIFEST).write_text(json.dumps(manifest))


def _carry_shifted(layer: int, kernel: int):
    """The layer's carry keeps the k - 1 inputs before the last instead of the last k - 1."""
    def edit(graph):
        name = f"present.{layer}.conv"
        node = next(n for n in graph.node if name in n.output)  # Slice(concat(carry, x), 1 - k:)
        concat = node.input[0]
        graph.node.remove(node)
        consts = [onnx.helper.make_tensor(f"{name}.{p}", onnx.TensorProto.INT64, [1], [v])
                  for p, v in (("starts", -kernel), ("ends", -1), ("axes", 2))]
        graph.initializer.extend(consts)
        graph.node.append(onnx.helper.make_node("Slice", [concat, *(c.name for c in consts)], [name]))
    return edit


def _state_not_fed_back(layer: int):
    """The layer's recurrent state output is its input: the state never moves."""
    def edit(graph):
        name = f"present.{layer}.recurrent"
        node = next(n for n in graph.node if name in n.output)
        node.output[list(node.output).index(name)] = name + ".unused"
        graph.node.append(onnx.helper.make_node("Identity", [f"past_key_values.{layer}.recurrent"], [name]))
    return edit


@pytest.mark.parametrize("family, profile, fault, where", [
    ("lfm2", None, _carry_shifted(2, 3), "present.2.conv"),
    ("qwen35", "ort-cpu", _state_not_fed_back(1), "present.1.recurrent"),
])
def test_parity_catches_a_planted_state_fault_and_names_its_layer(hybrid, tmp_path, family, profile, fault, where):
    art = tmp_path / "planted"
    _plant(hybrid(family, profile), art, fault)
    report = parity(art, ["ort"], steps=4)
    assert not report.passed
    first = report.backends["ort"].first_divergence
    layer = int(where.split(".")[1])
    assert (first.where, first.layer, first.step) == (where, layer, 0), first
    if family == "lfm2":  # tk parity says it too, and exits 3
        result = run("parity", art, "--backends", "ort", "--steps", "4")
        assert result.exit_code == 3 and where in result.output and f"layer {layer}" in result.output


def test_served_rows_enter_and_leave_and_each_equals_its_solo_run(hybrid):
    """16 requests on 4 slots: prompts in chunks of 16 (a row sits decode steps out mid-prompt and keeps its
    state), rows entering and leaving, some sampled; each request's tokens are its solo run's."""
    art = hybrid("lfm2", "ort-cpu")
    m = Manifest.read(art)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, m.config.vocab_size, int(rng.integers(1, 150))).tolist() for _ in range(16)]
    budgets = [int(rng.integers(1, 30)) for _ in range(16)]
    sampling = [SamplingConfig(temperature=0.9, top_k=40, seed=i) if i % 3 == 0 else SamplingConfig() for i in range(16)]
    with open_runtime(art, "ort", SLOTS) as rt:
        solo = [generate(rt, [p], n, s, m.eos_token_ids).rows[0] for p, n, s in zip(prompts, budgets, sampling)]
    with Batcher(open_runtime(art, "ort", SLOTS), limits=BatcherLimits(slots=4, max_queue=16, step_tokens=20),
                 eos_ids=m.eos_token_ids) as batcher:
        with ThreadPoolExecutor(16) as pool:
            requests = list(pool.map(lambda a: batcher.submit(Request(*a)), zip(prompts, budgets, sampling)))
        assert wait_all(requests, 120)
    for i, (r, s) in enumerate(zip(requests, solo)):
        assert (r.tokens, r.finish_reason) == (s.tokens, s.finish_reason), i
    assert batcher.chunked and batcher.prefix is None  # prefix caching is off for a recurrent state


@pytest.mark.slow
def test_tk_serve_answers_sixteen_concurrent_clients_each_with_its_solo_tokens(hybrid):
    """The OpenAI API over a hybrid: 16 clients at once (streamed and whole, greedy and seeded, prompts of up
    to 200 tokens in chunks) through the official client; each gets the tokens `tk generate` gives alone."""
    openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")
    pytest.importorskip("fastapi", reason="the serving stack: pip install -e '.[serve]'")
    from tk.toolkit.serving.openai.process import ServeOptions, in_thread, open_server

    art = hybrid("lfm2", "ort-cpu")
    m = Manifest.read(art)
    rng = np.random.default_rng(5)
    asks = [(rng.integers(3, m.config.vocab_size, int(rng.integers(1, 200))).tolist(), int(rng.integers(1, 24)),
             i % 2 == 0, i % 4 == 3) for i in range(16)]
    with open_runtime(art, "ort", SLOTS) as rt:
        solo = [generate(rt, [p], n, SamplingConfig(temperature=0.8, top_k=30, seed=i) if sampled else SamplingConfig(),
                         m.eos_token_ids).rows[0].tokens for i, (p, n, _, sampled) in enumerate(asks)]
    srv, sock = open_server(art, "ort", BackendOptions(), ServeOptions(port=0, limits=BatcherLimits(slots=4),
                                                                         model_name="hybrid", drain_s=1.0))
    sock.close()

    def ask(i):
        prompt, n, stream, sampled = asks[i]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        extra = {"return_token_ids": True, **({"top_k": 30} if sampled else {})}
        resp = client.completions.create(model="hybrid", prompt=prompt, max_tokens=n, stream=stream, extra_body=extra,
                                         temperature=0.8 if sampled else 0, **({"seed": i} if sampled else {}))
        chunks = list(resp) if stream else [resp]
        return [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]

    with in_thread(srv) as url, ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    srv.batcher.close()
    for i, (tokens, want) in enumerate(zip(got, solo)):
        assert tokens == want, i
    assert srv.batcher.prefix is None


def test_what_a_recurrent_state_cannot_do_is_refused_in_one_line(hybrid, caplog, tmp_path):
    art = hybrid("lfm2", "ort-cpu")
    result = run("generate", art, "--prompt-ids", "5,6,7", "--lookup")
    assert result.exit_code == 1  # what the artifact cannot do, as for a dynamic cache (tests/test_speculative.py)
    assert error_line(result).startswith("Error: speculative decoding keeps a verify run's accepted tokens and "
                                         "rewinds the rest, and this model's recurrent layers carry a state")
    with caplog.at_level(logging.WARNING), Batcher(open_runtime(art, "ort", SLOTS), limits=BatcherLimits(slots=2)) as b:
        assert b.prefix is None
    assert any(r.message.startswith("prefix caching is off: this model's recurrent layers") for r in caplog.records)
    result = run("export", Manifest.read(art).source.path, "-o", tmp_path / "dyn", "--kv-cache", "dynamic")
    assert result.exit_code == 2 and "drop --kv-cache dynamic" in error_line(result)
    result = run("build-engine", hybrid("lfm2"))
    assert result.exit_code == 1 and "recurrent layers carry a state" in error_line(result)


@pytest.mark.slow
@pytest.mark.parametrize("family, weights", ci_picks([(f, w) for f in HYBRIDS for w in ("int4", "int8")],
                                                     {("lfm2", "int4")}))
def test_quantized_exports_validate_with_the_state_in_float(hybrid, family, weights):
    """Every projection (a recurrent layer's in and out ones too) in int4 or int8, fused into MatMulNBits;
    the convolutions, decays and norms stay float; validated against the quantized reference."""
    art = hybrid(family, "ort-cpu", weights=weights)
    m = Manifest.read(art)
    assert m.validation.passed and m.validation.fused_matmulnbits
    dtypes = {n.removeprefix("model."): e.dtype for n, e in m.weights.items()}
    assert dtypes["layers.0.mixer.conv_weight"] == "float32"
    assert dtypes["layers.0.mixer.w_in.weight_t.quant"] == {"int4": "uint4", "int8": "uint8"}[weights]
    assert "layers.0.mixer.w_in.weight_t" not in dtypes  # stored only quantized
    report = parity(art, ["ort"], steps=8)
    assert report.passed, report.backends["ort"].first_divergence
