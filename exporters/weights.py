"""The artifact's one weights file, written by streaming tensors from the checkpoint, and the
meta-device view of the decoder the graphs are traced from.

Exporting with real tensors costs several copies of the weights: the model, the exporter's own,
and every transposed weight its optimizer folds into a new initializer (`MatMul(x, Transpose(W))`
becomes `MatMul(x, W')`, a copy per graph, named differently in each). tk instead
- builds an export view of the decoder on the meta device (no memory) whose linear layers hold
  their weight already as `[in, out]` (`LinearT`: what ONNX MatMul reads, so nothing is folded;
  also the layout a quantized `DequantizeLinear` weight takes) and whose norms hold their full
  scale in float32 (the offset of Gemma's norms added at write time);
- writes `weights.onnx.data` once, one tensor at a time from the safetensors files (concatenating
  q/k/v and gate/up, transposing, casting as it goes), each at a page-aligned offset (ONNX Runtime
  memory-maps aligned external data);
- traces each graph on the meta device and points its initializers at that file (ONNX external
  data: location, offset, length) before the exporter's optimizer runs, so what it folds it reads
  from the file. Both graphs share the file; tracing costs the same whatever the model's size.
Offsets are planned from the view alone (`plan_weights`), so the graphs can be traced while the
file is written. With quantized weights (a quantized `Precision`) each linear `weight_t` is
written as `.quant` (int4 packed two per byte, or int8) and `.scale` entries instead
(models/quantize.py), which exporters/quantize_graph.py reads through DequantizeLinear.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx.external_data_helper import ExternalDataInfo
from torch import nn

from tk.models.config import DecoderConfig
from tk.models.decoder import Decoder, RMSNorm
from tk.models.positions import rope_inv_freq
from tk.models.artifact import Precision
from tk.models.loading import CheckpointReader, ReusableBuffer
from tk.models.quantize import pack_int4, quantize, quantized_layers

WEIGHTS_FILE = "weights.onnx.data"
ALIGN = 4096  # a page: ONNX Runtime maps page-aligned external data instead of reading it
QUANT, SCALE = ".quant", ".scale"  # a quantized weight's two initializers
CHUNK = 16 << 20  # bytes per write(): 256 MiB writes cost 4x the kernel time of 16 MiB ones here
PREFIX = "model."  # the graph wrapper holds the decoder as `model`


class LinearT(nn.Module):
    """y = x @ weight_t + bias, weight_t stored [in, out]."""

    def __init__(self, k: int, n: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(k, n, device="meta", dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n, device="meta", dtype=dtype)) if bias else None

    def forward(self, x):
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def export_view(cfg: DecoderConfig, dtype: torch.dtype) -> Decoder:
    """The decoder on the meta device, with LinearT layers and float32 norm scales."""
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, LinearT(child.in_features, child.out_features, child.bias is not None, dtype))
            elif isinstance(child, RMSNorm):
                child.weight = nn.Parameter(torch.empty(child.weight.shape, device="meta", dtype=torch.float32))
                child.offset = 0.0  # the written scale includes it
    for name, buf in list(model.named_buffers()):  # inv_freq (and inv_freq_local): RoPE tables, float32
        setattr(model, name, torch.empty(buf.shape, device="meta", dtype=torch.float32))
    return model.eval()


def _tensor(reader: CheckpointReader, name: str, dtype: torch.dtype,
            bufs: tuple[ReusableBuffer, ReusableBuffer]) -> torch.Tensor:
    """One tensor of the export view, computed from the checkpoint (in `bufs` when large)."""
    cfg = reader.cfg
    if name in ("inv_freq", "inv_freq_local"):
        return rope_inv_freq(cfg, "local" if name.endswith("local") else "global")
    if name.endswith("norm.weight"):  # computed as RMSNorm.scale() computes it, from the dtype's weight
        return reader.tensor(name, dtype).float() + cfg.norm_offset
    ours = name.removesuffix("_t")
    t = reader.tensor(ours, dtype, out=bufs[0].view(reader.shape(ours), dtype))
    if name.endswith(".weight_t"):  # a contiguous transposed copy: 4-9x faster than into column slices
        return bufs[1].view(t.T.shape, dtype).copy_(t.T)
    return t


def quantized_names(view: Decoder, precision: Precision | None) -> set[str]:
    """The view's `weight_t` initializers a quantized export stores as (QUANT, SCALE) pairs."""
    if precision is None or not precision.quantized:
        return set()
    return {PREFIX + n + "_t" for n in quantized_layers(view.config, precision.quantized_lm_head)}


