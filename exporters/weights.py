"""One weights file for both graphs: prefill and decode hold the same weights, so the artifact
stores them once.

The exporter writes each graph with its own external data (`prefill.onnx.data`,
`decode.onnx.data`), and names the same tensor differently in each (a folded transpose is
`val_78` in one, `val_72` in the other). `share_weights` reads every external tensor of both
graphs, one at a time through a memory map, writes each distinct tensor once into
`weights.onnx.data` at a page-aligned offset (ONNX Runtime memory-maps aligned external data),
and points both graphs' initializers at it (ONNX external data: `location`, `offset`,
`length`). Memory stays at one tensor; the per-graph files are removed.
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo

WEIGHTS_FILE = "weights.onnx.data"
ALIGN = 4096  # a page: ONNX Runtime maps page-aligned external data instead of reading it


def _external(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def share_weights(folder: Path, graph_files: list[str]) -> tuple[str, int]:
    """Rewrite the graphs in `folder` to share one external-data file; returns (its name, its bytes)."""
    folder = Path(folder)
    models = {f: onnx.load(str(folder / f), load_external_data=False) for f in graph_files}
    written: dict[tuple, tuple[int, int]] = {}  # (digest, length) -> (offset, length)
    sources: dict[str, tuple] = {}
    out_path = folder / WEIGHTS_FILE
    with open(out_path, "wb") as out:
        for f, model in models.items():
            for tensor in _external(model):
                info = ExternalDataInfo(tensor)
                src = folder / info.location
                if src not in sources:
                    fh = open(src, "rb")
                    sources[src] = (fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if src.stat().st_size else b"")
                view = memoryview(sources[src][1])[info.offset : info.offset + info.length]
                key = (hashlib.blake2b(view, digest_size=16).digest(), info.length, tensor.data_type,
                       tuple(tensor.dims))
                if key not in written:
                    pad = -out.tell() % ALIGN
                    out.write(b"\0" * pad)
                    written[key] = (out.tell(), info.length)
                    out.write(view)
                view.release()
                _point(tensor, *written[key])
        size = out.tell()
    for fh, mm in sources.values():
        if mm:
            mm.close()
        fh.close()
    for f, model in models.items():
        onnx.save(model, str(folder / f))
    for src in sources:
        if src.name != WEIGHTS_FILE:
            src.unlink()
    return WEIGHTS_FILE, size


def _point(tensor: onnx.TensorProto, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def external_initializers(model: onnx.ModelProto) -> dict[str, tuple[int, int, int, tuple[int, ...]]]:
    """name -> (offset, length, onnx data type, dims) of every initializer stored in the weights file."""
    out = {}
    for tensor in _external(model):
        info = ExternalDataInfo(tensor)
        out[tensor.name] = (info.offset, info.length, tensor.data_type, tuple(tensor.dims))
    return out
