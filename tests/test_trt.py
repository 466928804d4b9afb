"""TensorRT: everything that can be checked without a GPU (profiles, engine.json, the lint, the
missing-TensorRT messages, `tk build-engine` against a fake TensorRT of each major: 10.x and 11.x),
and, where TensorRT and a GPU exist, a real build and parity run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from fake_tensorrt import fake_tensorrt
from tk.exporters.trt_build import Limits, compute_profiles
from tk.exporters.trt_lint import lint_graphs, lint_model
from tk.models.spec import contract
from tk.models.spec.manifest import Manifest, sha256_file
from tk.models.spec.engine import EngineMeta, Gpu
from tk.models.spec.errors import FilesystemProblem, TkError, UsageProblem
from tk.runtimes.backends.trt import engine_problems, profile_problem
from tk.toolkit.cli.main import main

DIMS = contract.GraphDims(num_layers=2, num_kv_heads=2, head_dim=16, vocab_size=512, kv_dtype="float32")
INSTALL = ("Error: TensorRT is not installed; on a machine with an NVIDIA GPU, pip install 'tk[gpu]' "
           "--extra-index-url https://pypi.nvidia.com (TensorRT's libraries come from NVIDIA's index, not PyPI)")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# --- optimization profiles ---------------------------------------------------------------------

def test_profiles_cover_the_ranges_with_midpoint_opt():
    p = compute_profiles(DIMS, Limits(max_batch=8, max_input_len=256, max_seq_len=1024), max_context=2048)
    assert p["prefill"]["input_ids"] == [[1, 1], [4, 128], [8, 256]]
    assert p["decode"]["input_ids"] == [[1, 1], [4, 1], [8, 1]]
    assert p["decode"]["attention_mask"] == [[1, 2], [4, 512], [8, 1024]]
    assert p["decode"]["past_key_values.1.value"] == [[1, 2, 1, 16], [4, 2, 511, 16], [8, 2, 1023, 16]]
    assert set(p["decode"]) == {"input_ids", "attention_mask", "position_ids", *contract.past_names(2)}
    for graph in p.values():  # min never 0, and min <= opt <= max everywhere
        for lo, opt, hi in graph.values():
            assert all(0 < a <= b <= c for a, b, c in zip(lo, opt, hi))
    one = compute_profiles(DIMS, Limits(1, 1, 2), max_context=2048)
    assert one["decode"]["past_key_values.0.key"] == [[1, 2, 1, 16], [1, 2, 1, 16], [1, 2, 1, 16]]


@pytest.mark.parametrize("limits, message", [
    (Limits(0, 8, 16), "--max-batch must be at least 1, got 0"),
    (Limits(1, 0, 16), "--max-input-len must be at least 1, got 0"),
    (Limits(1, 1, 1), "--max-seq-len must be at least 2"),
    (Limits(1, 16, 16), r"--max-input-len \(16\) must be below --max-seq-len \(16\)"),
    (Limits(1, 8, 4096), r"--max-seq-len \(4096\) is beyond the model's context of 2048"),
])
def test_impossible_profiles_are_rejected(limits, message):
    with pytest.raises(UsageProblem, match=message):
        compute_profiles(DIMS, limits, max_context=2048)


def test_profile_problem_advice():
    p = compute_profiles(DIMS, Limits(2, 64, 2048), max_context=4096)
    limits = Limits(2, 64, 2048)
    past = {n: (1, 2, 2050, 16) for n in contract.past_names(2)}
    shapes = {"input_ids": (1, 1), "attention_mask": (1, 2051), "position_ids": (1, 1), **past}
    assert profile_problem("decode", p["decode"], shapes, limits) == (
        "decode: past length 2050 is beyond the engine's maximum 2047; rebuild with a larger --max-seq-len")
    shapes = {"input_ids": (3, 5), "attention_mask": (3, 5), "position_ids": (3, 5)}
    assert profile_problem("prefill", p["prefill"], shapes, limits) == (
        "prefill: input_ids batch 3 is beyond the engine's maximum 2; rebuild with a larger --max-batch")
    shapes = {"input_ids": (1, 100), "attention_mask": (1, 100), "position_ids": (1, 100)}
    assert "rebuild with a larger --max-input-len" in profile_problem("prefill", p["prefill"], shapes, limits)
    shapes = {"input_ids": (2, 64), "attention_mask": (2, 64), "position_ids": (2, 64)}
    assert profile_problem("prefill", p["prefill"], shapes, limits) is None


# --- engine.json ---------------------------------------------------------------------------------

ENV = {"tensorrt_version": "10.15.1", "gpu_name": "NVIDIA H100", "compute_capability": "9.0"}
ENGINE = {contract.PREFILL: b"prefill engine", contract.DECODE: b"decode engine"}  # what the fake TensorRT builds


def _meta(art) -> EngineMeta:
    """engine.json as tk build-engine writes it for the fake engines."""
    return EngineMeta(tensorrt_version="10.15.1", gpu=Gpu("NVIDIA H100", "9.0"), precision="float32",
                      limits=Limits(1, 8, 16), profiles=compute_profiles(DIMS, Limits(1, 8, 16), 1024),
                      onnx_sha256={g: sha256_file(art / contract.GRAPH_FILES[g]) for g in contract.GRAPHS},
                      engine_sha256={g: hashlib.sha256(b).hexdigest() for g, b in ENGINE.items()})


@pytest.fixture
def built(tiny_artifact, tmp_path):
    """A copy of the tiny artifact with an engine.json as tk build-engine writes it (fake engine bytes)."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    meta = _meta(art)
    (art / contract.ENGINE_META).write_text(json.dumps(meta.to_dict()))
    for g, blob in ENGINE.items():
        (art / contract.ENGINE_FILES[g]).write_bytes(blob)
    return art, meta


