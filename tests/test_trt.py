"""TensorRT: everything that can be checked without a GPU (profiles, engine.json, the lint, the
missing-TensorRT messages), and, where TensorRT and a GPU exist, a real build and parity run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from tk.exporters.trt_build import Limits, compute_profiles
from tk.exporters.trt_lint import lint_graphs, lint_model
from tk.models.spec import contract
from tk.models.spec.manifest import Manifest, sha256_file
from tk.models.spec.engine import EngineMeta, Gpu
from tk.models.spec.errors import FilesystemProblem, UsageProblem
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
                      strongly_typed=False, limits=Limits(1, 8, 16), profiles=compute_profiles(DIMS, Limits(1, 8, 16), 1024),
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


def test_every_engine_mismatch_has_an_actionable_message(built):
    art, meta = built
    rebuild = f"rebuild them here with: tk build-engine {art} --force"
    old = dataclasses.replace(meta, contract_version=0)
    assert engine_problems(old, art, ENV) == [
        f"the engines follow graph contract version 0 and this tk reads version 4; re-export and {rebuild}"]
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
    doctor = json.loads(run("doctor", "--json").stdout)
    assert doctor["tensorrt"]["available"] is False and "pip install 'tk[gpu]'" in doctor["tensorrt"]["reason"]
    assert "CPUExecutionProvider" in doctor["onnxruntime"]["providers"]


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
