"""Reference decoder -> two ONNX graphs (prefill, decode) with explicit KV-cache I/O.

Owns the graph wrappers, the dynamo export call, renaming symbolic dims to the contract's
names, and writing each graph with its weights as external data. It does not validate numerics
(toolkit/ runs the parity core for that) and does not decide where the artifact lands.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim

from tk.models.spec import contract
from tk.models.spec.variant import CacheLayout, PrefillLogits, Target, Variant
from tk.models.reference.attention import padded_queries
from tk.models.reference.decoder import Decoder
from tk.models.spec.errors import TkError
from tk.exporters.onnx_util import MS_DOMAIN
from tk.exporters.quantize_graph import dequantize_matmuls
from tk.exporters import trace_cache
from tk.exporters.replicate import TRACED_LAYERS, grow, order_io
from tk.exporters.weights import attach_external, export_view

CONTRIB_OPS = {Target.PORTABLE: frozenset(),  # what each target may use outside the default domain
               Target.ORT: frozenset({(MS_DOMAIN, "SkipSimplifiedLayerNormalization"),
                                      (MS_DOMAIN, "GroupQueryAttention"), (MS_DOMAIN, "CausalConvWithState"),
                                      (MS_DOMAIN, "LinearAttention"), (MS_DOMAIN, "MatMulIntegerToFloat")})}


class ExportError(TkError, RuntimeError):
    """The exporter could not turn the model into the graph the contract asks for."""


class GraphModule(nn.Module):
    """The decoder as one graph of the contract: flat tensors in, flat tensors out.

    prefill: (input_ids, attention_mask, position_ids) -> (logits, present.0.key, ...)
    decode:  (..., past.0.key, ...) -> (logits, present...), one new token
    static decode: (..., write_indices, cache...) -> (logits, cache...), cache written in place
    (with the variant's verify_logits, logits_to_keep follows write_indices: the run's positions whose logits come back)
    With the variant's debug outputs, each layer's hidden state follows (hidden.{i}).
    """

    def __init__(self, model: Decoder, graph: str, variant: Variant):
        super().__init__()
        self.model, self.variant = model, variant
        self.static = graph == contract.DECODE and variant.cache is CacheLayout.STATIC
        self.decode_prefills = self.static and variant.decode_prefills  # a run of new tokens, the last one's logits
        self.keeps = self.decode_prefills and variant.verify_logits  # logits_to_keep picks the positions
        self.last_only = (self.decode_prefills and not self.keeps if graph == contract.DECODE
                          else variant.prefill_logits is PrefillLogits.LAST)

    def forward(self, input_ids, attention_mask, position_ids, *rest):
        write_index = keep = None
        if self.static:
            write_index, rest = rest[0], rest[1:]
        if self.keeps:
            keep, rest = rest[0], rest[1:]
        past = self.model.group(rest) if rest else None
        hidden = self.variant.debug_outputs
        if self.variant.target is Target.ORT:  # ONNX Runtime's kernels (tk export --target ort)
            from tk.models.reference import ort_kernels

            out = ort_kernels.forward(self.model, input_ids, attention_mask, position_ids, past, write_index,
                                      self.last_only, self.decode_prefills, keep)
        else:
            out = self.model(input_ids, attention_mask, position_ids, past, write_index, hidden, self.last_only, keep)
        return (out[0], *[t for kv in out[1] for t in kv], *(list(out[2]) if hidden else []))


def _tensor_scatter(cache, update, write_indices, circular: bool = False):
    """tk::kv_write -> ONNX TensorScatter (opset 24; onnxscript's typed opsets stop at 23); a ring
    writes in circular mode (indices modulo its slots)."""
    from onnxscript.values import Opset

    return Opset("", 24).TensorScatter(cache, update, write_indices, axis=-2, mode="circular" if circular else "linear")


def _register_contrib_schemas() -> None:
    """The exporter builds nodes from onnx.defs schemas; ONNX Runtime's contrib ops have none there.
    Declare the ones tk emits, with their inputs and outputs in ONNX Runtime's order (as far as tk uses them)."""
    import onnx
    import onnx.reference.op_run  # noqa: F401  (its table of schemas by name is built once, before ONNX Runtime's
    from onnx.defs import OpSchema  # contrib ops, two of which share a name with opset 27's, are declared below)

    P, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    attr = OpSchema.Attribute
    schemas = [
        OpSchema("SkipSimplifiedLayerNormalization", MS_DOMAIN, 1,
                 inputs=[P("input", "T"), P("skip", "T"), P("gamma", "T")],
                 outputs=[P("output", "T"), P("mean", "U", param_option=optional),
                          P("inv_std_var", "U", param_option=optional),
                          P("input_skip_bias_sum", "T", param_option=optional)],
                 type_constraints=[("T", floats, ""), ("U", ["tensor(float)"], "")],
                 attributes=[attr("epsilon", OpSchema.AttrType.FLOAT, "")]),
        OpSchema("GroupQueryAttention", MS_DOMAIN, 1,
                 inputs=[P("query", "T"), P("key", "T", param_option=optional), P("value", "T", param_option=optional),
                         P("past_key", "T"), P("past_value", "T"), P("seqlens_k", "M"),
                         P("total_sequence_length", "M"), P("cos_cache", "T"), P("sin_cache", "T"),
                         P("position_ids", "I"), P("attention_bias", "T", param_option=optional),
                         P("head_sink", "T", param_option=optional)],
                 outputs=[P("output", "T"), P("present_key", "T"), P("present_value", "T")],
                 type_constraints=[("T", floats, ""), ("M", ["tensor(int32)"], ""), ("I", ["tensor(int64)"], "")],
                 attributes=[attr("num_heads", OpSchema.AttrType.INT, ""), attr("kv_num_heads", OpSchema.AttrType.INT, ""),
                             attr("do_rotary", OpSchema.AttrType.INT, ""), attr("scale", OpSchema.AttrType.FLOAT, ""),
                             attr("local_window_size", OpSchema.AttrType.INT, ""),
                             attr("softcap", OpSchema.AttrType.FLOAT, "")]),
        OpSchema("CausalConvWithState", MS_DOMAIN, 1,
                 inputs=[P("input", "T"), P("weight", "T"), P("bias", "T", param_option=optional),
                         P("past_state", "T", param_option=optional)],
                 outputs=[P("output", "T"), P("present_state", "T")],
                 type_constraints=[("T", floats, "")], attributes=[attr("activation", OpSchema.AttrType.STRING, "")]),
        OpSchema("LinearAttention", MS_DOMAIN, 1,
                 inputs=[P("query", "T"), P("key", "T"), P("value", "T"), P("past_state", "S", param_option=optional),
                         P("decay", "T", param_option=optional), P("beta", "T", param_option=optional)],
                 outputs=[P("output", "T"), P("present_state", "S")],
                 type_constraints=[("T", floats, ""), ("S", floats, "")],
                 attributes=[attr("q_num_heads", OpSchema.AttrType.INT, ""), attr("kv_num_heads", OpSchema.AttrType.INT, ""),
                             attr("update_rule", OpSchema.AttrType.STRING, ""), attr("scale", OpSchema.AttrType.FLOAT, "")]),
    ]
    for schema in schemas:
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)


