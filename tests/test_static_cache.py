"""tk export --kv-cache static: a fixed-capacity cache updated in place (TensorScatter, opset 24)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from hf_models import hf_greedy
from tk.models.spec.manifest import Manifest
from tk.runtimes.base import InputError
from tk.runtimes.cache_layouts import StaticLayout
from tk.runtimes.decoding.generate import generate
from tk.runtimes.backends.ort import OrtRuntime
from tk.toolkit.cli.main import main
from tk.toolkit.pipeline.export import export_artifact
from tk.toolkit.verify.compare import parity

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def static_llama(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("static") / "artifact"
    export_artifact(checkpoints("llama"), out, kv_cache="static", max_seq_len=64)
    return out


def test_static_graph_follows_its_contract(static_llama):
    manifest = Manifest.read(static_llama)
    assert manifest.variant.cache == "static" and manifest.dims.kv_capacity == 64
    assert manifest.validation.passed and manifest.trt_lint["ok"]
    model = onnx.load(str(static_llama / "decode.onnx"), load_external_data=False)
    assert [i.name for i in model.graph.input][:4] == ["input_ids", "attention_mask", "position_ids", "write_indices"]
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 24
    assert sum(n.op_type == "TensorScatter" for n in model.graph.node) == 4  # 2 layers, key and value
    assert "Concat" not in {n.op_type for n in model.graph.node if "past" in " ".join(n.input)}


def test_static_tokens_equal_dynamic_and_transformers(checkpoints, artifacts, static_llama):
    prompts = [[5, 17, 99, 3, 8], [42, 8, 300, 12, 77, 150, 9, 61, 33]]
    with OrtRuntime(static_llama) as st, OrtRuntime(artifacts("llama")) as dyn:
        assert isinstance(st.layout, StaticLayout) and st.dims.kv_capacity == 64  # dims: the graph it runs
        a = [r.tokens for r in generate(st, prompts, 24, ignore_eos=True).rows]
        b = [r.tokens for r in generate(dyn, prompts, 24, ignore_eos=True).rows]
    assert a == b
    assert a[1] == hf_greedy(checkpoints("llama"), prompts[1], 24)
    with OrtRuntime(static_llama) as st:  # a row that stops leaves the static buffers; the other goes on alone
        cut = generate(st, prompts, 24, ignore_eos=True, stop=lambda row, toks: row == 0 and len(toks) == 5).rows
    assert cut[0].tokens == a[0][:5] and cut[1].tokens == a[1]


def test_static_cache_is_updated_in_place_and_guards_capacity(static_llama):
    with OrtRuntime(static_llama) as rt:
        _, session = rt.start(np.array([[5, 6, 7]]), np.ones((1, 3), np.int64))
        buffer = session.cache[0]
        assert buffer.shape == (1, 2, 64, 16) and not buffer[:, :, 3].any()
        rt.step(session, [9])
        assert session.cache[0] is buffer and buffer[:, :, 3].any()  # ORT wrote into our buffer: no copy
        assert session.mask[0].tolist() == [1] * 4 + [0] * 60 and session.positions.tolist() == [[3]]
        assert rt.max_context == 64
        with pytest.raises(InputError, match="exceeds the model's context of 64"):
            generate(rt, [[1] * 10], 60)
        session.length = 64
        with pytest.raises(InputError, match="the static cache holds 64 positions and is full"):
            rt.step(session, [9])
        with pytest.raises(InputError, match="prefill: 64 tokens leave no room in the static cache of 64"):
            rt.start(np.ones((1, 64), np.int64), np.ones((1, 64), np.int64))


def test_static_parity_passes(static_llama):
    report = parity(static_llama, ["ort"], steps=12)
    assert report.passed, report.backends["ort"].first_divergence
    # ORT prefills its padded queries' decode graph (Variant.pad_queries); export validation judged prefill.onnx
    # too, which TensorRT and ORT on CUDA run
    manifest = Manifest.read(static_llama)
    assert manifest.variant.pad_queries and OrtRuntime(static_llama).prefill_via == "decode"
    assert {c["backend"] for c in manifest.validation.comparisons} == {"ort", "ort/pre"}


@pytest.mark.parametrize("args, message", [
    (["--kv-cache", "static"], "Error: --kv-cache static needs --max-seq-len N (N >= 2): the capacity of the cache"),
    (["--max-seq-len", "64"], "Error: --max-seq-len sets the capacity of a static cache; add --kv-cache static"),
    (["--kv-cache", "paged"], "Error: Invalid value for '--kv-cache': 'paged' is not one of 'dynamic', 'static'."),
    (["--kv-cache", "static", "--max-seq-len", "5000"], "Error: --max-seq-len (5000) is beyond the model's context of 1024"),
])
def test_static_export_options(tiny, tmp_path, args, message):
    result = CliRunner().invoke(main, ["export", str(tiny), "-o", str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1] == message
    assert not (tmp_path / "out").exists()
