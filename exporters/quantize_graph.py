"""Quantized weights in the graph: each quantized `MatMul(x, W)` becomes
`MatMul(x, DequantizeLinear(W.quant, W.scale, axis=0, block_size=B))`, the standard ONNX form
(opset >= 21) that ONNX Runtime fuses into MatMulNBits and TensorRT reads as weight-only int4.

One DequantizeLinear per MatMul (ONNX Runtime fuses only a DQ with one consumer), the weight
stored [K, N] (a Transpose in between also defeats the fusion), no zero point (symmetric), scales
in the activations' dtype. Runs on the traced graph before the exporter's optimizer, which keeps
DequantizeLinear as it is.
"""

from __future__ import annotations

from pathlib import Path

from tk.exporters.weights import QUANT, SCALE, external_tensor

QDQ_OPSET = 21  # blocked DequantizeLinear, INT4


def dequantize_matmuls(ir_model, table: dict[str, tuple], block_size: int, base_dir: Path) -> int:
    """Rewrite every MatMul that reads a weight stored quantized in `table`; returns how many."""
    import onnx_ir as ir

    graph = ir_model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        w = node.inputs[1]
        if w is None or w.name + QUANT not in table or not w.is_initializer():
            continue
        q = _initializer(graph, w.name + QUANT, table, base_dir)
        s = _initializer(graph, w.name + SCALE, table, base_dir)
        dq = ir.Node("", "DequantizeLinear", [q, s], [ir.AttrInt64("axis", 0), ir.AttrInt64("block_size", block_size)],
                     name=f"{node.name}_dequantize", metadata_props=dict(node.metadata_props))
        dq.outputs[0].type, dq.outputs[0].shape = w.type, w.shape
        graph.insert_before(node, dq)
        node.replace_input_with(1, dq.outputs[0])
        if not w.uses():
            graph.initializers.pop(w.name)
            dq.outputs[0].name = w.name  # the float weight's name, now computed
        count += 1
    for opset in ("", "ai.onnx"):
        if opset in ir_model.opset_imports and ir_model.opset_imports[opset] < QDQ_OPSET:
            raise AssertionError(f"quantized graphs need opset >= {QDQ_OPSET}")
    return count


def _initializer(graph, name: str, table: dict[str, tuple], base_dir: Path):
    import onnx_ir as ir

    if name in graph.initializers:
        return graph.initializers[name]
    tensor = external_tensor(name, table[name], base_dir)
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value
