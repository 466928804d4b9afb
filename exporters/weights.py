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
written as `.quant` (int4/uint4 packed two per byte, or int8/uint8), `.scale` and, with zero
points, `.zero` entries instead (models/quant/quantize.py), which exporters/quantize_graph.py reads
through DequantizeLinear; a quantized embedding is read from such a table too.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx.external_data_helper import ExternalDataInfo
from torch import nn

from tk.models.spec.config import DecoderConfig
from tk.models.reference.decoder import Decoder
from tk.models.reference.layers import RMSNorm
from tk.models.reference.positions import rope_inv_freq
from tk.models.spec.manifest import Precision, WeightEntry
from tk.models.quant.calibration import Calibration
from tk.models.checkpoint.loading import CheckpointReader, ReusableBuffer
from tk.models.quant.plan import quant_plan
from tk.models.quant.quantize import Scheme, blocks_of, pack_int4, quantize

WEIGHTS_FILE = "weights.onnx.data"
ALIGN = 4096  # a page: ONNX Runtime maps page-aligned external data instead of reading it
# a quantized weight's initializers: integers, scales, zero points, and a 4-bit table's bytes as uint8
QUANT, SCALE, ZERO, BYTES = ".quant", ".scale", ".zero", ".bytes"
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
            bufs: tuple[ReusableBuffer, ReusableBuffer], calibration: Calibration | None = None) -> torch.Tensor:
    """One tensor of the export view, computed from the checkpoint (in `bufs` when large), with
    calibration's channel scales applied (models/quant/calibration.py)."""
    cfg = reader.cfg
    if name in ("inv_freq", "inv_freq_local"):
        return rope_inv_freq(cfg, "local" if name.endswith("local") else "global")
    scaled = calibration.apply_ if calibration is not None else (lambda cfg, name, t: t)
    if name.endswith("norm.weight"):  # computed as RMSNorm.scale() computes it, from the dtype's weight
        return scaled(cfg, name, reader.tensor(name, dtype)).float() + cfg.norm_offset
    ours = name.removesuffix("_t")
    t = scaled(cfg, ours, reader.tensor(ours, dtype, out=bufs[0].view(reader.shape(ours), dtype)))
    if name.endswith(".weight_t"):  # a contiguous transposed copy: 4-9x faster than into column slices
        return bufs[1].view(t.T.shape, dtype).copy_(t.T)
    return t


def quant_table(view: Decoder, precision: Precision | None) -> dict[str, Scheme]:
    """The view's initializers a quantized export stores as integers (QUANT, SCALE and, with zero
    points, ZERO entries), each with its scheme (models/quant/plan.py `quant_plan`): `W_t` for a linear
    layer's weight; `model.embed.weight_t` for an untied quantized embedding (a tied one is gathered
    from the LM head's table, and the float table is not written)."""
    if precision is None or not precision.quantized:
        return {}
    return {PREFIX + n + "_t": s for n, s in quant_plan(view.config, precision).items()}