def plan_weights(view: Decoder, precision: Precision | None = None) -> dict[str, tuple]:
    """Where each parameter and buffer of the view goes in the weights file, before a byte is read:
    initializer name -> (offset, length, dtype, shape), page-aligned, in the view's order (dtype: a
    torch dtype, or "int4"). A quantized weight `W` is two entries instead, `W.quant` (int4 or int8,
    [K, N]) and `W.scale` ([K / block, N], in the activations' dtype). The graphs can point at the
    file while it is still being written."""
    quantized = quantized_names(view, precision)
    entries = []
    for name, t in [*view.named_parameters(), *view.named_buffers()]:
        name = PREFIX + name
        if name not in quantized:
            entries.append((name, t.numel() * t.element_size(), t.dtype, tuple(t.shape)))
            continue
        k, n = t.shape
        bits = precision.weights
        entries.append((name + QUANT, (k * n + 1) // 2 if bits == "int4" else k * n,
                        "int4" if bits == "int4" else torch.int8, (k, n)))
        entries.append((name + SCALE, k // precision.block_size * n * t.element_size(), t.dtype,
                        (k // precision.block_size, n)))
    table, offset = {}, 0
    for name, length, dtype, shape in entries:
        offset += -offset % ALIGN
        table[name] = (offset, length, dtype, shape)
        offset += length
    return table


def write_weights(reader: CheckpointReader, view: Decoder, path: Path, dtype: torch.dtype,
                  stop: threading.Event | None = None, precision: Precision | None = None) -> dict[str, tuple] | None:
    """Stream every parameter and buffer of the view into `path`, at the places `plan_weights` gives
    (quantizing where `precision` says, models/quantize.py); -> that plan, or None when `stop` was
    set before the end (the caller failed meanwhile)."""
    table, bufs = plan_weights(view, precision), (ReusableBuffer(), ReusableBuffer())  # read, transposed
    with open(path, "wb") as out:
        for name, (offset, length, want_dtype, shape) in table.items():
            if stop is not None and stop.is_set():
                return None
            if name.endswith(SCALE):
                continue  # written with its QUANT
            if name.endswith(QUANT):
                base = name.removesuffix(QUANT)
                w_t = _tensor(reader, base.removeprefix(PREFIX), torch.float32, bufs).numpy()
                q, scales = quantize(w_t, precision.weights, precision.block_size)
                _write(out, offset, pack_int4(q) if want_dtype == "int4" else q, length, name)
                s_offset, s_length, s_dtype, _ = table[base + SCALE]
                _write(out, s_offset, torch.from_numpy(scales).to(s_dtype), s_length, base + SCALE)
                continue
            t = _tensor(reader, name.removeprefix(PREFIX), dtype, bufs).contiguous()
            if t.dtype != want_dtype or tuple(t.shape) != shape:
                raise AssertionError(f"{name}: wrote {t.dtype} {tuple(t.shape)}, planned {want_dtype} {shape}")
            _write(out, offset, t, length, name)
            del t
    return table


def _write(out, offset: int, t, length: int, name: str) -> None:
    """Write tensor or array `t` at `offset` (after zero padding), checking it fills `length`."""
    out.write(b"\0" * (offset - out.tell()))
    if isinstance(t, torch.Tensor):
        t = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()  # numpy has no bf16
    view = memoryview(np.ascontiguousarray(t)).cast("B")
    for start in range(0, len(view), CHUNK):  # 4x less kernel time than one write per tensor
        out.write(view[start:start + CHUNK])
    if out.tell() != offset + length:
        raise AssertionError(f"{name}: wrote {out.tell() - offset} bytes, planned {length}")


def weights_record(table: dict[str, tuple], graphs: dict[str, Path]) -> dict[str, list]:
    """The table as the manifest records it: name -> [offset, length, dtype name, shape, the graphs
    (of `graphs`, name -> saved file) whose initializers include it]."""
    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8",
             "int4": "int4"}
    used = {g: set(external_initializers(onnx.load(str(p), load_external_data=False))) for g, p in graphs.items()}
    return {name: [o, n, names[d], list(shape), [g for g in graphs if name in used[g]]]
            for name, (o, n, d, shape) in table.items()}


def external_tensor(name: str, entry: tuple, base_dir: Path):
    """The onnx_ir tensor of one entry of the weights file's table, read from the file on demand."""
    import onnx_ir as ir

    dtypes = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16,
              torch.bfloat16: ir.DataType.BFLOAT16, torch.int8: ir.DataType.INT8, "int4": ir.DataType.INT4}
    offset, length, dtype, shape = entry
    return ir.ExternalTensor(WEIGHTS_FILE, offset, length, dtypes[dtype], shape=ir.Shape(shape), name=name,
                             base_dir=str(base_dir))


def attach_external(ir_model, table: dict[str, tuple], base_dir: Path) -> None:
    """Point the graph's meta initializers at their place in the weights file."""
    for name, value in ir_model.graph.initializers.items():
        if name in table:
            value.const_value = external_tensor(name, table[name], base_dir)


def external_initializers(model: onnx.ModelProto) -> dict[str, tuple[int, int, int, tuple[int, ...]]]:
    """name -> (offset, length, onnx data type, dims) of every initializer stored as external data."""
    out = {}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = ExternalDataInfo(tensor)
            out[tensor.name] = (info.offset, info.length, tensor.data_type, tuple(tensor.dims))
    return out