def test_engine_meta_round_trip_has_no_problems(built):
    from tk.runtimes.backends.trt import read_engine_meta

    art, meta = built
    assert read_engine_meta(art) == meta
    assert engine_problems(read_engine_meta(art), art, ENV) == []
    old = {k: v for k, v in meta.to_dict().items() if k != "engine_sha256"}  # written before engine hashes
    (art / contract.ENGINE_META).write_text(json.dumps(old))
    assert read_engine_meta(art).engine_sha256 is None and engine_problems(read_engine_meta(art), art, ENV) == []
    older = {**meta.to_dict(), "strongly_typed": False}  # written before every engine was strongly typed
    (art / contract.ENGINE_META).write_text(json.dumps(older))
    assert read_engine_meta(art) == meta and "strongly_typed" not in meta.to_dict()
    assert meta.tensorrt_major == 10 and dataclasses.replace(meta, tensorrt_version="11.4.0.106").tensorrt_major == 11


def test_every_engine_mismatch_has_an_actionable_message(built):
    art, meta = built
    rebuild = f"rebuild them here with: tk build-engine {art} --force"
    old = dataclasses.replace(meta, contract_version=0)
    assert engine_problems(old, art, ENV) == [
        f"the engines follow graph contract version 0 and this tk reads version {contract.CONTRACT_VERSION}; "
        f"re-export and {rebuild}"]
    assert engine_problems(meta, art, dict(ENV, tensorrt_version="10.16.0")) == [
        "the engines were built with TensorRT 10.15.1 and this machine has TensorRT 10.16.0; an engine loads only "
        f"in the version that built it: {rebuild}"]
    assert engine_problems(meta, art, dict(ENV, gpu_name="NVIDIA A10", compute_capability="8.6")) == [
        "the engines were built for NVIDIA H100 (compute capability 9.0) and this GPU is NVIDIA A10 (compute "
        f"capability 8.6); {rebuild}"]
    stale = dataclasses.replace(meta, onnx_sha256={**meta.onnx_sha256, "decode": "0" * 64})
    assert engine_problems(stale, art, ENV) == [
        f"decode.engine was built from a different decode.onnx (the graph was re-exported since); {rebuild}"]
    (art / "decode.engine").write_bytes(b"another build's decode engine")  # a pair not built together
    assert engine_problems(meta, art, ENV) == [
        f"decode.engine is not the engine engine.json was written with (a rebuild did not finish, or it was "
        f"replaced); {rebuild}"]
    (art / "prefill.engine").unlink()
    assert engine_problems(meta, art, ENV)[0] == f"prefill.engine is missing; {rebuild}"