def _quant_entries(name: str, k: int, n: int, scheme: Scheme, scale_dtype: torch.dtype) -> list[tuple]:
    """The file entries of one quantized weight [K, N]: its integers (int4/uint4 packed two a byte,
    or int8/uint8), its scales per block and, with zero points, its zero points per block."""
    nb, four = blocks_of(k, scheme.block), scheme.bits == "int4"
    ints = scheme.onnx_type if four else (torch.uint8 if scheme.zero_points else torch.int8)
    entries = [(name + QUANT, (k * n + 1) // 2 if four else k * n, ints, (k, n)),
               (name + SCALE, nb * n * torch.finfo(scale_dtype).bits // 8, scale_dtype, (nb, n))]
    if scheme.zero_points:
        entries.append((name + ZERO, (nb * n + 1) // 2 if four else nb * n, "uint4" if four else torch.uint8, (nb, n)))
    return entries


def plan_weights(view: Decoder, precision: Precision | None = None) -> dict[str, tuple]:
    """Where each parameter and buffer of the view goes in the weights file, before a byte is read:
    initializer name -> (offset, length, dtype, shape), page-aligned, in the view's order (dtype: a
    torch dtype, or "int4"/"uint4"). A quantized weight `W` is two or three entries instead (`_quant_entries`);
    the table a quantized embedding is gathered from also gets BYTES aliases of its integers, scales and
    zero points (same offset; 4-bit ones as uint8, two columns a byte; the others [rows, N, 1]).
    The graphs can point at the file while it is still being written."""
    schemes = quant_table(view, precision)
    embed = PREFIX + "embed.weight"
    entries = []
    for name, t in [*view.named_parameters(), *view.named_buffers()]:
        name = PREFIX + name
        if name == embed and precision is not None and precision.quantized and precision.quantized_embedding:
            if name + "_t" in schemes:  # untied: its own table, transposed; tied: the LM head's
                entries += _quant_entries(name + "_t", t.shape[1], t.shape[0], schemes[name + "_t"], t.dtype)
            continue
        if name in schemes:
            entries += _quant_entries(name, *t.shape, schemes[name], t.dtype)
        else:
            entries.append((name, t.numel() * t.element_size(), t.dtype, tuple(t.shape)))
    table, offset = {}, 0
    for name, length, dtype, shape in entries:
        offset += -offset % ALIGN
        table[name] = (offset, length, dtype, shape)
        offset += length
    source = next((n for n in (embed + "_t", PREFIX + "lm_head.weight_t") if n + QUANT in table), None)
    if source is not None and precision.quantized_embedding:  # what the embedding's Gather reads
        for name in (source + QUANT, source + SCALE, source + ZERO):  # another name: ORT fuses a DQ whose
            if name in table:  # inputs it alone reads (and another shape, or the exporter's optimizer merges them)
                offset, length, dtype, (k, n) = table[name]
                four = dtype in ("int4", "uint4")
                table[name + BYTES] = (offset, length, torch.uint8 if four else dtype, (k, n // 2) if four else (k, n, 1))
    return table


def planned_size(table: dict[str, tuple]) -> tuple[int, int]:
    """(bytes, tensors) `write_weights` writes for plan `table`: what its progress counts up to (a
    quantized weight is one tensor of two or three entries; BYTES aliases take no bytes of their own)."""
    return (sum(e[1] for n, e in table.items() if not n.endswith(BYTES)),
            sum(not n.endswith((SCALE, ZERO, BYTES)) for n in table))


def write_weights(reader: CheckpointReader, view: Decoder, path: Path, dtype: torch.dtype,
                  stop: threading.Event | None = None, precision: Precision | None = None,
                  calibration: Calibration | None = None, task=None) -> dict[str, tuple] | None:
    """Stream every parameter and buffer of the view into `path`, at the places `plan_weights` gives
    (quantizing where `precision` says, models/quant/quantize.py, with `calibration`'s channel scales and
    importance); -> that plan, or None when `stop` was set before the end (the caller failed meanwhile).
    `task` (a tk.toolkit.progress.Task, or None) is advanced by each tensor's bytes as it lands, up to
    `planned_size`."""
    table, bufs = plan_weights(view, precision), (ReusableBuffer(), ReusableBuffer())  # read, transposed
    schemes = quant_table(view, precision)
    with open(path, "wb") as out:
        for name, (offset, length, want_dtype, shape) in table.items():
            if stop is not None and stop.is_set():
                return None
            if name.endswith((SCALE, ZERO, BYTES)):
                continue  # written with its QUANT, or an alias
            if name.endswith(QUANT):
                base = name.removesuffix(QUANT)
                ours = base.removeprefix(PREFIX).removesuffix("_t")
                if ours in reader.packed:  # a GPTQ/AWQ checkpoint's own integers
                    qt = reader.quantized(ours)
                else:
                    w_t = _tensor(reader, base.removeprefix(PREFIX), torch.float32, bufs, calibration).numpy()
                    qt = quantize(w_t, schemes[base], calibration and calibration.importance_of(ours))
                for suffix, values in ((QUANT, qt.q), (SCALE, qt.scales), (ZERO, qt.zeros)):
                    if values is None:
                        continue
                    e_offset, e_length, e_dtype, _ = table[base + suffix]
                    if e_dtype in ("int4", "uint4"):
                        values = pack_int4(values)
                    elif suffix == SCALE:
                        values = torch.from_numpy(values).to(e_dtype)
                    _write(out, e_offset, values, e_length, base + suffix)
                if task is not None:
                    task.advance(sum(table[base + s][1] for s in (QUANT, SCALE, ZERO) if base + s in table), 1)
                continue
            t = _tensor(reader, name.removeprefix(PREFIX), dtype, bufs, calibration).contiguous()
            if t.dtype != want_dtype or tuple(t.shape) != shape:
                raise AssertionError(f"{name}: wrote {t.dtype} {tuple(t.shape)}, planned {want_dtype} {shape}")
            _write(out, offset, t, length, name)
            del t
            if task is not None:
                task.advance(length, 1)
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


def weights_record(table: dict[str, tuple], graphs: dict[str, Path]) -> dict[str, WeightEntry]:
    """The table as the manifest records it, with the graphs (of `graphs`, name -> saved file) whose
    initializers include each tensor."""
    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8",
             torch.uint8: "uint8", "int4": "int4", "uint4": "uint4"}
    used = {g: set(external_initializers(onnx.load(str(p), load_external_data=False))) for g, p in graphs.items()}
    return {name: WeightEntry(o, n, names[d], list(shape), [g for g in graphs if name in used[g]])
            for name, (o, n, d, shape) in table.items()}


def external_tensor(name: str, entry: tuple, base_dir: Path):
    """The onnx_ir tensor of one entry of the weights file's table, read from the file on demand."""
    import onnx_ir as ir

    dtypes = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16,
              torch.bfloat16: ir.DataType.BFLOAT16, torch.int8: ir.DataType.INT8, torch.uint8: ir.DataType.UINT8,
              "int4": ir.DataType.INT4, "uint4": ir.DataType.UINT4}
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
