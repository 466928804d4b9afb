"""Weight-only int4/int8: standard DequantizeLinear graphs that validate against the quantized
reference with the float tolerances, fuse into MatMulNBits, run through tk parity and tk eval,
and refuse bad options with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from hf_models import FAMILIES, ci_picks, hf_model_logits

# int4 on every family; int8 (the same graph rewrite, another integer type) on the two whose linears differ
# most: Llama's biased GQA projections and Phi-3's fused ones (CI time: an export is ~15 s). CI runs Llama and
# Gemma in int4 and both int8 cases; the other families' int4 run with -m families.
QUANT_CASES = ci_picks([(f, "int4") for f in FAMILIES] + [("llama", "int8"), ("phi3", "int8")],
                       {("llama", "int4"), ("gemma", "int4"), ("llama", "int8"), ("phi3", "int8")})


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, checkpoints):
    from tk.toolkit.pipeline.export import export_artifact

    cache = {}

    def get(family: str, weights: str, **flags):
        key = (family, weights, tuple(sorted(flags.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"q-{family}-{weights}") / "artifact"
            export_artifact(checkpoints(family), out, weights=weights, **flags)
            cache[key] = out
        return cache[key]

    return get


@pytest.mark.parametrize("family,weights", QUANT_CASES)
def test_quantized_export_validates_and_fuses(quantized, family, weights):
    from tk.models.spec.manifest import Manifest

    art = quantized(family, weights)
    m = Manifest.read(art)
    v = m.validation
    assert v.passed and v.reference == "torch float32, quantized weights"
    layers = m.config.num_layers
    assert v.fused_matmulnbits == {"prefill": 4 * layers + 1, "decode": 4 * layers + 1}
    steps = [s for c in v.comparisons for s in c["steps"]]
    assert max(s["error_ratio"] for s in steps) <= 1.0
    q = v.quantization  # measured against the full-precision reference, and recorded
    assert 0.0 <= q["top1_mean"] <= 1.0 and q["max_abs"] > 0
    graph = onnx.load(str(art / "decode.onnx"), load_external_data=False)
    dq = [n for n in graph.graph.node if n.op_type == "DequantizeLinear"]
    kinds = {t.name: t.data_type for t in graph.graph.initializer}
    want = onnx.TensorProto.UINT4 if weights == "int4" else onnx.TensorProto.UINT8
    assert len(dq) == 4 * layers + 1 and all(kinds[n.input[0]] == want for n in dq)
    assert all(len(n.input) == 3 and kinds[n.input[2]] == want for n in dq)  # zero points, by default
    consumers = {o: [n for n in graph.graph.node if o in n.input] for d in dq for o in d.output}
    assert all(len(c) == 1 and c[0].op_type == "MatMul" for c in consumers.values())  # one MatMul per DQ


def test_quantized_reference_is_what_the_graphs_compute(quantized, checkpoints):
    """The quantized reference differs from the full-precision one (the weights really are
    quantized), ORT multiplying in float matches it to float32 rounding, and ORT's int8 compute
    lands between."""
    from tk.runtimes.backends.ort import OrtRuntime
    from tk.toolkit.backends import reference_runtime

    art = quantized("llama", "int4")
    ids = np.array([[3, 17, 42, 99, 7, 250]], np.int64)
    mask = np.ones_like(ids)

    def logits(rt):
        with rt:
            out, session = rt.start(ids, mask)
            session.close()
            return out.logits

    q_ref = logits(reference_runtime(art, quantized=True))
    full = logits(reference_runtime(art, quantized=False))
    exact = logits(OrtRuntime(art, quant_compute="float"))
    fast = logits(OrtRuntime(art))
    assert np.abs(q_ref - full).max() > 1e-2
    assert np.abs(exact - q_ref).max() < 1e-4
    assert 1e-6 < np.abs(fast - q_ref).max() < np.abs(q_ref - full).max() * 4


def test_quant_compute_reaches_the_sessions_of_the_commands(quantized, monkeypatch):
    """--quant-compute (tk generate, bench, serve, eval: the backend options): int8 by default, float where
    asked, which the sessions take as MatMulNBits' accuracy level (the logits above); a bad value is a
    usage error."""
    from clitools import ort_options_seen, run

    seen = ort_options_seen(monkeypatch, "quant_compute")
    art = quantized("llama", "int4")
    base = ["generate", art, "--prompt-ids", "3,17,42,99", "--max-new-tokens", "4", "--json"]
    for extra, want in [([], "int8"), (["--quant-compute", "float"], "float")]:
        seen.clear()
        result = run(*base, *extra)
        assert result.exit_code == 0, result.output
        assert seen == [want], extra
        assert len(json.loads(result.stdout)["rows"][0]["tokens"]) == 4
    bad = run(*base, "--quant-compute", "int4")
    assert bad.exit_code == 2 and "int8" in bad.output and "float" in bad.output


def test_int4_weights_file_is_an_eighth(quantized, artifacts):
    from tk.models.spec.manifest import Manifest
    from tk.toolkit.tools.describe import weight_bytes_by_dtype

    fp = weight_bytes_by_dtype(artifacts("llama"), Manifest.read(artifacts("llama")))
    q = weight_bytes_by_dtype(quantized("llama", "int4"), Manifest.read(quantized("llama", "int4")))
    assert set(q) == {"float32", "uint4"}  # integers and zero points (the untied embedding too, by default)
    m = Manifest.read(quantized("llama", "int4"))
    assert m.precision.quantized_embedding and "model.embed.weight_t.quant" in m.weights  # its own table
    assert "model.embed.weight" not in m.weights  # and no float copy
    assert q["float32"] < fp["float32"] / 3  # embeddings, norms, biases and the scales stay float


def test_unfused_matmul_fails_naming_it(quantized, tmp_path):
    """A DequantizeLinear that also feeds a graph output cannot fuse: the check names its MatMul."""
    import shutil

    from tk.models.spec.manifest import GraphFile, Manifest, sha256_file
    from tk.models.spec.errors import CheckFailed
    from tk.toolkit.verify.quant import check_fused

    art = tmp_path / "art"
    shutil.copytree(quantized("llama", "int4"), art)
    path = art / "decode.onnx"
    model = onnx.load(str(path), load_external_data=False)
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    matmul = next(n for n in model.graph.node if dq.output[0] in n.input)
    model.graph.output.append(onnx.helper.make_tensor_value_info(dq.output[0], onnx.TensorProto.FLOAT, None))
    onnx.save(model, str(path))
    m = Manifest.read(art)
    g = m.graphs["decode"]
    m.graphs["decode"] = GraphFile(g.file, sha256_file(path), g.data_file, g.data_bytes, g.opset, g.export_s)
    with pytest.raises(CheckFailed, match=f"{matmul.name} is a MatMul of a dequantized weight"):
        check_fused(art, m)


def test_parity_and_generate_on_int4(quantized):
    art = quantized("mistral", "int4")
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "parity", str(art), "--steps", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parity passed" in r.stdout + r.stderr


def test_int4_fast_export_runs_one_session_and_benches(quantized):
    """The CPU deployment export (int4, --target ort, static cache, last logits): its decode graph
    also prefills, so ORT holds one session (one packed copy of the weights); it validates both
    ways of prefilling, generates what prefill.onnx generates, and tk bench reads its real bytes."""
    from tk.models.spec.manifest import Manifest
    from tk.runtimes.decoding.generate import generate
    from tk.runtimes.backends.ort import OrtRuntime

    art = quantized("llama", "int4", target="ort", kv_cache="static", max_seq_len=64, prefill_logits="last")
    m = Manifest.read(art)
    layers = m.config.num_layers
    assert m.variant.decode_prefills and m.validation.passed
    assert m.validation.fused_matmulnbits == {"prefill": 4 * layers + 1, "decode": 4 * layers + 1}
    assert {c["backend"] for c in m.validation.comparisons} == {"ort", "ort/pre"}
    prompts = [[5, 17, 99, 3, 8], [42, 8, 300, 12, 77, 150, 9]]
    with OrtRuntime(art) as one, OrtRuntime(art, prefill_via="prefill") as two:
        assert set(one.sessions) == {"decode"} and set(two.sessions) == {"prefill", "decode"}
        a, b = generate(one, prompts, 12, ignore_eos=True), generate(two, prompts, 12, ignore_eos=True)
        assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows]
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "bench", str(art), "--backends", "ort", "--prompt-len",
                        "8", "--new-tokens", "6", "--repeats", "1", "--profile"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    mib = (art / "weights.onnx.data").stat().st_size / 2**20
    assert f"weights {mib:,.1f} MiB" in r.stdout and "kernels" in r.stdout


def test_eval_perplexity_matches_transformers(artifacts, checkpoints, tmp_path):
    """tk eval's NLL on the torch and ORT backends equals one computed from transformers' own
    logits on the same tokens, window by window."""
    from tk.toolkit.verify.perplexity import evaluate, windows
    from tk.toolkit.textgen import Tokenizer

    art = artifacts("qwen2")
    text = "Once upon a time there was a small model. " * 12
    result = evaluate(art, text, ["torch", "ort"], window=32)
    ids = Tokenizer(art).encode(text)
    total, count = 0.0, 0
    for chunk in windows(ids, 32):
        logits = hf_model_logits(checkpoints("qwen2"), chunk).astype(np.float64)[:-1]
        log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        total += float((log_z - logits[np.arange(len(chunk) - 1), chunk[1:]]).sum())
        count += len(chunk) - 1
    for name in ("torch", "ort"):
        row = result["backends"][name]
        assert row["tokens"] == count
        assert row["nll"] == pytest.approx(total / count, abs=1e-4)
        assert row["perplexity"] == pytest.approx(np.exp(total / count), rel=1e-3)


def test_eval_on_int4_shows_the_baseline(quantized, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "eval", str(quantized("llama", "int4")), "--text",
                        str(text), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["backends"]
    assert set(rows) == {"torch", "ort", "torch (full-precision weights)"}
    assert rows["torch"]["nll"] != rows["torch (full-precision weights)"]["nll"]
    assert rows["ort"]["nll"] == pytest.approx(rows["torch"]["nll"], rel=0.05)
    for name in ("torch", "ort"):  # against the full-precision reference: KL and top-1, as llama.cpp reports them
        row = rows[name]
        assert 0 < row["kl_mean"] and 0 < row["kl_p99"] and 0.0 < row["top1_agreement"] <= 1.0  # a random model
        assert row["perplexity_ratio"] == pytest.approx(np.exp(row["nll"] - rows["torch (full-precision weights)"]["nll"]))


@pytest.mark.parametrize("flags,message", [
    (["--weights", "int3"], "Invalid value for '--weights'"),
    (["--weights", "int4", "--block-size", "48"], "--block-size 48 is not one"),
    (["--weights", "int4", "--quant-method", "hqq"], "Invalid value for '--quant-method'"),
    (["--mixed-precision", "sensitive"], "--mixed-precision is about quantized weights; add --weights"),
    (["--weights", "int4", "--mixed-precision", "lm-head", "--no-quantize-lm-head"], "keeps the LM head in int8"),
    (["--weights", "int4", "--mixed-precision", "lm-head-w8a8"], "runs on ONNX Runtime's integer GEMM"),
    (["--weights", "int4", "--mixed-precision", "lm-head-w8a8", "--for", "ort-cpu", "--lm-head-block-size", "16"],
     "one scale a column; drop --lm-head-block-size"),
    (["--block-size", "32"], "add --weights int4 or int8"),
    (["--weights", "int4", "--dtype", "bf16"], "no ONNX Runtime CPU kernel"),
    (["--weights", "int8", "--opset", "20"], "needs --opset 21"),
])
def test_bad_quantization_options(checkpoints, tmp_path, flags, message):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "export", str(checkpoints("llama")), "-o", str(out),
                        *flags], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_build_engine_refuses_blocks_tensorrt_does_not_take(quantized):
    from tk.models.spec.manifest import Manifest

    art = quantized("llama", "int4", zero_points=False)  # symmetric, block 32: ONNX Runtime's default, not TensorRT's
    assert any(p["rule"] == "int4-block" for p in Manifest.read(art).trt_lint["problems"])
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "build-engine", str(art)], capture_output=True, text=True)
    assert r.returncode == 2 and "TensorRT takes blocks of 64 or 128; re-export with --block-size 128" in r.stderr
    assert "Traceback" not in r.stderr


def test_int4_block_128_passes_the_tensorrt_lint(tmp_path, trained_like):
    from tk.models.spec.manifest import Manifest
    from tk.toolkit.pipeline.export import export_artifact

    # the lint reads the graphs, not the integers: round-to-nearest makes the same graphs as the search, sooner
    export_artifact(trained_like, tmp_path / "art", weights="int4", block_size=128, validate=False, zero_points=False,
                    quantize_embedding=False, quant_method="rtn")  # TensorRT's form: what --for trt exports
    lint = Manifest.read(tmp_path / "art").trt_lint
    assert lint["ok"], lint["problems"][:2]
    export_artifact(trained_like, tmp_path / "zp", weights="int4", block_size=128, validate=False, quant_method="rtn")
    assert {p["rule"] for p in Manifest.read(tmp_path / "zp").trt_lint["problems"]} >= {"quant-zero-points"}
    assert lint["min_tensorrt"] == "10.15"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tk.models.fixtures.presets import write_preset

    return write_preset("trained", tmp_path_factory.mktemp("trained"))


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_trained_model_keeps_its_tokens_within_the_table(trained, tmp_path, weights):
    """On a model really trained, quantization costs what the table expects: a quantizer that
    scrambles scales or nibbles (and still matches its own reference) fails here."""
    from tk.models.spec.manifest import Manifest
    from tk.toolkit.pipeline.export import export_artifact
    from tk.toolkit.verify.quant import QUANT_TABLE

    export_artifact(trained, tmp_path / "art", weights=weights)
    q = Manifest.read(tmp_path / "art").validation.quantization
    assert q["within_table"], q
    min_top1, _, max_kl = QUANT_TABLE[weights]
    assert q["top1_mean"] >= min_top1 and q["kl_max_mean"] <= max_kl


def test_mixed_precision_and_the_tied_table(checkpoints, tmp_path):
    """--mixed-precision sensitive on a tied model: the LM head's table (which the embedding is
    gathered from: no float embedding is written) and the sensitive layers' QKV and down projections
    in uint8, the rest uint4, every MatMul fused, the graphs equal to their reference, and tk inspect
    counts the bytes by type."""
    from tk.models.spec.manifest import Manifest
    from tk.models.quant.plan import sensitive_layers
    from tk.toolkit.pipeline.export import export_artifact
    from tk.toolkit.tools.describe import weight_bytes_by_dtype

    art = tmp_path / "art"
    export_artifact(checkpoints("qwen2"), art, weights="int4", mixed_precision="sensitive")
    m = Manifest.read(art)
    assert m.precision.quantized_embedding and m.precision.mixed == "sensitive" and m.validation.passed
    layers = m.config.num_layers
    assert m.validation.fused_matmulnbits == {"prefill": 4 * layers + 1, "decode": 4 * layers + 1}
    kinds = {name.removeprefix("model.").removesuffix(".weight_t.quant"): e[2] for name, e in m.weights.items()
             if name.endswith(".quant")}
    int8 = {"lm_head"} | {f"layers.{i}.{w}" for i in sensitive_layers(layers) for w in ("attn.wqkv", "ffn.w_down")}
    assert {n for n, k in kinds.items() if k == "uint8"} == int8
    assert {k for n, k in kinds.items() if n not in int8} == {"uint4"}
    assert "model.embed.weight" not in m.weights  # gathered from the LM head's table
    graph = onnx.load(str(art / "decode.onnx"), load_external_data=False)
    assert any(n.op_type == "Gather" and n.input[0] == "model.lm_head.weight_t.quant.bytes" for n in graph.graph.node)
    by_dtype = weight_bytes_by_dtype(art, m)
    assert set(by_dtype) >= {"uint4", "uint8", "float32"} and sum(by_dtype.values()) <= (art / "weights.onnx.data").stat().st_size


def test_a_w8a8_lm_head_runs_on_the_integer_gemm_and_a_row_does_not_depend_on_its_batch(checkpoints, tmp_path,
                                                                                         monkeypatch):
    """--mixed-precision lm-head-w8a8 on a tied model, --for ort-cpu: the LM head's table in int8 of 7 bits
    with a scale a column (the embedding gathered from it), its MatMul ONNX Runtime's MatMulIntegerToFloat
    over the input rounded to int8 a row at a time, every other quantized MatMul fused into MatMulNBits, the
    graphs equal to the quantized reference (which rounds the head's input as the graph does) on every CPU,
    and a row's logits bit for bit the same whatever rows run beside it. A table of full-range 8-bit
    weights (an older tk's) is refused, in one line, where the integer GEMM saturates, and loads where not."""
    from tk.models.quant.quantize import W8A8_QMAX
    from tk.models.spec.manifest import Manifest
    from tk.runtimes.backends import ort as ort_module
    from tk.runtimes.backends.ort import OrtRuntime
    from tk.runtimes.backends.ort_weights import integer_extremes
    from tk.runtimes.errors import BackendUnavailable
    from tk.toolkit.pipeline.export import export_artifact
    from tk.toolkit.verify.metrics import run_trace

    art = tmp_path / "art"
    export_artifact(checkpoints("qwen2"), art, profile="ort-cpu", max_seq_len=64, weights="int4",
                    mixed_precision="lm-head-w8a8")
    m = Manifest.read(art)
    assert m.precision.mixed == "lm-head-w8a8" and m.precision.quantized_embedding and m.validation.passed
    layers, hidden, vocab = m.config.num_layers, m.config.hidden_size, m.config.vocab_size
    assert m.validation.fused_matmulnbits == {"prefill": 4 * layers, "decode": 4 * layers}
    head = {n: e for n, e in m.weights.items() if n.startswith("model.lm_head.weight_t.")}
    assert head["model.lm_head.weight_t.quant"][2] == "int8" and list(head["model.lm_head.weight_t.scale"][3]) == [1, vocab]
    assert "model.lm_head.weight_t.zero" not in head and "model.embed.weight" not in m.weights
    graph = onnx.load(str(art / "decode.onnx"), load_external_data=False).graph
    integer = [n for n in graph.node if n.op_type == "MatMulIntegerToFloat"]
    assert len(integer) == 1 and integer[0].input[1] == "model.lm_head.weight_t.quant"
    assert {o.domain for o in onnx.load(str(art / "decode.onnx"), load_external_data=False).opset_import} >= {"com.microsoft"}
    rng = np.random.default_rng(3)
    ids = rng.integers(3, vocab, (3, 7))
    mask = np.ones_like(ids)
    with OrtRuntime(art) as ort:
        batch = run_trace(ort, ids, mask, 4, keep_present=False)
        for r in range(3):
            # beside another row of the batch (a row alone takes a kernel of its own in the int4 layers' MatMulNBits
            # on a CPU without VNNI: ort_probes.one_row_apart; the integer GEMM has none)
            pair = [r, (r + 1) % 3]
            other = run_trace(ort, ids[pair], mask[pair], 4, keep_present=False)
            assert all(np.array_equal(b[r], a[0]) for b, a in zip(batch.logits, other.logits))
    assert np.ptp(batch.logits[-1][:, -1], axis=-1).min() > 1.0  # not flat: the rows' argmaxes mean something
    assert hidden == m.weights["model.lm_head.weight_t.quant"][3][0]
    # parity's view of the head (toolkit/verify/head_rounding.py): the reference records what its head
    # took in before rounding, and the artifact's int8 rows and column scales give its logits back
    import torch

    from tk.models.quant.quantize import quantize_rows
    from tk.toolkit.backends import reference_runtime
    from tk.toolkit.verify.head_rounding import HeadRounding, record_head_inputs

    with reference_runtime(art, m) as ref, record_head_inputs(ref) as seen:
        trace = run_trace(ref, ids, mask, 2, keep_present=False)
    assert [a.shape for a in seen] == [(3, 7, hidden), (3, 1, hidden), (3, 1, hidden)]
    q, scale = HeadRounding.of(art, m).weights()
    assert q.dtype == np.int8 and q.shape == (hidden, vocab) and scale.shape == (vocab,)
    for x, logits in zip(seen, trace.logits):
        again = quantize_rows(torch.from_numpy(x)).numpy() @ (q.astype(np.float32) * scale)
        np.testing.assert_allclose(again, logits, rtol=1e-5, atol=1e-4)
    # 7 bits: every column's largest weight at 63 (round to nearest from the column's max |w|), none past it
    lo, hi = integer_extremes(art, m)
    assert hi == W8A8_QMAX and lo >= -W8A8_QMAX - 1
    assert (np.abs(q).max(0) == W8A8_QMAX).all()
    # a CPU whose integer GEMM saturates past 7 bits (an AVX2 one, as ort_probes asks it) loads this file, and
    # refuses one whose table has a full-range weight, saying what to do; where the GEMM is exact, that loads
    monkeypatch.setattr(ort_module, "integer_gemm_saturates", lambda qmax=127: qmax > W8A8_QMAX)
    with OrtRuntime(art) as rt:
        assert rt.sessions
    offset = m.weights["model.lm_head.weight_t.quant"][0]
    with open(art / "weights.onnx.data", "r+b") as f:
        f.seek(offset)
        f.write(np.int8(127).tobytes())
    with pytest.raises(BackendUnavailable, match="full-range 8-bit weights") as refused:
        with OrtRuntime(art):
            pass
    assert "re-export" in str(refused.value) and "\n" not in str(refused.value)
    monkeypatch.setattr(ort_module, "integer_gemm_saturates", lambda qmax=127: False)
    with OrtRuntime(art) as rt:
        assert rt.sessions


def test_the_integer_gemm_probe_agrees_with_the_cpus_instructions():
    """runtimes/backends/ort_probes.py asks ONNX Runtime whether its u8s8 GEMM saturates here: with full-range
    8-bit weights, on x86, exactly where the CPU has no 8-bit dot product into 32 bits (AVX-512 VNNI,
    AVX-VNNI, AMX), and there with one bit more than a W8A8 table's 7 too; with the 7 bits, nowhere."""
    import platform

    from tk.models.quant.quantize import W8A8_QMAX
    from tk.runtimes.backends.ort_probes import integer_gemm_saturates

    assert not integer_gemm_saturates(W8A8_QMAX)
    assert integer_gemm_saturates(W8A8_QMAX + 1) == integer_gemm_saturates()
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.is_file():
        pytest.skip("reads an x86 Linux CPU's flags from /proc/cpuinfo")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    assert integer_gemm_saturates() == (not flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


@pytest.mark.parametrize("first", ["a runtime", "the probes"])
def test_the_cpu_probes_run_beside_the_shared_thread_pool(first):
    """The tk command runs its ONNX Runtime sessions on the process-wide pool (ort_pool.use_shared_thread_pool), sized
    by the first runtime's --threads, and ONNX Runtime then refuses any session with a pool of its own. A probe
    asked once a runtime is open (`tk export --for serve --weights int4` validates so) runs on that pool; one
    asked before (`tk serve` asks while loading) leaves the pool for the runtime to size. In a process of its
    own each (the pool is for good)."""
    code = f"""
import onnxruntime as ort
from onnx import TensorProto, helper
from tk.runtimes.backends import ort_pool, ort_probes
ort_pool.use_shared_thread_pool()
x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy")
model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))
probes = (ort_probes.one_row_apart(), ort_probes.integer_gemm_saturates()) if {first == "the probes"} else ()
ort.InferenceSession(model.SerializeToString(), ort_pool.session_options(ort, 3), providers=["CPUExecutionProvider"])
probes = probes or (ort_probes.one_row_apart(), ort_probes.integer_gemm_saturates())
print(*probes, ort_pool._SHARED_POOL["threads"])
"""
    from tk.runtimes.backends.ort_probes import integer_gemm_saturates, one_row_apart

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # what a pool of the probes' own says, and the pool sized by the runtime's threads
    assert done.stdout.split() == [str(one_row_apart()), str(integer_gemm_saturates()), "3"]


def test_calibration_weights_the_search_and_rebuilds_its_reference(trained, tmp_path):
    """--calibration: the activation statistics and the channel scales searched with them are kept
    in the artifact and recorded in the manifest, change the integers the search picks, a scaled QKV's
    norm is folded into the graphs' norm, and the quantized reference rebuilt from them later (tk
    parity) still matches the graphs."""
    from safetensors.numpy import load_file

    from tk.models.spec.manifest import Manifest
    from tk.models.fixtures.presets import CORPUS
    from tk.models.quant.quantize import Scheme, pack_int4, quantize
    from tk.models.quant.calibration import load

    text = tmp_path / "calibration.txt"
    text.write_text(CORPUS * 2, encoding="utf-8")
    calibrated = tmp_path / "calibrated"
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "export", str(trained), "-o", str(calibrated),
                        "--weights", "int4", "--calibration", str(text)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = Manifest.read(calibrated)
    assert m.validation.passed and m.precision.calibration.tokens > 100
    assert m.precision.calibration.file == "calibration.txt" and (calibrated / "calibration.npz").is_file()
    entry = m.weights["model.layers.1.ffn.w_down.weight_t.quant"]
    stored = (calibrated / "weights.onnx.data").read_bytes()[entry[0]:entry[0] + entry[1]]
    down = load_file(str(trained / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    plain = pack_int4(quantize(np.ascontiguousarray(down.T), Scheme("int4", 32, "search", True)).q)  # uncalibrated
    assert plain.tobytes() != stored and len(plain.tobytes()) == len(stored)
    calibration = load(calibrated)
    assert m.precision.calibration.scaled_weights == len(calibration.scales) > 0
    layer = next(i for i in range(4) if f"layers.{i}.attn.wqkv.weight" in calibration.scales)
    offset, length = m.weights[f"model.layers.{layer}.attn_norm.weight"][:2]
    folded = np.frombuffer((calibrated / "weights.onnx.data").read_bytes()[offset:offset + length], np.float32)
    original = load_file(str(trained / "model.safetensors"))[f"model.layers.{layer}.input_layernorm.weight"]
    np.testing.assert_allclose(folded, original / calibration.scales[f"layers.{layer}.attn.wqkv.weight"], rtol=1e-6)
    r = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "parity", str(calibrated), "--backends",
                        "torch,ort", "--steps", "4"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = subprocess.run([sys.executable, "-m", "tk.toolkit.cli.main", "export", str(trained), "-o",
                          str(tmp_path / "x"), "--weights", "int4", "--calibration", str(tmp_path / "missing.txt")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--calibration" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists()
