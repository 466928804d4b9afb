"""What tk's graph checks share about ONNX itself: which domain is the default one, a graph's
opset, and the control-flow ops no tk graph has. Works on ONNX protos and onnx_ir alike by their
fields; imports nothing.
"""

from __future__ import annotations

DEFAULT_DOMAINS = ("", "ai.onnx")  # ONNX spells its own domain either way
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops
# No tk graph has control flow: the decoders are straight-line, and TensorRT fails on control flow in
# decoders (NVIDIA/TensorRT #4032, #4739).
CONTROL_FLOW = ("If", "Loop", "Scan")


def is_default_domain(domain: str) -> bool:
    return domain in DEFAULT_DOMAINS


def opset_of(model) -> int:
    """The default domain's opset of an `onnx.ModelProto` (0: it declares none)."""
    return next((o.version for o in model.opset_import if is_default_domain(o.domain)), 0)
