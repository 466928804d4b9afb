"""The one dtype table: every place that names, sizes or converts a dtype reads it. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

from tk.models.spec.errors import UsageProblem


@dataclass(frozen=True)
class DType:
    name: str  # canonical, numpy/torch spelling: "float32"
    short: str  # the CLI's spelling: "fp32"
    bytes: float  # per element
    numpy: str | None  # numpy's name (None: numpy has no such type)
    ort: str  # ONNX Runtime's type string (NodeArg.type)
    onnx: int  # onnx.TensorProto.DataType


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", "fp32", 4, "float32", "tensor(float)", 1),
    DType("float16", "fp16", 2, "float16", "tensor(float16)", 10),
    DType("bfloat16", "bf16", 2, None, "tensor(bfloat16)", 16),
    DType("int64", "int64", 8, "int64", "tensor(int64)", 7),
    DType("int32", "int32", 4, "int32", "tensor(int32)", 6),
)}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # what activations and the KV cache may be
DTYPE_CHOICES = tuple(s for d in FLOAT_DTYPES for s in (DTYPES[d].short, d))  # the CLI's --dtype values
BY_ORT = {d.ort: d.name for d in DTYPES.values()}


def canonical_dtype(name: str) -> str:
    """"fp16" -> "float16"; a one-line usage error for anything that is not an activation dtype."""
    for d in FLOAT_DTYPES:
        if name in (d, DTYPES[d].short):
            return d
    raise UsageProblem(f"unknown dtype {name!r}; use one of fp32, fp16, bf16")