def test_build_engine_force_never_leaves_a_loadable_mixed_pair(built, monkeypatch):
    """--force takes engine.json away before the first engine is replaced: a rebuild that stops half way
    leaves no engine.json (tk says to build the engines), and one that finishes records the new engines."""
    from tk.runtimes.backends import trt as trt_runtime
    from tk.toolkit.pipeline import build_engine

    art, meta = built
    rebuilt = {g: b"rebuilt " + blob for g, blob in ENGINE.items()}
    new_meta = dataclasses.replace(meta, engine_sha256={g: hashlib.sha256(b).hexdigest() for g, b in rebuilt.items()})
    monkeypatch.setattr(trt_runtime, "trt_environment", lambda: ENV)
    monkeypatch.setattr(build_engine, "build_engines", lambda *a, **k: (new_meta, rebuilt))
    flags = dict(precision=None, max_batch=1, max_input_len=8, max_seq_len=16, timing_cache=None, workspace=1.0,
                 progress=lambda m: None)
    with pytest.raises(FilesystemProblem, match="already has engines; pass --force"):
        build_engine.build(art, force=False, **flags)
    real_replace = os.replace

    def crash_after_prefill(src, dst):
        real_replace(src, dst)
        if str(dst).endswith(contract.ENGINE_FILES[contract.PREFILL]):
            raise OSError("disk full")

    monkeypatch.setattr(build_engine.os, "replace", crash_after_prefill)
    with pytest.raises(OSError):
        build_engine.build(art, force=True, **flags)
    assert not (art / contract.ENGINE_META).exists()
    with pytest.raises(trt_runtime.EnginesMissing, match="build them with: tk build-engine"):
        trt_runtime.read_engine_meta(art)
    monkeypatch.setattr(build_engine.os, "replace", real_replace)
    assert build_engine.build(art, force=True, **flags) == new_meta
    assert trt_runtime.read_engine_meta(art) == new_meta and engine_problems(new_meta, art, ENV) == []


# --- the lint --------------------------------------------------------------------------------------

def test_lint_passes_the_exported_graphs_and_reports_min_version(tiny_artifact):
    manifest = Manifest.read(tiny_artifact)
    assert manifest.trt_lint == {"ok": True, "min_tensorrt": "10.15", "problems": []}
    graphs = {g: onnx.load(str(tiny_artifact / contract.GRAPH_FILES[g]), load_external_data=False)
              for g in contract.GRAPHS}
    assert lint_graphs(graphs).ok


def _model(nodes, inputs, outputs, opset=23, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    ops = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, 1) for d in domains]]
    return helper.make_model(graph, opset_imports=ops)