def _skip_simplified_layer_norm(h, delta, scale, eps: float):
    """tk::add_rms_norm -> com.microsoft SkipSimplifiedLayerNormalization (output 3 is h + delta)."""
    from onnxscript.values import Opset

    out, _, _, total = Opset(MS_DOMAIN, 1).SkipSimplifiedLayerNormalization(delta, h, scale, epsilon=eps)
    return out, total


def _group_query_attention(qkv, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, position_ids, bias, sinks,
                           num_heads: int, kv_num_heads: int, local_window: int, static: bool, rotary: bool,
                           scale: float | None, softcap: float = 0.0):
    """tk::gqa -> com.microsoft GroupQueryAttention on packed qkv, with RoPE (do_rotary) or without,
    softcapped scores where softcap > 0 (its default 0: off, so left out then), gpt-oss's sinks as its
    head_sink input (input 11 in ONNX Runtime 1.32's schema)."""
    from onnxscript.values import Opset

    extra = {"softcap": float(softcap)} if softcap > 0 else {}
    tail = () if sinks is None else (sinks,)
    return Opset(MS_DOMAIN, 1).GroupQueryAttention(
        qkv, None, None, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, position_ids, bias, *tail,
        num_heads=num_heads, kv_num_heads=kv_num_heads, do_rotary=int(rotary),
        scale=float(past_k.shape[-1]) ** -0.5 if scale is None else float(scale), local_window_size=local_window,
        **extra)


def _causal_conv_with_state(x, weight, bias, state, silu: bool):
    """tk::causal_conv -> com.microsoft CausalConvWithState (SiLU fused where the layer applies it)."""
    from onnxscript.values import Opset

    return Opset(MS_DOMAIN, 1).CausalConvWithState(x, weight, bias, state, **({"activation": "silu"} if silu else {}))


