"""A deep model is traced with a few layers and grown to its depth (exporters/replicate.py): the
grown graphs must compute exactly what graphs traced with every layer compute, in every variant."""

from __future__ import annotations

import numpy as np
import pytest

from hf_models import make_checkpoint

LAYERS = 6
VARIANTS = {  # family, export flags: together they cover both caches, both targets and the debug outputs, and
    # experts, whose sizes are data-dependent in every layer, with rings (Mixtral's window of 8: every layer's
    # cache). CI grows the fused ORT graphs; -m families every variant (about 8 minutes on 2 cores)
    "llama-dynamic-debug-last": ("llama", dict(debug_outputs=True, prefill_logits="last")),
    "mistral-ort-fused": ("mistral", dict(target="ort")),
    "qwen3-static-fp16": ("qwen3", dict(kv_cache="static", max_seq_len=48, dtype="fp16")),
    "mixtral-static-fp16": ("mixtral", dict(kv_cache="static", max_seq_len=48, dtype="fp16")),
}
MATRIX = {"mixtral-static-fp16", "qwen3-static-fp16", "llama-dynamic-debug-last"}  # pytest -m families (CI's time)


def _run(artifact, steps: int = 5):
    """Logits, hidden states and final cache of a left-padded batch of 2, greedy."""
    from tk.runtimes.backends.ort import OrtRuntime

    ids = np.array([[1, 1, 5, 9, 17, 33], [4, 8, 15, 16, 23, 42]], np.int64)
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int64)
    out = []
    with OrtRuntime(artifact) as rt:
        first, session = rt.start(ids, mask)
        with session:
            out += [first.logits, *(first.hidden or [])]
            tokens = first.logits[:, -1].argmax(-1)
            for _ in range(steps):
                step = rt.step(session, tokens.tolist())
                out += [step.logits, *(step.hidden or [])]
                tokens = step.logits[:, -1].argmax(-1)
            out += list(rt.cache_arrays(session))
    return out


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.families) if v in MATRIX else v
                                     for v in VARIANTS])
def test_grown_graphs_equal_traced_ones(variant, tmp_path, monkeypatch):
    import tk.exporters.onnx_export as onnx_export
    from tk.toolkit.pipeline.export import export_artifact

    family, flags = VARIANTS[variant]
    ckpt = make_checkpoint(family, tmp_path / "ckpt", layers=LAYERS)
    said = []
    grown = export_artifact(ckpt, tmp_path / "grown", progress=said.append, validate=False, **flags)
    assert sum(f"copied to {LAYERS}" in line for line in said) == 2, said
    monkeypatch.setattr(onnx_export, "TRACED_LAYERS", LAYERS)  # no growth: every layer traced
    said = []
    traced = export_artifact(ckpt, tmp_path / "traced", progress=said.append, validate=False, **flags)
    assert sum(f"traced {LAYERS} layers" in line for line in said) == 2, said
    assert grown.dims == traced.dims
    a, b = _run(tmp_path / "grown"), _run(tmp_path / "traced")
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_a_copied_layer_gets_data_dependent_sizes_of_its_own():
    """torch.export names an expert's token count u0, u1, ...; a copy of the layer must not share the name
    (ONNX Runtime would plan one buffer for two sizes), while the contract's dims stay as they are."""
    import onnx_ir as ir

    from tk.exporters.replicate import _copied_shape

    shape = ir.Shape([ir.SymbolicDim("u3"), ir.SymbolicDim("batch_size*sequence_length"), 4, ir.SymbolicDim("u12 + 1")])
    assert [str(d) for d in _copied_shape(shape, 7)] == ["u3_layer7", "batch_size*sequence_length", "4",
                                                         "u12_layer7 + 1"]
    assert _copied_shape(None, 7) is None


def test_layers_that_do_not_repeat_are_traced(tmp_path):
    """A graph whose last traced layer reads something its predecessor does not is never grown."""
    import onnx_ir as ir

    from tk.exporters.replicate import grow

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 23})
    h = x
    for i in range(4):
        w = ir.Value(name=f"model.layers.{i}.w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]),
                     const_value=ir.tensor(np.ones(2, np.float32)))
        graph.register_initializer(w)
        op = "Mul" if i < 3 else "Add"  # the last layer differs
        node = ir.Node("", op, [h, w], metadata_props={"namespace": f"model.layers.{i}: Block"})
        graph.append(node)
        h = node.outputs[0]
    graph.outputs.append(h)
    model = ir.Model(graph, ir_version=10)
    before = len(graph)
    table = {f"model.layers.{i}.w": None for i in range(8)}
    assert grow(model, 8, table, lambda m: None) == "the traced layers are not the same subgraph"
    assert len(graph) == before