def _t(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def test_lint_rules_each_catch_their_break():
    q4 = [_t(n, ["b", 2, "s", 16]) for n in ("q", "k", "v")]
    good = _model([helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attn")], q4, [_t("y", None)])
    result = lint_model(good, "decode")
    assert result.ok and result.min_tensorrt == "10.14"

    cached = _model([helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "pk_out", "pv_out"],
                                      name="attn")],
                    [*q4, _t("pk", ["b", 2, "p", 16]), _t("pv", ["b", 2, "p", 16])],
                    [_t("y", None), _t("pk_out", None), _t("pv_out", None)])
    assert [p.rule for p in lint_model(cached, "decode").problems] == ["attention-cache"]

    q3 = [_t(n, ["b", "s", 32]) for n in ("q", "k", "v")]
    flat = _model([helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attn", q_num_heads=2,
                                    kv_num_heads=2)], q3, [_t("y", None)])
    assert {p.rule for p in lint_model(flat, "decode").problems} == {"attention-rank"}

    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "b", [], [_t("z", [1])])
    control = _model([helper.make_node("If", ["c"], ["z"], name="if", then_branch=branch, else_branch=branch)],
                     [_t("c", [], TensorProto.BOOL), _t("x", [1])], [_t("z", [1])])
    assert [p.rule for p in lint_model(control, "decode").problems] == ["control-flow"]

    contrib = _model([helper.make_node("GroupQueryAttention", ["x"], ["z"], domain="com.microsoft", name="gqa")],
                     [_t("x", [1])], [_t("z", [1])], domains=["com.microsoft"])
    assert [p.rule for p in lint_model(contrib, "decode").problems] == ["domain"]

    unknown = _model([helper.make_node("NonMaxSuppression", ["x"], ["z"], name="nms")], [_t("x", [1])], [_t("z", [1])])
    assert [p.message for p in lint_model(unknown, "decode").problems] == [
        "op NonMaxSuppression is not in TensorRT's ONNX parser support table"]

    empty = _model([helper.make_node("Identity", ["x"], ["z"])], [_t("x", [0, 4])], [_t("z", None)])
    assert [p.rule for p in lint_model(empty, "prefill").problems] == ["dims"]

    too_new = _model([helper.make_node("Identity", ["x"], ["z"])], [_t("x", [1])], [_t("z", [1])], opset=26)
    assert [p.rule for p in lint_model(too_new, "prefill").problems] == ["opset"]

    rms = _model([helper.make_node("RMSNormalization", ["x", "w"], ["z"])], [_t("x", [1, 4]), _t("w", [4])],
                 [_t("z", None)])
    assert lint_graphs({"prefill": good, "decode": rms}).min_tensorrt == "10.15"


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_lint_kv_cache_update_must_be_in_place(elem):
    """IKVCacheUpdateLayer updates a graph input's buffer and returns it as a graph output: an op on
    either side of the TensorScatter (a Cast an fp16/bf16 export might add) leaves nothing in place."""
    cache, new = ["b", 2, 64, 16], ["b", 2, 1, 16]
    inputs = [_t("past", cache, elem), _t("new", new, elem), _t("idx", ["b"], TensorProto.INT64)]
    scatter = lambda src, dst: helper.make_node("TensorScatter", [src, "new", "idx"], [dst], name="kv")  # noqa: E731
    good = _model([scatter("past", "present")], inputs, [_t("present", cache, elem)])
    assert lint_model(good, "decode").ok
    cast_in = _model([helper.make_node("Cast", ["past"], ["past_c"], to=elem), scatter("past_c", "present")], inputs,
                     [_t("present", cache, elem)])
    assert [p.message for p in lint_model(cast_in, "decode").problems] == [
        "TensorScatter writes past_c, which is not a graph input: TensorRT's in-place KV-cache update needs the cache "
        "buffer itself, fed straight from a graph input"]
    copy_out = _model([scatter("past", "written"), helper.make_node("Identity", ["written"], ["present"])], inputs,
                      [_t("present", cache, elem)])
    assert [p.message for p in lint_model(copy_out, "decode").problems] == [
        "TensorScatter's output written is not a graph output: TensorRT's in-place KV-cache update needs the updated "
        "cache returned directly, with no op after it"]


def test_exported_static_caches_update_in_place(dtype_artifacts):
    art = dtype_artifacts["int4"]  # --for trt: a static cache written by TensorScatter
    decode = onnx.load(str(art / contract.GRAPH_FILES[contract.DECODE]), load_external_data=False)
    assert sum(n.op_type == "TensorScatter" for n in decode.graph.node) == 2 * DIMS.num_layers
    assert Manifest.read(art).trt_lint == {"ok": True, "min_tensorrt": "10.15", "problems": []}


# --- without TensorRT -----------------------------------------------------------------------------

def test_missing_tensorrt_messages(tiny_artifact):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here; this test covers machines without it")
    except ImportError:
        pass
    result = run("build-engine", tiny_artifact)
    assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1] == INSTALL
    result = run("generate", tiny_artifact, "--backend", "trt", "--prompt-ids", "1,2")
    assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1] == INSTALL
    bad = run("build-engine", tiny_artifact, "--max-batch", "0")
    assert bad.exit_code == 2 and bad.stderr.strip().splitlines()[-1] == "Error: --max-batch must be at least 1, got 0"
    bad = run("build-engine", tiny_artifact, "--precision", "fp16")  # a usage error before TensorRT is needed
    assert bad.exit_code == 2 and "--dtype fp16" in bad.stderr
    doctor = json.loads(run("doctor", "--json").stdout)
    assert doctor["tensorrt"]["available"] is False and "pip install 'tk[gpu]'" in doctor["tensorrt"]["reason"]
    assert "CPUExecutionProvider" in doctor["onnxruntime"]["providers"]
    from tk.runtimes.backends.ort_probes import integer_gemm_saturates, one_row_apart

    assert doctor["onnxruntime"]["w8a8_head"].startswith("exact")  # (7-bit weights: exact on every CPU)
    assert ("wrong here" in doctor["onnxruntime"]["w8a8_head"]) == integer_gemm_saturates()
    assert doctor["onnxruntime"]["int8_compute_rows"].startswith("a lone row" if one_row_apart() else "bit for bit")


