"""Grow a graph traced with a few layers to the model's full depth.

Every layer of the decoder is the same subgraph over its own weights and its own cache, and the
exporter's cost grows faster than the layer count (19-26 s per graph for 22 layers of TinyLlama's
shape, 3-4 s for 4). So tk traces TRACED_LAYERS layers, checks that the last two traced layers are
the same subgraph (same ops, attributes and wiring, each reading the layer before it the same way),
and copies the last one until the graph has every layer. When the check fails (a model whose layers
differ), the caller traces every layer instead: the copy is only ever an exact one.

How a node is assigned to a layer: a node that depends only on layer-invariant values (graph
inputs shared by all layers, shared weights, constants, the shape of a cache input, which the
contract makes the same for every layer) is shared, whatever module emitted it, and is never
copied (the mask, RoPE's cos/sin, shape arithmetic); a node that reads the final norm's weight, or
the epilogue, is the epilogue (final norm, LM head), rewired to the last layer; any other node
belongs to the layer its `namespace` metadata names (`model.layers.{i}`), or, without one (nodes
the optimizer made, the fused kernels' calls), to the latest layer among its inputs. The first
layers may differ from the rest (they compute shapes the later ones reuse, read as "far" values):
only the last two traced ones must match.
"""

from __future__ import annotations

import re

TRACED_LAYERS = 4  # the first layers may differ (they compute shapes the rest reuse): the last two are compared
_LAYER_NAME = re.compile(r"^(model\.layers\.|past_key_values\.|present\.|hidden\.)(\d+)(\b.*)$")
_NAMESPACE = re.compile(r"model\.layers\.(\d+)[.:]")
SHARED, EPILOGUE = -1, 1 << 30
FINAL_WEIGHTS = frozenset({"model.norm.weight"})  # what only the epilogue reads
# torch.export's data-dependent sizes (u0, u1, ...: how many tokens an expert takes, NonZero's count):
# each copy of a layer gets its own, or ONNX Runtime would plan one buffer for sizes that differ
_UNBACKED = re.compile(r"\bu\d+\b")


def _name_layer(name: str) -> int | None:
    m = _LAYER_NAME.match(name or "")
    return int(m.group(2)) if m else None


def _renamed(name: str, layer: int) -> str:
    m = _LAYER_NAME.match(name)
    return f"{m.group(1)}{layer}{m.group(3)}"


def _labels(graph) -> dict:
    """node -> its layer, SHARED or EPILOGUE (nodes are in topological order)."""
    labels, value_label = {}, {}
    for v in [*graph.inputs, *graph.initializers.values()]:
        layer = _name_layer(v.name)
        value_label[v] = SHARED if layer is None else layer
    for node in graph:
        ins = [value_label.get(v, SHARED) for v in node.inputs if v is not None]
        m = _NAMESPACE.search(node.metadata_props.get("namespace", ""))
        if all(x == SHARED for x in ins) or _cache_shape(node):
            label = SHARED
        elif EPILOGUE in ins or any(v is not None and v.name in FINAL_WEIGHTS for v in node.inputs):
            label = EPILOGUE
        else:
            label = int(m.group(1)) if m else max(ins)
        labels[node] = label
        for out in node.outputs:
            value_label[out] = label
    for node in reversed(list(graph)):  # what only the epilogue reads (LM head's last position) is epilogue
        if labels[node] >= 0 and not _NAMESPACE.search(node.metadata_props.get("namespace", "")):
            users = [u for out in node.outputs for u, _ in out.uses()]
            if users and not any(out.is_graph_output() for out in node.outputs) \
                    and all(labels[u] == EPILOGUE for u in users):
                labels[node] = EPILOGUE
    return labels


def _cache_shape(node) -> bool:
    """Shape of a cache input: the contract gives every layer's cache the same shape, so the
    sequence lengths and masks the tracer derived from one layer's are every layer's."""
    v = node.inputs[0] if node.op_type == "Shape" and node.domain == "" and node.inputs else None
    return v is not None and v.is_graph_input() and v.name.startswith("past_key_values.")


def _shared(v, memo: dict):
    """A layer-invariant value, by what computes it: layers that each recompute RoPE's cos/sin from
    the same inputs read equal values."""
    if v not in memo:
        node = v.producer()
        if node is None:
            memo[v] = ("leaf", id(v))
        else:
            memo[v] = ("calc", node.domain, node.op_type, _attrs(node), v.index(),
                       tuple(None if i is None else _shared(i, memo) for i in node.inputs))
    return memo[v]


def _attrs(node) -> tuple:
    return tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))


def _signature(nodes: list, layer: int, index: dict, memo: dict) -> list | None:
    """What each node of `layer` is and reads, in terms that do not depend on the layer's number:
    its op and attributes, and for each input: a value of this layer (by node and output index), of
    the layer before (same), this layer's weight or cache input (by name less its number), or a
    shared value (by what computes it). None when the layer reads anything else."""
    sig = []
    for node in nodes:
        ins = []
        for v in node.inputs:
            where = index.get(v.producer()) if v is not None and v.producer() is not None else None
            if v is None:
                ins.append(None)
            elif where is not None:
                if where[0] == layer or where[0] == layer - 1:
                    ins.append(("own" if where[0] == layer else "prev", where[1], v.index()))
                elif 0 <= where[0] < layer - 1:  # an earlier layer's value every later layer reads (a shape)
                    ins.append(("far", id(v)))
                else:
                    return None  # the epilogue
            elif v.producer() is None and _name_layer(v.name) == layer:
                ins.append(("named", _renamed(v.name, 0)))
            elif v.producer() is None and _name_layer(v.name) is not None:
                return None  # another layer's weight or cache
            else:
                ins.append(("shared", _shared(v, memo)))
        outs = [_renamed(o.name, 0) if o.is_graph_output() and _name_layer(o.name) is not None else o.is_graph_output()
                for o in node.outputs]
        sig.append((node.domain, node.op_type, node.overload, _attrs(node), tuple(ins), tuple(outs)))
    return sig


