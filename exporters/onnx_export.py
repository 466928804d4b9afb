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
from tk.models.spec.manifest import STATIC_OPSET, Target, Variant
from tk.models.reference.decoder import Decoder
from tk.models.spec.errors import TkError
from tk.exporters.quantize_graph import dequantize_matmuls
from tk.exporters import trace_cache
from tk.exporters.replicate import TRACED_LAYERS, grow, order_io
from tk.exporters.weights import attach_external, export_view

MS_DOMAIN = "com.microsoft"
CONTRIB_OPS = {Target.PORTABLE: frozenset(),  # what each target may use outside the default domain
               Target.ORT: frozenset({(MS_DOMAIN, "SkipSimplifiedLayerNormalization"),
                                      (MS_DOMAIN, "GroupQueryAttention")})}


class ExportError(TkError, RuntimeError):
    """The exporter could not turn the model into the graph the contract asks for."""


class GraphModule(nn.Module):
    """The decoder as one graph of the contract: flat tensors in, flat tensors out.

    prefill: (input_ids, attention_mask, position_ids) -> (logits, present.0.key, ...)
    decode:  (..., past.0.key, ...) -> (logits, present...), one new token
    static decode: (..., write_indices, cache...) -> (logits, cache...), cache written in place
    With output_hidden, each layer's hidden state follows as a debug output (hidden.{i}).
    """

    def __init__(self, model: Decoder, static: bool = False, output_hidden: bool = False, fused: bool = False,
                 last_only: bool = False, decode_prefills: bool = False):
        super().__init__()
        self.model, self.static, self.output_hidden, self.fused = model, static, output_hidden, fused
        self.last_only, self.decode_prefills = last_only, decode_prefills

    def forward(self, input_ids, attention_mask, position_ids, *rest):
        write_index = None
        if self.static:
            write_index, rest = rest[0], rest[1:]
        past = [(rest[2 * i], rest[2 * i + 1]) for i in range(len(rest) // 2)] or None
        if self.fused:  # ONNX Runtime's kernels (tk export --target ort)
            from tk.models.reference import ort_kernels

            out = ort_kernels.forward(self.model, input_ids, attention_mask, position_ids, past, write_index,
                                      self.last_only, self.decode_prefills)
        else:
            out = self.model(input_ids, attention_mask, position_ids, past, write_index, self.output_hidden,
                             self.last_only)
        hidden = list(out[2]) if self.output_hidden else []
        return (out[0], *[t for kv in out[1] for t in kv], *hidden)


def _tensor_scatter(cache, update, write_indices, circular: bool = False):
    """tk::kv_write -> ONNX TensorScatter (opset 24; onnxscript's typed opsets stop at 23); a ring
    writes in circular mode (indices modulo its slots)."""
    from onnxscript.values import Opset

    return Opset("", 24).TensorScatter(cache, update, write_indices, axis=-2, mode="circular" if circular else "linear")


def _register_contrib_schemas() -> None:
    """The exporter builds nodes from onnx.defs schemas; ONNX Runtime's contrib ops have none there.
    Declare the two tk emits, with their inputs and outputs in ONNX Runtime's order (as far as tk uses them)."""
    import onnx
    from onnx.defs import OpSchema

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
                         P("position_ids", "I"), P("attention_bias", "T", param_option=optional)],
                 outputs=[P("output", "T"), P("present_key", "T"), P("present_value", "T")],
                 type_constraints=[("T", floats, ""), ("M", ["tensor(int32)"], ""), ("I", ["tensor(int64)"], "")],
                 attributes=[attr("num_heads", OpSchema.AttrType.INT, ""), attr("kv_num_heads", OpSchema.AttrType.INT, ""),
                             attr("do_rotary", OpSchema.AttrType.INT, ""), attr("scale", OpSchema.AttrType.FLOAT, ""),
                             attr("local_window_size", OpSchema.AttrType.INT, ""),
                             attr("softcap", OpSchema.AttrType.FLOAT, "")]),
    ]
    for schema in schemas:
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)