# --- tk build-engine against a fake TensorRT of each major -----------------------------------------

VERSIONS = ["10.15.1.29", "11.4.0.106"]  # 11.x's BuilderFlag has no FP16/BF16/INT8 (the fake's neither)
STRONGLY_TYPED = 1 << 1


@pytest.fixture(scope="module")
def dtype_artifacts(tmp_path_factory, tiny, tiny_artifact):
    """Artifacts by the graphs' dtype: fp32, fp16, and int4 in TensorRT's form (--for trt: symmetric,
    block 64, static cache; the preset's FFN widened to 192 rows so that 64 divides every K)."""
    from tk.models.fixtures.presets import write_preset
    from tk.toolkit.pipeline.export import export_artifact

    root = tmp_path_factory.mktemp("dtypes")
    export_artifact(tiny, root / "fp16", dtype="fp16", validate=False)
    ckpt = write_preset("tiny", root / "ckpt192", intermediate_size=192)
    export_artifact(ckpt, root / "int4", profile="trt", weights="int4", max_seq_len=64, validate=False)
    return {"fp32": tiny_artifact, "fp16": root / "fp16", "int4": root / "int4"}


def _copy(src, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(src, art)
    return art


def _build(monkeypatch, art, version, *flags, **fake):
    """tk build-engine ARTIFACT on a fake TensorRT `version`: (the fake, the CLI result)."""
    from tk.runtimes.backends import trt as trt_runtime

    trt = fake_tensorrt(version, **fake)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(trt_runtime, "trt_environment", lambda: dict(ENV, tensorrt_version=version))
    return trt, run("build-engine", art, "--max-input-len", "8", "--force", *flags)


def _no_traceback(result, code):
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", ["fp32", "fp16", "int4"])
@pytest.mark.parametrize("precision", [None, "fp32", "fp16", "bf16"])
def test_build_engine_is_strongly_typed_or_says_what_to_export(dtype_artifacts, tmp_path, monkeypatch, version, kind,
                                                              precision):
    art = _copy(dtype_artifacts[kind], tmp_path)
    manifest = Manifest.read(art)
    graphs = {"fp32": "fp32", "fp16": "fp16", "int4": "fp32"}[kind]  # int4 weights, fp32 activations
    trt, result = _build(monkeypatch, art, version, *(["--precision", precision] if precision else []))
    if precision not in (None, graphs):
        _no_traceback(result, 2)
        assert result.stderr.strip().splitlines()[-1] == (
            f"Error: --precision {precision}: the graphs are {manifest.dtype}, and TensorRT builds engines in their "
            f"graphs' own types (strongly typed); export {precision} graphs and build those: tk export "
            f"{manifest.source.path} -o OUT --dtype {precision} (with this artifact's other export flags)")
        assert trt.record.builds == [] and not (art / contract.ENGINE_META).exists()
        return
    _no_traceback(result, 0)
    assert len(trt.record.builds) == 2
    for network, config in trt.record.builds:
        assert network.flags == STRONGLY_TYPED and config.set_flags == []
        assert config.cleared == ([trt.BuilderFlag.TF32] if graphs == "fp32" else [])  # TF32 off for fp32 only
        assert config.pool == {}  # the workspace is TensorRT's own unless --workspace caps it
    written = json.loads((art / contract.ENGINE_META).read_text())
    assert "strongly_typed" not in written and written["tensorrt_version"] == version
    meta = EngineMeta.from_dict(written)
    assert meta.precision == manifest.dtype and meta.tensorrt_major == int(version.split(".")[0])
    assert engine_problems(meta, art, dict(ENV, tensorrt_version=version)) == []


def test_workspace_is_tensorrts_own_unless_capped(tiny_artifact, tmp_path, monkeypatch):
    art = _copy(tiny_artifact, tmp_path)
    trt, result = _build(monkeypatch, art, VERSIONS[1], "--workspace", "2.5")
    _no_traceback(result, 0)
    assert [c.pool for _, c in trt.record.builds] == [{trt.MemoryPoolType.WORKSPACE: int(2.5 * 2**30)}] * 2
    trt, result = _build(monkeypatch, art, VERSIONS[1], "--workspace", "0")
    _no_traceback(result, 2)
    assert result.stderr.strip().splitlines()[-1] == "Error: --workspace must be a positive number of GiB, got 0.0"


def test_timing_cache_is_keyed_by_the_tensorrt_that_wrote_it(tiny_artifact, tmp_path, monkeypatch):
    art, cache = _copy(tiny_artifact, tmp_path), tmp_path / "caches" / "timing.cache"
    record = cache.with_name("timing.cache.json")
    notes = lambda result: [line for line in result.stderr.splitlines() if "timing cache" in line]  # noqa: E731
    trt, result = _build(monkeypatch, art, VERSIONS[0], "--timing-cache", cache)
    _no_traceback(result, 0)
    written = cache.read_bytes()
    assert json.loads(record.read_text()) == {"tensorrt_version": VERSIONS[0],
                                              "sha256": hashlib.sha256(written).hexdigest()}
    trt, result = _build(monkeypatch, art, VERSIONS[0], "--timing-cache", cache)  # the same TensorRT: fed back
    assert trt.record.timing_blobs[0] == written and notes(result) == []
    trt, result = _build(monkeypatch, art, VERSIONS[1], "--timing-cache", cache)  # another: never fed to the builder
    _no_traceback(result, 0)
    assert notes(result) == [f"  ignoring timing cache {cache}: TensorRT {VERSIONS[0]} wrote it and this is "
                             f"TensorRT {VERSIONS[1]}; a fresh one replaces it"]
    assert trt.record.timing_blobs[0] == b"" and json.loads(record.read_text())["tensorrt_version"] == VERSIONS[1]
    record.unlink()  # a cache with no record: which TensorRT wrote it is unknown
    trt, result = _build(monkeypatch, art, VERSIONS[1], "--timing-cache", cache)
    assert notes(result) == [f"  ignoring timing cache {cache}: no readable timing.cache.json says which TensorRT "
                             "wrote it; a fresh one replaces it"] and trt.record.timing_blobs[0] == b""
    stale = b"timing:10.14.1:entries"  # a record that vouches for bytes TensorRT then refuses
    cache.write_bytes(stale)
    record.write_text(json.dumps({"tensorrt_version": VERSIONS[1], "sha256": hashlib.sha256(stale).hexdigest()}))
    trt, result = _build(monkeypatch, art, VERSIONS[1], "--timing-cache", cache)
    _no_traceback(result, 0)
    assert notes(result) == ["  ignoring the timing cache: this TensorRT did not accept it; a fresh one replaces it"]
    assert cache.read_bytes().startswith(f"timing:{VERSIONS[1]}:".encode())


def _attention_attrs(model) -> list[dict]:
    return [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node
            if n.op_type == "Attention"]


@pytest.mark.parametrize("version", VERSIONS)
def test_decomposable_attention_is_set_in_memory_only(tiny_artifact, tmp_path, monkeypatch, version):
    art = _copy(tiny_artifact, tmp_path)
    trt, result = _build(monkeypatch, art, version, "--decomposable-attention")
    _no_traceback(result, 0)
    manifest = Manifest.read(art)
    for graph, (network, _) in zip(contract.GRAPHS, trt.record.builds):
        path = art / contract.GRAPH_FILES[graph]
        assert network.from_bytes and network.path == str(path)  # parsed from memory, weights found beside it
        parsed = _attention_attrs(network.model)
        assert parsed and all(a["TRT_decomposable"] == 1 for a in parsed)
        on_disk = _attention_attrs(onnx.load(str(path), load_external_data=False))
        assert all("TRT_decomposable" not in a for a in on_disk)  # the artifact keeps standard nodes
        assert [{k: v for k, v in a.items() if k != "TRT_decomposable"} for a in parsed] == on_disk
        assert sha256_file(path) == manifest.graphs[graph].sha256


def test_a_build_failing_on_attention_is_retried_decomposable(tiny_artifact, tmp_path, monkeypatch):
    art = _copy(tiny_artifact, tmp_path)
    trt, result = _build(monkeypatch, art, VERSIONS[1], attention="needs-decomposable")
    _no_traceback(result, 0)
    # prefill fails, is rebuilt decomposable, and decode starts decomposable
    assert [n.decomposable() for n, _ in trt.record.builds] == [False, True, True]
    retries = [line for line in result.stderr.splitlines() if "building it again" in line]
    assert len(retries) == 1 and "prefill.onnx" in retries[0] and "IAttentionLayer" in retries[0]
    trt, result = _build(monkeypatch, art, VERSIONS[1], attention="fails")
    _no_traceback(result, 1)
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: TensorRT failed to build an engine from prefill.onnx: [graphShapeAnalyzer.cpp] Error Code 10: Could "
        "not find any implementation for node node_scaled_dot_product_attention (IAttentionLayer, not decomposable)")
    trt, result = _build(monkeypatch, art, VERSIONS[1], parser_error="Unsupported ONNX data type: UINT4 (17)")
    _no_traceback(result, 1)  # a failure that names no attention is not retried
    assert "building it again" not in result.stderr and result.stderr.strip().splitlines()[-1] == (
        "Error: TensorRT's ONNX parser rejected prefill.onnx: graph (): Unsupported ONNX data type: UINT4 (17)")


