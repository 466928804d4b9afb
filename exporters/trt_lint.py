"""A static TensorRT compatibility lint of ONNX graphs, runnable anywhere (no TensorRT, no GPU).

Checks what TensorRT's ONNX parser accepts, from onnx/onnx-tensorrt `docs/operators.md` and
`docs/Changelog.md` and the NVIDIA/TensorRT issues named below:
- every op is in the parser's support table, and the lowest TensorRT version that parses it;
- the opset is one the parser reads (9..24; 25 from 11.5);
- `Attention` carries no cache (past inputs / present outputs: rejected, NVIDIA/TensorRT #4738)
  and its Q/K/V/mask are 4D;
- no `If`/`Loop`/`Scan` (#4032, #4739, #4757), no non-default domains (contrib ops);
- no graph input dim fixed at 0 (TensorRT rejects empty dims in profiles) and no unknown rank;
- quantized weights only as TensorRT documents weight-only quantization: int4, blocked along
  K with block 64 or 128 (int8 weight-only is not a documented TensorRT path);
- `TensorScatter` in linear mode (TensorRT's KV-cache update layer: "only kLINEAR mode is
  supported", 10.15/10.16 API docs), writing a graph input's buffer with its output a graph output
  directly (IKVCacheUpdateLayer updates the cache input in place and returns that memory: a Cast or
  Identity on either side, in any dtype, leaves nothing to update in place), and scatters without
  a reduction (its IScatterLayer has none: onnx/onnx-tensorrt #957);
- a recurrent layer's state (a hybrid's carry and matrix: `past_key_values.N.conv|recurrent`): TensorRT
  updates only a KV cache in place, so such a state would be a new output buffer every run, handed
  back as the next run's input, which tk's TensorRT runtime does not do (it binds caches in place).
The result names each problem and the lowest TensorRT version the graphs need.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import onnx

from tk.exporters.onnx_util import CONTROL_FLOW, is_default_domain, opset_of

BASE = "8.6"  # every op below without a version parses in 8.6 and later (operators.md of 8.6)
OP_MIN_VERSION: dict[str, str] = {
    **{op: BASE for op in (
        "Abs Add And ArgMax ArgMin Cast Ceil Clip Concat Constant ConstantOfShape Conv Cos CumSum Div Einsum Equal "
        "Erf Exp Expand Flatten Floor Gather GatherElements GatherND Gemm Greater GreaterOrEqual Identity IsInf "
        "IsNaN LayerNormalization Less LessOrEqual Log LogSoftmax MatMul Max Mean Min Mod Mul Neg NonZero Not Or Pad Pow "
        "Range Reciprocal ReduceL2 ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu "
        "Reshape ScatterElements ScatterND Shape Sigmoid Sign Sin Size Slice Softmax Softplus Split Sqrt Squeeze "
        "Sub Sum Tanh Tile TopK Transpose Trilu Unsqueeze Where Xor").split()},
    "Gelu": "10.0",  # opset 20 Gelu: operators.md of 10.0
    "Attention": "10.14",  # onnx-tensorrt Changelog 10.14
    "RMSNormalization": "10.15",  # Changelog 10.15
    "RotaryEmbedding": "10.15",
    "TensorScatter": "10.15",
    "DequantizeLinear": "10.0",  # blocked (int4 weight-only) DequantizeLinear: TensorRT 10.0 release notes
}
TRT_INT4_BLOCKS = (64, 128)  # the block sizes TensorRT documents for int4 weight-only quantization
# Parser opset ceiling by release: 20 in 10.0 (operators.md of 10.0); 24 by 10.14, the first to
# parse Attention (opset 23), which is the earliest release tk can vouch for above 20; 25 from 11.5.
MAX_OPSET = {"10.0": 20, "10.14": 24, "11.5": 25}


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def max_version(versions) -> str:
    return max(versions, key=_version_key)


@dataclass
class LintProblem:
    graph: str
    rule: str
    node: str
    message: str


@dataclass
class LintResult:
    problems: list[LintProblem] = field(default_factory=list)
    min_tensorrt: str = BASE

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "min_tensorrt": self.min_tensorrt, "problems": [asdict(p) for p in self.problems]}


def _ranks(model: onnx.ModelProto) -> dict[str, int | None]:
    """Rank of every value shape inference can tell (None: unknown rank)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is best effort: a graph it cannot read still gets the other checks
        inferred = model
    ranks = {}
    for v in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
        t = v.type.tensor_type
        ranks[v.name] = len(t.shape.dim) if t.HasField("shape") else None
    return ranks