def grow(ir_model, num_layers: int, external: dict, attach) -> str | None:
    """Copy the last traced layer of `ir_model` (traced with TRACED_LAYERS layers) until it has
    `num_layers`; `attach(ir_model)` points the new weights into the weights file. Returns None on
    success, or why the layers do not repeat (the model is then left untouched)."""
    import onnx_ir as ir

    graph, last = ir_model.graph, TRACED_LAYERS - 1
    labels = _labels(graph)
    layers = {i: [n for n in graph if labels[n] == i] for i in range(TRACED_LAYERS)}
    index = {n: (i, pos) for i, nodes in layers.items() for pos, n in enumerate(nodes)}
    memo = {}
    template = _signature(layers[last], last, index, memo)
    if not template or template != _signature(layers[last - 1], last - 1, index, memo):
        return "the traced layers are not the same subgraph"
    for v in graph.initializers.values():
        if _name_layer(v.name) == last and any(_renamed(v.name, k) not in external for k in range(num_layers)):
            return f"the layer reads a constant that is not one of its weights ({v.name})"
    new_values = {}  # (template value name, layer) -> that layer's graph input or weight
    prev_layer = {n: n for n in layers[last]}  # template node -> the copy in the layer before the one made
    anchor = layers[last][-1]
    for k in range(TRACED_LAYERS, num_layers):
        made = {}
        copies = []
        for node in layers[last]:
            inputs = []
            for v in node.inputs:
                if v is None:
                    inputs.append(None)
                elif v.producer() in made:  # this layer
                    inputs.append(made[v.producer()].outputs[v.index()])
                elif v.producer() is not None and index.get(v.producer(), (None,))[0] == last - 1:
                    # the layer before: same position in its copy
                    pos = index[v.producer()][1]
                    inputs.append(prev_layer[layers[last][pos]].outputs[v.index()])
                elif _name_layer(v.name) == last:
                    inputs.append(_layer_value(graph, v, k, new_values))
                else:
                    inputs.append(v)
            copy = ir.Node(node.domain, node.op_type, inputs,
                           [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
                           overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                           name=f"{node.name}_layer{k}",
                           metadata_props={key: re.sub(r"model\.layers\.\d+", f"model.layers.{k}", val)
                                           for key, val in node.metadata_props.items()})
            for out, src in zip(copy.outputs, node.outputs):
                out.name = _renamed(src.name, k) if src.is_graph_output() and _name_layer(src.name) == last \
                    else f"{src.name}_layer{k}"
                out.type, out.shape = src.type, _copied_shape(src.shape, k)
                if src.is_graph_output():
                    graph.outputs.append(out)
            made[node] = copy
            copies.append(copy)
        graph.insert_after(anchor, copies)
        anchor = copies[-1]
        prev_layer = made
    for node in graph:  # the epilogue reads the last layer
        if labels.get(node) == EPILOGUE:
            for i, v in enumerate(node.inputs):
                if v is not None and v.producer() in prev_layer and labels[v.producer()] == last:
                    node.replace_input_with(i, prev_layer[v.producer()].outputs[v.index()])
    attach(ir_model)
    return None


def _copied_shape(shape, layer: int):
    """A value's shape in the copy for `layer`: its data-dependent dims renamed for that layer."""
    import onnx_ir as ir

    if shape is None:
        return None
    return ir.Shape([ir.SymbolicDim(_UNBACKED.sub(lambda m: f"{m.group(0)}_layer{layer}", d.value))
                     if isinstance(d, ir.SymbolicDim) and d.value and _UNBACKED.search(d.value) else d for d in shape])


def _layer_value(graph, template, layer: int, made: dict):
    """The graph input or weight of `layer` that corresponds to the template layer's `template`."""
    import onnx_ir as ir

    key = (template.name, layer)
    if key not in made:
        value = ir.Value(name=_renamed(template.name, layer), type=template.type,
                         shape=ir.Shape(list(template.shape)) if template.shape is not None else None)
        if template.is_graph_input():
            graph.inputs.append(value)
        else:
            value.const_value = template.const_value  # replaced by attach() with the layer's own data
            graph.register_initializer(value)
        made[key] = value
    return made[key]


def order_io(graph, inputs: list[str], outputs: list[str]) -> None:
    """Put the graph's inputs and outputs in the contract's order."""
    for io, names in ((graph.inputs, inputs), (graph.outputs, outputs)):
        by_name = {v.name: v for v in io}
        if set(by_name) != set(names):
            missing, extra = set(names) - set(by_name), set(by_name) - set(names)
            raise AssertionError(f"grown graph's I/O differ from the contract: missing {sorted(missing)[:4]}, "
                                 f"extra {sorted(extra)[:4]}")
        io.clear()
        io.extend(by_name[n] for n in names)