def _linear_attention(q, k, v, state, decay, beta, heads: int, scale: float):
    """tk::linear_attention -> com.microsoft LinearAttention: the gated delta rule with beta, the gated rule without."""
    from onnxscript.values import Opset

    rule = "gated" if beta is None else "gated_delta"
    return Opset(MS_DOMAIN, 1).LinearAttention(q, k, v, state, decay, beta, q_num_heads=heads, kv_num_heads=heads,
                                               update_rule=rule, scale=float(scale))


def _example(graph: str, model: Decoder, dims: contract.GraphDims):
    """Example inputs and dynamic shapes, read off the contract's inputs: batch 2 (so it is not
    specialized to 1), a past of 3, a prompt of 5, a run of 2 new tokens where the static decode graph
    takes runs (not specialized to 1; 3 where it keeps 2 of their logits, so neither count is the
    other), and a narrow mask wider than what the rows hold (specialized neither to the capacity nor
    to the past and new tokens)."""
    B, S, P = 2, 5, 3
    module = GraphModule(model, graph, dims.variant)
    static = module.static
    new = (3 if module.keeps else 2) if module.decode_prefills else 1
    batch, past = Dim(contract.BATCH, min=1), Dim(contract.PAST, min=1)  # never 0: TensorRT rejects empty dims
    symbols = {contract.BATCH: batch, contract.SEQ: Dim(contract.SEQ, min=1), contract.PAST: past,
               contract.TOTAL: Dim(contract.TOTAL, min=1, max=dims.kv_capacity) if static else past + 1,
               contract.KEEP: Dim(contract.KEEP, min=1)}
    if graph == contract.PREFILL:
        sizes, start = {contract.BATCH: B, contract.SEQ: S}, 0
    elif static:
        sizes = {contract.BATCH: B, contract.SEQ: new, contract.TOTAL: min(P + new + 2, dims.kv_capacity),
                 contract.KEEP: new - 1}
        start = P
    else:
        sizes, start = {contract.BATCH: B, contract.PAST: P, contract.TOTAL: P + 1}, P
    args, shapes = [], []
    filled = P + new if static else None  # the static cache's mask: 1 over what the rows hold
    for spec in dims.inputs(graph):
        shape = contract.shape(spec, sizes)
        if spec.name == "input_ids":
            value = torch.randint(0, dims.vocab_size, shape)
        elif spec.name == "attention_mask":
            value = torch.zeros(shape, dtype=torch.int64)
            value[:, :filled] = 1
        elif spec.name == "position_ids":
            value = start + torch.arange(shape[1]).repeat(B, 1)
        elif spec.name == "write_indices":
            value = torch.full(shape, P, dtype=torch.int64)
        elif spec.name == "logits_to_keep":  # the run's last positions
            value = torch.arange(1, new)
        else:  # the cache (a recurrent state in its own dtype)
            value = torch.zeros(shape, dtype=model.dtype if spec.dtype == dims.kv_dtype else getattr(torch, spec.dtype))
        args.append(value)
        shapes.append({axis: symbols[d] for axis, d in enumerate(spec.dims) if isinstance(d, str)})
    named = dict(zip(("input_ids", "attention_mask", "position_ids"), shapes))
    rest = {"rest": tuple(shapes[3:])} if len(shapes) > 3 else {}  # write_indices, logits_to_keep and the cache
    return module, tuple(args), {**named, **rest}


def _rename_dims(ir_graph) -> None:
    """The exporter names a derived dim by its expression; the contract calls it total_sequence_length."""
    import onnx_ir as ir

    rename = {f"{contract.PAST} + 1": contract.TOTAL}
    for value in [*ir_graph.inputs, *ir_graph.outputs]:
        dims = [ir.SymbolicDim(rename.get(str(d), str(d))) if isinstance(d, ir.SymbolicDim) else d
                for d in value.shape]
        value.shape = ir.Shape(dims)


@dataclasses.dataclass
class Traced:
    """One graph traced on the meta device, not yet pointed at its weights."""

    graph: str
    dims: contract.GraphDims
    program: object  # torch.onnx.ONNXProgram
    layers: int  # how many layers were traced
    seconds: float


def traced_layers(config) -> int:
    """How many layers to trace: TRACED_LAYERS when the model is deeper and its layers all compute
    the same function (grow() then copies the last one), else every layer (SmolLM3's NoPE layers)."""
    deep = config.num_layers > TRACED_LAYERS + 1
    return TRACED_LAYERS if deep and config.uniform_layers else config.num_layers


