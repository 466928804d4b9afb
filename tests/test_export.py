"""tk export on every family: contract, validation, precision and opset variants, external data,
atomic output, and the graphs working in third-party tools (Polygraphy)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from conftest import FAMILY_NAMES, assert_close
from hf_models import hf_greedy
from tk.models.spec import contract
from tk.exporters.contract_check import graph_problems
from tk.exporters.weights import WEIGHTS_FILE, external_initializers
from tk.models.spec.manifest import Manifest
from tk.runtimes.decoding.generate import generate
from tk.runtimes.backends.ort import OrtRuntime
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.verify.metrics import random_cases, run_trace
from tk.toolkit.verify.tolerance import tolerance_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fp32_export_validates_and_ort_greedy_matches_transformers(checkpoints, artifacts, family):
    art = artifacts(family)
    manifest = Manifest.read(art)
    v = manifest.validation
    assert v.passed and v.tolerance == dataclasses.asdict(tolerance_for("float32", manifest.config))
    assert {c["case"] for c in v.comparisons} == {"batch1-len7", "batch3-len5/9/12"}
    assert all(len(c["steps"]) == 9 for c in v.comparisons)  # prefill + 8 decode steps

    prompt = torch.randint(2, 384, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = hf_greedy(checkpoints(family), prompt[0].tolist(), 32)
    with OrtRuntime(art) as ort:
        got = generate(ort, [prompt[0].tolist()], 32, ignore_eos=True).rows[0].tokens
    assert got == expected
    assert plain_ort_greedy(art, prompt[0].tolist(), 32) == expected


def plain_ort_greedy(art, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with nothing but onnxruntime and numpy: the graphs stand on their own."""
    import onnxruntime as ort

    prefill = ort.InferenceSession(str(art / "prefill.onnx"))
    decode = ort.InferenceSession(str(art / "decode.onnx"))
    ids = np.array([prompt], dtype=np.int64)
    mask = np.ones_like(ids)
    out = prefill.run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": np.arange(len(prompt))[None]})
    tokens = []
    for _ in range(n):
        tokens.append(int(out[0][0, -1].argmax()))
        mask = np.ones((1, mask.shape[1] + 1), dtype=np.int64)
        feeds = {"input_ids": np.array([[tokens[-1]]]), "attention_mask": mask,
                 "position_ids": np.array([[mask.shape[1] - 1]])}
        feeds.update({i.name: v for i, v in zip(decode.get_inputs()[3:], out[1:])})
        out = decode.run(None, feeds)
    return tokens


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fp16_export_passes_its_tolerance(artifacts, family):
    manifest = Manifest.read(artifacts(family, "fp16"))
    v = manifest.validation
    assert manifest.dtype == "float16" and manifest.dims.kv_dtype == "float16"
    assert v.passed and v.tolerance["min_top1"] == 0.95
    fp32 = tolerance_for("float32", manifest.config)
    worst = max(s["max_abs"] for c in v.comparisons for s in c["steps"])
    assert 50 * fp32.bound(1.0) < worst  # really half precision: the fp32 gate would fail


def test_opset18_graphs_match_opset23(artifacts):
    a23, a18 = artifacts("llama"), artifacts("llama", opset=18)
    ops = {n.op_type for n in onnx.load(str(a18 / "decode.onnx"), load_external_data=False).graph.node}
    assert "Attention" not in ops and "RMSNormalization" not in ops  # fully decomposed
    ops23 = {n.op_type for n in onnx.load(str(a23 / "decode.onnx"), load_external_data=False).graph.node}
    assert {"Attention", "RMSNormalization"} <= ops23
    ids, mask = random_cases(384, seed=4)["batch3-len5/9/12"]
    with OrtRuntime(a23) as r23, OrtRuntime(a18) as r18:
        t23 = run_trace(r23, ids, mask, 4)
        t18 = run_trace(r18, ids, mask, 4, forced=t23.tokens)
    for step, (x, y) in enumerate(zip(t23.logits, t18.logits)):
        keep = mask.astype(bool) if step == 0 else np.ones(x.shape[:2], bool)
        assert_close(y[keep], x[keep], 1e-5, f"step {step}")


def test_graphs_follow_the_contract(artifacts):
    art = artifacts("qwen3")
    dims = Manifest.read(art).dims
    assert dims.head_dim == 24  # explicit head_dim survives into the graphs
    for graph in contract.GRAPHS:
        model = onnx.load(str(art / contract.GRAPH_FILES[graph]), load_external_data=False)
        assert graph_problems(model, graph, dims) == []
    model = onnx.load(str(art / "decode.onnx"), load_external_data=False)
    model.graph.output[1].name = "present_key_0"
    model.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT32
    problems = graph_problems(model, contract.DECODE, dims)
    assert any("outputs are ['logits', 'present_key_0'" in p for p in problems)
    assert "decode input input_ids has dtype int32, the contract says int64" in problems


