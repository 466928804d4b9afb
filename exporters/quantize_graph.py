"""Quantized weights in the graph, in standard ONNX (opset >= 21):

- each quantized `MatMul(x, W)` becomes `MatMul(x, DequantizeLinear(W.quant, W.scale[, W.zero],
  axis=0, block_size=B))`, which ONNX Runtime fuses into MatMulNBits and TensorRT reads as
  weight-only int4. One DequantizeLinear per MatMul (ONNX Runtime fuses only a DQ with one
  consumer), the weight stored [K, N] (a Transpose in between also defeats the fusion), scales in
  the activations' dtype, zero points (uint4/uint8) where the precision has them;
- a quantized embedding's `Gather(E, ids)` becomes a gather of the ids' columns from the [K, V]
  table of integers (the LM head's own when the embedding is tied: one table serves both), its
  scales and zero points, dequantized for those columns only: ONNX's Gather takes no 4-bit type,
  so a 4-bit table is gathered as its bytes (`.bytes`: uint8 [K, V/2], two columns a byte) and
  the id's nibble shifted out; scales and 8-bit tables through `.bytes` too, another name (and shape,
  [rows, V, 1]) for the same data (ONNX Runtime fuses a DequantizeLinear only when it alone reads its inputs). A block of rows shares a scale: `Gather(scales, k // B)` repeats it;
- a W8A8 weight's MatMul (`--mixed-precision lm-head-w8a8`, ONNX Runtime targets only) becomes its
  input rounded to int8 a row at a time and ONNX Runtime's MatMulIntegerToFloat (`_integer_matmul`).

Runs on the traced graph before the exporter's optimizer, which keeps these nodes as they are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tk.exporters.onnx_util import DEFAULT_DOMAINS, MS_DOMAIN, is_default_domain
from tk.exporters.weights import BYTES, PREFIX, QUANT, SCALE, ZERO, external_tensor
from tk.models.quant.quantize import ROW_SCALE_FLOOR

QDQ_OPSET = 21  # blocked DequantizeLinear, INT4
EMBED = PREFIX + "embed.weight"


def dequantize_matmuls(ir_model, table: dict[str, tuple], schemes: dict, base_dir: Path) -> int:
    """Rewrite every MatMul that reads a weight stored quantized in `table` (`schemes`: initializer
    name -> its models/quant/quantize.py Scheme), and the embedding's Gather when its table is quantized;
    returns how many MatMuls."""
    import onnx_ir as ir

    graph = ir_model.graph
    count = 0
    for node in list(graph):
        if not is_default_domain(node.domain):
            continue
        if node.op_type == "Gather" and node.inputs[0] is not None and node.inputs[0].name == EMBED \
                and EMBED not in table:  # a quantized embedding: its float table is not written
            source = next((n for n in (EMBED + "_t", PREFIX + "lm_head.weight_t") if n + QUANT in table), None)
            if source is not None:
                _gather_dequantized(graph, node, source, table, schemes[source].block, base_dir)
            continue
        if node.op_type != "MatMul":
            continue
        w = node.inputs[1]
        if w is None or w.name + QUANT not in table or not w.is_initializer():
            continue
        if schemes[w.name].int8_inputs:
            _integer_matmul(graph, node, w, table, base_dir)
            count += 1
            continue
        inputs = [_initializer(graph, w.name + s, table, base_dir) for s in (QUANT, SCALE, ZERO) if w.name + s in table]
        block = ir.AttrInt64("block_size", schemes[w.name].block)
        dq = ir.Node("", "DequantizeLinear", inputs, [ir.AttrInt64("axis", 0), block],
                     name=f"{node.name}_dequantize", metadata_props=dict(node.metadata_props))
        dq.outputs[0].type, dq.outputs[0].shape = w.type, w.shape
        graph.insert_before(node, dq)
        node.replace_input_with(1, dq.outputs[0])
        if not w.uses():
            graph.initializers.pop(w.name)
            dq.outputs[0].name = w.name  # the float weight's name, now computed
        count += 1
    for opset in DEFAULT_DOMAINS:
        if opset in ir_model.opset_imports and ir_model.opset_imports[opset] < QDQ_OPSET:
            raise AssertionError(f"quantized graphs need opset >= {QDQ_OPSET}")
    return count


def _integer_matmul(graph, matmul, w, table: dict[str, tuple], base_dir: Path) -> None:
    """Replace `matmul` (x @ W, W a W8A8 weight: int8 [K, N], a float scale a column) with ONNX
    Runtime's integer GEMM: x rounded to int8 a row at a time (models/quant/quantize.py `quantize_rows`,
    op for op), stored as uint8 around a zero point of 128, and MatMulIntegerToFloat's int32 sums
    scaled by the row's and the column's scales. Integer sums are exact, so a row's logits do not
    depend on the rows run beside it; MLAS's integer GEMM (AMX or VNNI where the CPU has them) runs
    a batch of rows about twice as fast as MatMulNBits (README, "Serving")."""
    import onnx_ir as ir

    x = matmul.inputs[0]
    new = _Nodes(graph, f"{matmul.name}_w8a8")
    op, const = new.op, new.const
    peak = op("ReduceMax", [op("Abs", [x]), const("last_axis", np.array([-1], np.int64))], keepdims=1)
    scale = op("Div", [op("Max", [peak, const("floor", np.array(ROW_SCALE_FLOOR, np.float32))]),
                       const("qmax", np.array(127, np.float32))])
    rounded = op("Add", [op("Round", [op("Div", [x, scale])]), const("zero_point_f", np.array(128, np.float32))])
    quant = op("Cast", [rounded], to=ir.DataType.UINT8)  # in [1, 255]: no clip needed
    y = op("MatMulIntegerToFloat", [quant, _initializer(graph, w.name + QUANT, table, base_dir), scale,
                                    _initializer(graph, w.name + SCALE, table, base_dir),  # [1, N]: a column's
                                    const("zero_point", np.array(128, np.uint8))], domain=MS_DOMAIN)
    new.insert_before(matmul)
    out = matmul.outputs[0]
    name, y.type, y.shape = out.name, out.type, out.shape
    out.replace_all_uses_with(y, replace_graph_outputs=True)  # the LM head's output is the graph's logits
    graph.remove(matmul, safe=True)
    y.name = name
    if not w.uses():
        graph.initializers.pop(w.name)
    graph.opset_imports.setdefault(MS_DOMAIN, 1)


def _gather_dequantized(graph, gather, source: str, table: dict[str, tuple], block: int, base_dir: Path) -> None:
    """Replace `gather` (the embedding's rows of `ids`) with the dequantized columns of `source`."""
    import onnx_ir as ir

    embed = gather.inputs[0]
    ids = gather.inputs[1]
    k, kind = table[source + QUANT][3][0], table[source + QUANT][2]
    four = kind in ("int4", "uint4")
    new = _Nodes(graph, gather.name)
    op, const = new.op, new.const
    if four:
        half, odd = op("Div", [ids, const("two", np.array(2, np.int64))]), op("Mod", [ids, const("two_", np.array(2, np.int64))])
        shift = op("Mul", [op("Cast", [odd], to=ir.DataType.UINT8), const("four", np.array(4, np.uint8))])

        def nibbles(suffix):  # [rows, B, S] uint8: the nibble of each id's column
            packed = op("Gather", [_initializer(graph, source + suffix + BYTES, table, base_dir), half], axis=1)
            return op("BitwiseAnd", [op("BitShift", [packed, shift], direction="RIGHT"),
                                     const(f"mask{suffix}", np.array(15, np.uint8))])

    def gathered(suffix):  # [rows, B, S]: the alias is [rows, V, 1]
        out = op("Gather", [_initializer(graph, source + suffix + BYTES, table, base_dir), ids], axis=1)
        return op("Squeeze", [out, const(f"last{suffix}", np.array([-1], np.int64))])

    columns = nibbles if four else gathered

    float_type = external_tensor(source + SCALE, table[source + SCALE], base_dir).dtype
    values = columns(QUANT)
    if kind == "int4":  # two's complement nibbles: (n ^ 8) - 8
        values = op("BitwiseXor", [values, const("eight", np.array(8, np.uint8))])
    values = op("Cast", [values], to=float_type)
    rows = const("block_of_row", np.arange(k, dtype=np.int64) // block)  # each row's block
    if source + ZERO in table:
        values = op("Sub", [values, op("Cast", [op("Gather", [columns(ZERO), rows], axis=0)], to=float_type)])
    elif kind == "int4":
        values = op("Sub", [values, const("bias", np.array(8, _np(table[source + SCALE][2])))])
    scales = op("Gather", [gathered(SCALE), rows], axis=0)
    out = op("Transpose", [op("Mul", [values, scales])], perm=[1, 2, 0])  # [K, B, S] -> [B, S, K]
    new.insert_before(gather)
    gather.outputs[0].replace_all_uses_with(out)
    out.name, out.type, out.shape = gather.outputs[0].name, gather.outputs[0].type, gather.outputs[0].shape
    graph.remove(gather, safe=True)  # detaches its inputs too
    if not embed.uses() and embed.name in graph.initializers:
        graph.initializers.pop(embed.name)


class _Nodes:
    """The nodes a rewrite builds (named `prefix`_op_n), inserted together before the node they
    replace, and its constants (initializers named `prefix`_name)."""

    def __init__(self, graph, prefix: str):
        self.graph, self.prefix, self.nodes = graph, prefix, []

    def op(self, op_type, inputs, domain="", **attrs):
        import onnx_ir as ir

        node = ir.Node(domain, op_type, inputs, [_attr(k_, v) for k_, v in attrs.items()],
                       name=f"{self.prefix}_{op_type.lower()}_{len(self.nodes)}")
        self.nodes.append(node)
        return node.outputs[0]

    def const(self, name, array):
        import onnx_ir as ir

        value = ir.Value(name=f"{self.prefix}_{name}", const_value=ir.tensor(array, name=f"{self.prefix}_{name}"))
        self.graph.register_initializer(value)
        return value

    def insert_before(self, node) -> None:
        for new in self.nodes:
            self.graph.insert_before(node, new)


def _np(dtype):
    import torch

    return {torch.float32: np.float32, torch.float16: np.float16}.get(dtype, np.float32)


def _attr(name: str, value):
    import onnx_ir as ir

    if isinstance(value, list):
        return ir.AttrInt64s(name, value)
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, ir.DataType):
        return ir.AttrInt64(name, int(value))
    return ir.AttrInt64(name, value)


def _initializer(graph, name: str, table: dict[str, tuple], base_dir: Path):
    import onnx_ir as ir

    if name in graph.initializers:
        return graph.initializers[name]
    tensor = external_tensor(name, table[name], base_dir)
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value