def test_triton_native_records_the_tensorrt_the_plans_need(dtype_artifacts, tmp_path, monkeypatch):
    from tk.toolkit.serving.triton.repo import write_repository

    art = _copy(dtype_artifacts["int4"], tmp_path)  # --for trt: a static cache, as Triton's slots need
    _no_traceback(_build(monkeypatch, art, VERSIONS[1])[1], 0)
    notes = []
    repo = write_repository(art, tmp_path / "repo", name="m", native=True, sys_path=False, progress=notes.append)
    need = (f"the plans were built with TensorRT {VERSIONS[1]} for NVIDIA H100 (compute capability 9.0) and load only "
            f"in that TensorRT on that GPU: serve them with the Triton release whose TensorRT is {VERSIONS[1]}")
    assert len(notes) == 1 and notes[0].startswith(need)
    for graph in contract.GRAPHS:
        config = (repo / f"m_{graph}_trt" / "config.pbtxt").read_text()
        assert config.startswith(f"# tensorrt_version: {VERSIONS[1]}\n# {need}") and 'platform: "tensorrt_plan"' in config
    (art / contract.ENGINE_META).unlink()  # engines without their record: a build did not finish
    with pytest.raises(TkError, match="has engines but no engine.json; rebuild them with: tk build-engine"):
        write_repository(art, tmp_path / "repo2", name="m", native=True, sys_path=False)