def lint_model(model: onnx.ModelProto, graph: str) -> LintResult:
    result = LintResult()
    need = [BASE]
    add = lambda rule, node, msg: result.problems.append(LintProblem(graph, rule, node, msg))  # noqa: E731
    opset = opset_of(model)
    if opset < 9:
        add("opset", "", f"opset {opset} is below 9, the oldest TensorRT's parser reads")
    fitting = [v for v, top in MAX_OPSET.items() if top >= opset]
    if not fitting:
        add("opset", "", f"opset {opset} is newer than any TensorRT parser reads (25 at most, from 11.5)")
    else:
        need.append(min(fitting, key=_version_key))
    ranks = _ranks(model)
    graph_inputs, graph_outputs = {v.name for v in model.graph.input}, {v.name for v in model.graph.output}
    initializer_types = {t.name: t.data_type for t in model.graph.initializer}
    for node in model.graph.node:
        name = node.name or node.op_type
        if not is_default_domain(node.domain):
            add("domain", name, f"op {node.domain}.{node.op_type} is outside the default ONNX domain")
            continue
        if node.op_type in CONTROL_FLOW:
            add("control-flow", name, f"{node.op_type} node: TensorRT fails on control flow in decoders "
                "(NVIDIA/TensorRT #4032, #4739)")
            continue
        if node.op_type not in OP_MIN_VERSION:
            add("op", name, f"op {node.op_type} is not in TensorRT's ONNX parser support table")
            continue
        need.append(OP_MIN_VERSION[node.op_type])
        if node.op_type == "DequantizeLinear":
            _lint_dequantize(node, name, initializer_types, add)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "TensorScatter" and attrs.get("mode", b"linear") != b"linear":
            add("cache-mode", name, "TensorScatter in circular mode (a ring written by runs of several tokens): "
                "TensorRT's KV-cache update is linear only; export --for trt or --for serve")
        if node.op_type == "TensorScatter":
            _lint_in_place(node, name, graph_inputs, graph_outputs, add)
        if node.op_type in ("ScatterND", "ScatterElements") and attrs.get("reduction", b"none") != b"none":
            add("scatter-reduction", name, f"{node.op_type} with reduction {attrs['reduction'].decode()}: TensorRT's "
                "scatter has no reduction (onnx/onnx-tensorrt #957)")
        if node.op_type == "Attention":
            if len(node.input) > 4 and any(node.input[4:6]) or len(node.output) > 1 and any(node.output[1:3]):
                add("attention-cache", name, "Attention carries past/present KV inputs or outputs, which TensorRT "
                    "rejects (NVIDIA/TensorRT #4738); concatenate the cache outside the op")
            for i, tensor in enumerate(node.input[:4]):
                if tensor and ranks.get(tensor) not in (4, None):
                    add("attention-rank", name, f"Attention input {i} ({tensor}) is {ranks[tensor]}D; "
                        "TensorRT needs 4D Q/K/V/mask")
    states = [v.name for v in model.graph.input if v.name.endswith((".conv", ".recurrent"))]
    if states:
        add("recurrent-state", states[0], f"{len(states)} recurrent state inputs ({', '.join(states[:2])}, ...): "
            "TensorRT updates only a KV cache in place (IKVCacheUpdateLayer), and tk's TensorRT runtime binds each "
            "cache buffer as input and output at once; a hybrid runs on ONNX Runtime or torch")
    for v in model.graph.input:
        t = v.type.tensor_type
        if not t.HasField("shape"):
            add("dims", v.name, f"graph input {v.name} has unknown rank; TensorRT needs a fixed rank")
        elif any(d.HasField("dim_value") and d.dim_value == 0 for d in t.shape.dim):
            add("dims", v.name, f"graph input {v.name} has a dim fixed at 0; TensorRT rejects empty dims")
    result.min_tensorrt = max_version(need)
    return result


def _lint_in_place(node, name: str, graph_inputs: set, graph_outputs: set, add) -> None:
    if node.input[0] not in graph_inputs:
        add("cache-in-place", name, f"TensorScatter writes {node.input[0]}, which is not a graph input: TensorRT's "
            "in-place KV-cache update needs the cache buffer itself, fed straight from a graph input")
    if node.output[0] not in graph_outputs:
        add("cache-in-place", name, f"TensorScatter's output {node.output[0]} is not a graph output: TensorRT's "
            "in-place KV-cache update needs the updated cache returned directly, with no op after it")


def _lint_dequantize(node, name: str, initializer_types: dict, add) -> None:
    kind = initializer_types.get(node.input[0])
    block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
    if kind in (onnx.TensorProto.UINT4, onnx.TensorProto.UINT8) or len(node.input) > 2 and node.input[2]:
        add("quant-zero-points", name, "weights with zero points: TensorRT's int4 weight-only path takes symmetric "
            "blocks; re-export with --symmetric --no-quantize-embedding (or --for trt)")
    elif kind == onnx.TensorProto.INT4 and block not in TRT_INT4_BLOCKS:
        add("int4-block", name, f"int4 weights in blocks of {block}: TensorRT takes blocks of 64 or 128; re-export "
            "with --block-size 128")
    elif kind == onnx.TensorProto.INT8 and block:
        add("int8-weights", name, "blocked int8 weight-only quantization is not a documented TensorRT path; export "
            "with --weights int4 --block-size 128 for TensorRT")


def lint_graphs(models: dict[str, onnx.ModelProto]) -> LintResult:
    """Lint every graph of an artifact together: all problems, and the highest minimum version."""
    results = [lint_model(m, g) for g, m in models.items()]
    return LintResult([p for r in results for p in r.problems], max_version(r.min_tensorrt for r in results))
