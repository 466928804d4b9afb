"""Check a written ONNX graph against the contract: I/O names, order, dtypes and dims.

Also the structural rules every tk graph keeps (no control flow, no contrib-domain ops beyond the
few a --target ort export asks for). This is
the exporter's own check of what it wrote; numerics are the parity core's job (toolkit/).
"""

from __future__ import annotations

from pathlib import Path

import onnx

from tk.exporters.onnx_util import CONTROL_FLOW, is_default_domain
from tk.models.spec import contract
from tk.models.spec.dtypes import DTYPES

_ELEM = {d.onnx: d.name for d in DTYPES.values()}


def describe_value(value: onnx.ValueInfoProto) -> tuple[str, str, tuple]:
    t = value.type.tensor_type
    dims = tuple(d.dim_param if d.HasField("dim_param") else d.dim_value for d in t.shape.dim)
    return value.name, _ELEM.get(t.elem_type, f"elem_type {t.elem_type}"), dims


def graph_problems(model: onnx.ModelProto, graph: str, dims: contract.GraphDims,
                   allowed_ops: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    """Every way `model` departs from the contract for `graph`; empty when it conforms.
    allowed_ops: (domain, op) pairs outside the default domain that this export may use."""
    problems = []
    for kind, got, want in (("input", model.graph.input, dims.inputs(graph)),
                            ("output", model.graph.output, dims.outputs(graph))):
        got_names = [v.name for v in got]
        want_names = [s.name for s in want]
        if got_names != want_names:
            problems.append(f"{graph} {kind}s are {got_names}, the contract says {want_names}")
            continue
        for v, spec in zip(got, want):
            name, dtype, shape = describe_value(v)
            if dtype != spec.dtype:
                problems.append(f"{graph} {kind} {name} has dtype {dtype}, the contract says {spec.dtype}")
            if shape != spec.dims:
                problems.append(f"{graph} {kind} {name} has dims {list(shape)}, the contract says {list(spec.dims)}")
    problems += in_place_problems(model, graph, dims)
    for node in model.graph.node:
        if node.op_type in CONTROL_FLOW:
            problems.append(f"{graph} has a {node.op_type} node ({node.name}); tk graphs have no control flow")
        if not is_default_domain(node.domain) and (node.domain, node.op_type) not in allowed_ops:
            problems.append(f"{graph} has op {node.domain}.{node.op_type}; tk graphs use the default domain only")
    return problems


def in_place_problems(model: onnx.ModelProto, graph: str, dims: contract.GraphDims) -> list[str]:
    """A runtime updates a recurrent layer's state in place (one buffer bound as the past input and the
    present output), so every node that reads a state input must run before the node that writes its
    output: each reader must be an ancestor of the writer (or the writer itself, a fused kernel)."""
    if not dims.stateful or graph != contract.DECODE:
        return []
    producer = {out: node for node in model.graph.node for out in node.output}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in set(node.input):
            readers.setdefault(name, []).append(node)
    problems = []
    for past, present, (_, kind) in zip(dims.past_names(), dims.present_names(), dims.cache_kinds()):
        if kind == contract.KV or present not in producer:
            continue
        writer, ancestors, todo = producer[present], set(), [producer[present]]
        while todo:
            node = todo.pop()
            if id(node) in ancestors:
                continue
            ancestors.add(id(node))
            todo += [producer[n] for n in node.input if n in producer]
        late = [n for n in readers.get(past, []) if id(n) not in ancestors]
        if late:
            problems.append(f"{graph}: {late[0].op_type} node {late[0].name!r} reads {past} but does not feed "
                            f"{present} (written by {writer.op_type} {writer.name!r}): the state could not be "
                            "updated in place")
    return problems


def check_graph_file(path: Path, graph: str, dims: contract.GraphDims,
                     allowed_ops: frozenset[tuple[str, str]] = frozenset()) -> onnx.ModelProto:
    """Raise ContractError naming every departure of the graph at `path` from the contract; returns
    the graph (without its weights) for the caller's other checks."""
    model = onnx.load(str(path), load_external_data=False)
    problems = graph_problems(model, graph, dims, allowed_ops)
    if problems:
        raise contract.ContractError("; ".join(problems))
    return model


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    hist: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if is_default_domain(node.domain) else f"{node.domain}.{node.op_type}"
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))