def test_weights_live_in_external_data_and_reload_elsewhere(artifacts, tmp_path):
    art = artifacts("llama")
    for graph in contract.GRAPHS:
        proto = onnx.load(str(art / contract.GRAPH_FILES[graph]), load_external_data=False)
        external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert external, "weights were embedded in the graph; models over 2 GB would not export"
        assert {dict((e.key, e.value) for e in t.external_data)["location"] for t in external} == {WEIGHTS_FILE}
        full = onnx.load(str(art / contract.GRAPH_FILES[graph]))  # resolves external data
        assert any(t.name == external[0].name and len(t.raw_data) > 0 for t in full.graph.initializer)
    moved = tmp_path / "moved"
    shutil.copytree(art, moved)
    ids, mask = random_cases(384)["batch1-len7"]
    with OrtRuntime(art) as a, OrtRuntime(moved) as b:
        assert np.array_equal(a.start(ids, mask)[0].logits, b.start(ids, mask)[0].logits)


def test_both_graphs_share_one_weights_file(artifacts, checkpoints):
    """The artifact is the size of the weights plus two small graphs: prefill and decode read one file."""
    from tk.models.checkpoint.loading import load_decoder

    art = artifacts("llama")
    assert sorted(p.name for p in art.glob("*.data")) == [WEIGHTS_FILE]
    manifest = Manifest.read(art)
    assert {g.data_file for g in manifest.graphs.values()} == {WEIGHTS_FILE}
    params = sum(p.numel() * 4 for p in load_decoder(checkpoints("llama")).parameters())
    tensors = len(external_initializers(onnx.load(str(art / "decode.onnx"), load_external_data=False)))
    # each distinct tensor once, at a page-aligned offset (ONNX Runtime maps aligned data)
    assert params <= (art / WEIGHTS_FILE).stat().st_size <= params + 4096 * tensors
    assert all(offset % 4096 == 0 for offset, *_ in external_initializers(
        onnx.load(str(art / "prefill.onnx"), load_external_data=False)).values())


def test_a_manifest_written_before_the_typed_artifact_still_loads(artifacts, tmp_path):
    art = tmp_path / "old"
    shutil.copytree(artifacts("llama"), art)
    m = json.loads((art / contract.MANIFEST).read_text())
    v, p = m.pop("variant"), m.pop("precision")
    m.update(dtype=p["activations"], opset=v["opset"], kv_cache=v["cache"], target=v["target"],
             dims={"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 384, "kv_dtype": "float32",
                   "kv_capacity": None, "hidden_size": None, "prefill_logits": "all"})
    (art / contract.MANIFEST).write_text(json.dumps(m))
    old, new = Manifest.read(art), Manifest.read(artifacts("llama"))
    assert (old.dims, old.precision, old.variant) == (new.dims, new.precision, new.variant)
    with OrtRuntime(art) as a, OrtRuntime(artifacts("llama")) as b:
        assert generate(a, [[5, 6, 7]], 8, ignore_eos=True).rows == generate(b, [[5, 6, 7]], 8, ignore_eos=True).rows


def test_polygraphy_reads_and_runs_the_decode_graph(artifacts):
    art = artifacts("llama")
    poly = [str(Path(sys.executable).with_name("polygraphy"))]  # the console script beside this Python
    out = subprocess.run([*poly, "inspect", "model", "decode.onnx"], cwd=art, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "past_key_values.1.value" in out.stdout and "total_sequence_length" in out.stdout
    shapes = ["input_ids:[2,1]", "attention_mask:[2,6]", "position_ids:[2,1]"]
    shapes += [f"{n}:[2,2,5,16]" for n in contract.past_names(2)]
    out = subprocess.run([*poly, "run", "decode.onnx", "--onnxrt", "--input-shapes", *shapes,
                          "--val-range", "input_ids:[0,383]", "attention_mask:[1,1]", "position_ids:[5,5]"],
                         cwd=art, capture_output=True, text=True)
    assert out.returncode == 0 and "PASSED" in out.stdout + out.stderr, out.stdout + out.stderr


def test_weights_stream_from_the_checkpoint_into_the_file(tiny, tmp_path):
    """The export view is traced on the meta device (no weight in memory); each tensor is written once,
    transposed to [in, out] for MatMul, in the export's dtype (bf16 written as its 16 bits)."""
    from tk.exporters.weights import export_view
    from tk.models.checkpoint.loading import load_decoder, read_config

    view = export_view(read_config(tiny), torch.bfloat16)
    assert all(p.device.type == "meta" for p in view.parameters())
    art = tmp_path / "bf16"
    export_artifact(tiny, art, dtype="bf16", validate=False)
    table = external_initializers(onnx.load(str(art / "decode.onnx"), load_external_data=False))
    data = np.memmap(art / WEIGHTS_FILE, dtype=np.uint16, mode="r")
    ref = load_decoder(tiny, "bfloat16")
    for name, param in (("model.layers.1.ffn.w_down.weight_t", ref.layers[1].ffn.w_down.weight.T),
                        ("model.embed.weight", ref.embed.weight)):
        offset, length, _, dims = table[name]
        got = data[offset // 2 : (offset + length) // 2].reshape(dims)
        assert np.array_equal(got, param.contiguous().view(torch.int16).numpy().view(np.uint16))
    graph = onnx.load(str(art / "decode.onnx"), load_external_data=False).graph
    weights = {t.name for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert not [n for n in graph.node if n.op_type == "Transpose" and set(n.input) & weights]  # nothing to fold