# --- with TensorRT and a GPU ---------------------------------------------------------------------

@pytest.mark.trt
def test_build_engines_and_parity_on_gpu(tiny_artifact, tmp_path):
    pytest.importorskip("tensorrt", reason="needs TensorRT (pip install 'tk[gpu]' from NVIDIA's index) and a GPU")
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    assert run("build-engine", art, "--max-batch", "4", "--max-input-len", "32", "--max-seq-len", "64").exit_code == 0
    result = run("parity", art, "--backends", "torch,ort,trt", "--require", "trt", "--steps", "8")
    assert result.exit_code == 0, result.output


def test_static_cache_profiles_fix_the_capacity():
    dims = contract.GraphDims(2, 2, 16, 512, "float32", kv_capacity=256)
    p = compute_profiles(dims, Limits(max_batch=4, max_input_len=128, max_seq_len=256), max_context=1024)
    assert p["decode"]["attention_mask"] == [[1, 256], [2, 256], [4, 256]]
    assert p["decode"]["write_indices"] == [[1], [2], [4]]
    assert p["decode"]["past_key_values.0.key"] == [[1, 2, 256, 16], [2, 2, 256, 16], [4, 2, 256, 16]]
    assert p["prefill"]["input_ids"] == [[1, 1], [2, 64], [4, 128]]
    with pytest.raises(UsageProblem, match="static cache of 256 positions; --max-seq-len must be 256"):
        compute_profiles(dims, Limits(4, 128, 512), max_context=1024)


@pytest.mark.trt
def test_static_cache_engines_and_parity_on_gpu(tiny, tmp_path):
    pytest.importorskip("tensorrt", reason="needs TensorRT (pip install 'tk[gpu]' from NVIDIA's index) and a GPU")
    from tk.toolkit.pipeline.export import export_artifact

    art = tmp_path / "art"
    export_artifact(tiny, art, kv_cache="static", max_seq_len=64)
    assert run("build-engine", art, "--max-batch", "4", "--max-input-len", "32").exit_code == 0
    result = run("parity", art, "--backends", "ort,trt", "--require", "trt", "--steps", "8")
    assert result.exit_code == 0, result.output