def trace_graph(model: Decoder, graph: str, dims: contract.GraphDims) -> Traced:
    """Trace one graph of the contract `dims` describes from the meta-device export view `model`:
    no weight is needed, so this runs while the weights file is written. A model deeper than
    TRACED_LAYERS + 1 whose layers repeat is traced with TRACED_LAYERS layers (finish_graph grows it).

    With `dims.kv_capacity` the decode graph gets a static-capacity cache, in the opset `dims.opset` gives.
    target "ort" fuses residual add + RMSNorm (both graphs) and the decode step's RoPE, cache write
    and attention into ONNX Runtime's contrib kernels; the graphs' inputs and outputs do not change.
    """
    start = time.perf_counter()
    layers = traced_layers(model.config)
    if layers < model.config.num_layers:
        model = export_view(model.config.first_layers(layers), model.dtype)
    program = _trace(model, graph, dataclasses.replace(dims, num_layers=layers))
    return Traced(graph, dims, program, layers, time.perf_counter() - start)


def finish_graph(traced: Traced, model: Decoder, path: Path, weights: dict[str, tuple],
                 schemes: dict | None = None) -> tuple[float, str]:
    """Point the traced graph's initializers into the weights file `weights` describes (it must be
    written by now; quantized weights, with their `schemes`, read through DequantizeLinear:
    exporters/quantize_graph.py), run the exporter's optimizer over the real data, grow the layers
    (exporters/replicate.py; when they do not repeat exactly, trace every layer instead) and save it
    to `path`. Returns the graph's seconds in all, and how its layers were made."""
    import onnx_ir as ir

    start = time.perf_counter()
    graph, dims, layers = traced.graph, traced.dims, model.config.num_layers
    program, how = traced.program, f"traced {layers} layers"
    if dims.variant.target is Target.ORT:
        _register_contrib_schemas()  # the optimizer infers the contrib ops' outputs (a cached trace registered none)
    _optimize(program, weights, path.parent, schemes)
    if traced.layers < layers:
        why = grow(program.model, layers, weights, lambda m: attach_external(m, weights, path.parent))
        if why is None:
            order_io(program.model.graph, [s.name for s in dims.inputs(graph)], [s.name for s in dims.outputs(graph)])
            how = f"traced {traced.layers} layers, copied to {layers}"
        else:
            program = _trace(model, graph, dims)
            _optimize(program, weights, path.parent, schemes)
            how += f" ({why})"
    _rename_dims(program.model.graph)
    ir.save(program.model, str(path))
    return traced.seconds + time.perf_counter() - start, how


def _optimize(program, weights: dict[str, tuple], base_dir: Path, schemes: dict | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if schemes:
            dequantize_matmuls(program.model, weights, schemes, base_dir)
        attach_external(program.model, weights, base_dir)
        program.optimize()  # what export(optimize=True) runs (folding, fusions), now over the real data


@trace_cache.cached
def _trace(model: Decoder, graph: str, dims: contract.GraphDims):
    """torch.onnx.export on the meta device, unoptimized (the optimizer needs the weights' data)."""
    fused = dims.variant.target is Target.ORT
    static = graph == contract.DECODE and dims.kv_capacity is not None
    module, args, shapes = _example(graph, model, dims)
    args = tuple(a.to("meta") for a in args)  # traced on the meta device: no weights in memory
    table = {}
    if static:
        table[torch.ops.tk.kv_write.default] = _tensor_scatter
    if fused:
        import tk.models.reference.ort_kernels  # noqa: F401  (registers the tk:: ops)

        _register_contrib_schemas()
        table[torch.ops.tk.add_rms_norm.default] = _skip_simplified_layer_norm
        table[torch.ops.tk.gqa.default] = _group_query_attention
        table[torch.ops.tk.causal_conv.default] = _causal_conv_with_state
        table[torch.ops.tk.linear_attention.default] = _linear_attention
    in_names = [s.name for s in dims.inputs(graph)]
    out_names = [s.name for s in dims.outputs(graph)]
    # "torchvision is not installed. Skipping torchvision::nms" and kin: not the user's business
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad(), padded_queries(model, dims.variant.pad_queries):
        warnings.simplefilter("ignore")  # the exporter's deprecation chatter is not the user's business
        try:
            program = torch.onnx.export(
                module.eval(), args, dynamo=True, opset_version=dims.opset(graph), dynamic_shapes=shapes,
                input_names=in_names, output_names=out_names, verbose=False, optimize=False,
                custom_translation_table=table or None,
            )
        except Exception as e:  # the exporter raises many unrelated types; one line is what the user needs
            raise ExportError(f"torch.onnx.export failed for the {graph} graph: {str(e).splitlines()[0]}") from e
    return program
