"""Traced graphs kept on disk and reused, for whoever exports the same graphs many times (tk's test
suite sets it for every test and the tk commands they start): `TK_TRACE_CACHE=DIR`.

A graph is traced on the meta device (exporters/onnx_export.py): no weight takes part, so the traced
graph is a function of the decoder's config (less its token ids), the view's dtype, which graph, the
contract's dims, the variant, the code that builds and traces the model (every module of models/ and
exporters/) and the versions of torch, onnxscript and onnx_ir. That is the key. Its initializers
(meta tensors, no data) are stored as placeholders; finishing the graph points every one of them
into the artifact's weights file, as it does for a fresh trace. Unset, nothing is read or written.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from importlib import metadata
from pathlib import Path

ENV = "TK_TRACE_CACHE"
_ROOT = Path(__file__).resolve().parents[1]
_PLACEHOLDER = "__traced_on_meta__"


@functools.cache
def _code_fingerprint() -> str:
    """The code that decides a traced graph, and the libraries that trace it."""
    h = hashlib.sha256()
    for folder in ("models", "exporters"):
        for path in sorted((_ROOT / folder).rglob("*.py")):
            h.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes())
    for lib in ("torch", "onnxscript", "onnx-ir", "onnx"):
        try:
            h.update(f"{lib}={metadata.version(lib)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib}=none".encode())
    return h.hexdigest()


# the config's token ids: what generation stops at, starts with and pads with, which no graph reads (a
# chat checkpoint's extra stop token shares its base's traces)
_UNTRACED = {"eos_token_ids": [], "bos_token_id": None, "pad_token_id": None}


def _key(model, graph: str, dims) -> str:
    dtype = next(model.parameters()).dtype
    config = dataclasses.replace(model.config, **_UNTRACED)
    text = "\n".join((_code_fingerprint(), repr(config), str(dtype), graph, repr(dims)))
    return hashlib.sha256(text.encode()).hexdigest()


def _serialize(ir_model) -> bytes:
    """The traced model as ONNX bytes, each meta initializer (a weight) a placeholder of its dtype and shape."""
    import onnx_ir as ir

    kept = {}
    try:
        for name, value in ir_model.graph.initializers.items():
            if not getattr(getattr(value.const_value, "raw", None), "is_meta", False):
                continue  # a constant the trace made (real data): stored as it is
            kept[name] = value.const_value
            nbytes = value.dtype.itemsize * math.prod(value.shape.numpy())
            value.const_value = ir.ExternalTensor(_PLACEHOLDER, offset=0, length=int(nbytes), dtype=value.dtype,
                                                  shape=value.shape, name=name, base_dir="")
        return ir.to_proto(ir_model).SerializeToString()
    finally:
        for name, tensor in kept.items():
            ir_model.graph.initializers[name].const_value = tensor


def _names(ir_model) -> dict:
    """The graph's name authority: the optimizer names the nodes and values it makes from its
    counters, so a graph read back continues them where the trace left them."""
    auth = ir_model.graph._name_authority  # onnx_ir has no public face for it
    return {"values": auth._value_counter, "nodes": auth._node_counter,
            "value_names": sorted(auth._value_names), "node_names": sorted(auth._node_names)}


def _deserialize(data: bytes, names: dict):
    import onnx
    import onnx_ir as ir
    import torch

    model = ir.from_proto(onnx.load_from_string(data))
    auth = model.graph._name_authority
    auth._value_counter, auth._node_counter = names["values"], names["nodes"]
    auth._value_names |= set(names["value_names"])
    auth._node_names |= set(names["node_names"])
    return torch.onnx.ONNXProgram(model, None)


def cached(trace):
    """Wrap `trace(model, graph, dims) -> ONNXProgram` with the cache `TK_TRACE_CACHE` names.
    Miss or hit, the caller gets the graph as read back from its bytes, so both export the same file."""
    @functools.wraps(trace)
    def wrapper(model, graph: str, dims):
        folder = os.environ.get(ENV)
        if not folder:
            return trace(model, graph, dims)
        path = Path(folder) / f"{_key(model, graph, dims)}.onnx"
        names_path = path.with_suffix(".names.json")
        if path.is_file():  # written last: its names are there
            return _deserialize(path.read_bytes(), json.loads(names_path.read_text()))
        program = trace(model, graph, dims)
        data, names = _serialize(program.model), _names(program.model)
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, content in ((names_path, json.dumps(names).encode()), (path, data)):
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            tmp.write_bytes(content)
            os.replace(tmp, target)  # whole or absent: another process may be writing the same key
        return _deserialize(data, names)
    return wrapper