def _skip_simplified_layer_norm(h, delta, scale, eps: float):
    """tk::add_rms_norm -> com.microsoft SkipSimplifiedLayerNormalization (output 3 is h + delta)."""
    from onnxscript.values import Opset

    out, _, _, total = Opset(MS_DOMAIN, 1).SkipSimplifiedLayerNormalization(delta, h, scale, epsilon=eps)
    return out, total


def _group_query_attention(qkv, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, position_ids, bias,
                           num_heads: int, kv_num_heads: int, local_window: int, static: bool, rotary: bool,
                           scale: float | None, softcap: float = 0.0):
    """tk::gqa -> com.microsoft GroupQueryAttention on packed qkv, with RoPE (do_rotary) or without,
    softcapped scores where softcap > 0 (its default 0: off, so left out then)."""
    from onnxscript.values import Opset

    extra = {"softcap": float(softcap)} if softcap > 0 else {}
    return Opset(MS_DOMAIN, 1).GroupQueryAttention(
        qkv, None, None, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, position_ids, bias,
        num_heads=num_heads, kv_num_heads=kv_num_heads, do_rotary=int(rotary),
        scale=float(past_k.shape[-1]) ** -0.5 if scale is None else float(scale), local_window_size=local_window,
        **extra)


def _example(graph: str, model: Decoder, dims: contract.GraphDims, fused: bool = False):
    """Example inputs (batch 2, so batch is not specialized to 1) and dynamic shapes."""
    c, B, S, P = model.config, 2, 5, 3
    capacity, output_hidden = dims.kv_capacity, dims.hidden_size is not None
    batch = Dim(contract.BATCH, min=1)
    if graph == contract.DECODE and capacity is not None:
        new = 2 if dims.decode_prefills else 1  # a run of new tokens per row (2: not specialized to 1)
        # a narrow mask covers what the rows hold (not specialized to the capacity, nor to P + new)
        mask = torch.zeros(B, min(P + new + 2, capacity) if dims.narrow_mask else capacity, dtype=torch.int64)
        mask[:, : P + new] = 1
        past = [torch.zeros(B, c.num_kv_heads, n, c.head_dim, dtype=model.dtype) for n in dims.capacities() for _ in "kv"]
        args = (torch.randint(0, c.vocab_size, (B, new)), mask, P + torch.arange(new).repeat(B, 1),
                torch.full((B,), P, dtype=torch.int64), *past)
        tokens = {0: batch, 1: Dim(contract.SEQ, min=1)} if dims.decode_prefills else {0: batch}
        width = {1: Dim(contract.TOTAL, min=1, max=capacity)} if dims.narrow_mask else {}
        shapes = {"input_ids": tokens, "attention_mask": {0: batch, **width}, "position_ids": tokens,
                  "rest": ({0: batch}, *({0: batch} for _ in past))}  # write_indices, then the cache
        return GraphModule(model, static=True, output_hidden=output_hidden, fused=fused,
                           last_only=dims.decode_prefills, decode_prefills=dims.decode_prefills), args, shapes
    if graph == contract.PREFILL:
        seq = Dim(contract.SEQ, min=1)
        ids = torch.randint(0, c.vocab_size, (B, S))
        mask = torch.ones(B, S, dtype=torch.int64)
        args = (ids, mask, contract.position_ids_from_mask(mask))
        shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq},
                  "position_ids": {0: batch, 1: seq}}
        last = dims.prefill_logits == "last"
        return GraphModule(model, output_hidden=output_hidden, fused=fused, last_only=last), args, shapes
    past_dim = Dim(contract.PAST, min=1)  # never 0: TensorRT rejects empty dims; prefill covers "no past"
    ids = torch.randint(0, c.vocab_size, (B, 1))
    mask = torch.ones(B, P + 1, dtype=torch.int64)
    past = [torch.zeros(B, c.num_kv_heads, P, c.head_dim, dtype=model.dtype) for _ in range(2 * c.num_layers)]
    args = (ids, mask, torch.full((B, 1), P, dtype=torch.int64), *past)
    shapes = {"input_ids": {0: batch}, "attention_mask": {0: batch, 1: past_dim + 1},
              "position_ids": {0: batch}, "rest": tuple({0: batch, 2: past_dim} for _ in past)}
    return GraphModule(model, output_hidden=output_hidden, fused=fused), args, shapes


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
    variant: Variant
    program: object  # torch.onnx.ONNXProgram
    layers: int  # how many layers were traced
    seconds: float


def traced_layers(config) -> int:
    """How many layers to trace: TRACED_LAYERS when the model is deeper and its layers all compute
    the same function (grow() then copies the last one), else every layer (SmolLM3's NoPE layers)."""
    deep = config.num_layers > TRACED_LAYERS + 1
    return TRACED_LAYERS if deep and config.uniform_layers else config.num_layers


def trace_graph(model: Decoder, graph: str, dims: contract.GraphDims, variant: Variant) -> Traced:
    """Trace one graph of the contract `dims` describes from the meta-device export view `model`:
    no weight is needed, so this runs while the weights file is written. A model deeper than
    TRACED_LAYERS + 1 whose layers repeat is traced with TRACED_LAYERS layers (finish_graph grows it).

    With `dims.kv_capacity` the decode graph gets a static-capacity cache and opset 24 (TensorScatter).
    target "ort" fuses residual add + RMSNorm (both graphs) and the decode step's RoPE, cache write
    and attention into ONNX Runtime's contrib kernels; the graphs' inputs and outputs do not change.
    """
    start = time.perf_counter()
    layers = traced_layers(model.config)
    if layers < model.config.num_layers:
        model = export_view(model.config.first_layers(layers), model.dtype)
    program = _trace(model, graph, dataclasses.replace(dims, num_layers=layers), variant)
    return Traced(graph, dims, variant, program, layers, time.perf_counter() - start)


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
    if traced.variant.target is Target.ORT:
        _register_contrib_schemas()  # the optimizer infers the contrib ops' outputs (a cached trace registered none)
    _optimize(program, weights, path.parent, schemes)
    if traced.layers < layers:
        why = grow(program.model, layers, weights, lambda m: attach_external(m, weights, path.parent))
        if why is None:
            order_io(program.model.graph, [s.name for s in dims.inputs(graph)], [s.name for s in dims.outputs(graph)])
            how = f"traced {traced.layers} layers, copied to {layers}"
        else:
            program = _trace(model, graph, dims, traced.variant)
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
def _trace(model: Decoder, graph: str, dims: contract.GraphDims, variant: Variant):
    """torch.onnx.export on the meta device, unoptimized (the optimizer needs the weights' data)."""
    fused = variant.target is Target.ORT
    static = graph == contract.DECODE and dims.kv_capacity is not None
    opset = STATIC_OPSET if static and (not fused or dims.ring) else variant.opset  # TensorScatter; fused: rings only
    module, args, shapes = _example(graph, model, dims, fused)
    args = tuple(a.to("meta") for a in args)  # traced on the meta device: no weights in memory
    table = {}
    if static:
        table[torch.ops.tk.kv_write.default] = _tensor_scatter
    if fused:
        import tk.models.reference.ort_kernels  # noqa: F401  (registers the tk:: ops)

        _register_contrib_schemas()
        table[torch.ops.tk.add_rms_norm.default] = _skip_simplified_layer_norm
        table[torch.ops.tk.gqa.default] = _group_query_attention
    in_names = [s.name for s in dims.inputs(graph)]
    out_names = [s.name for s in dims.outputs(graph)]
    # "torchvision is not installed. Skipping torchvision::nms" and kin: not the user's business
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation chatter is not the user's business
        try:
            program = torch.onnx.export(
                module.eval(), args, dynamo=True, opset_version=opset, dynamic_shapes=shapes,
                input_names=in_names, output_names=out_names, verbose=False, optimize=False,
                custom_translation_table=table or None,
            )
        except Exception as e:  # the exporter raises many unrelated types; one line is what the user needs
            raise ExportError(f"torch.onnx.export failed for the {graph} graph: {str(e).splitlines()[0]}") from e
    return program
