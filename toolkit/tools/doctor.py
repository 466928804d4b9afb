"""`tk doctor`: which backends, providers, GPUs and library versions this machine has."""

from __future__ import annotations

import platform

from tk.models.spec.manifest import ArtifactError
from tk.runtimes.base import BackendUnavailable
from tk.toolkit.backends import BACKENDS
from tk.toolkit.versions import package_version


def doctor_report() -> dict:
    report = {"python": {"available": True, "version": platform.python_version(), "platform": platform.platform()},
              "tk": {"available": True, "version": package_version("tk") or "source"}}
    try:
        import torch

        cuda = torch.cuda.is_available()
        report["torch"] = {"available": True, "version": torch.__version__, "cuda": cuda,
                           "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                           if cuda else []}
    except ImportError:
        report["torch"] = {"available": False, "hint": "pip install torch"}
    try:
        import onnxruntime as ort

        report["onnxruntime"] = {"available": True, "version": ort.__version__,
                                 "providers": ort.get_available_providers()}
    except ImportError:
        report["onnxruntime"] = {"available": False, "hint": "pip install onnxruntime"}
    try:
        from tk.runtimes.backends.trt import trt_environment

        env = trt_environment()
        report["tensorrt"] = {"available": True, "version": env["tensorrt_version"], "gpu": env["gpu_name"],
                              "compute_capability": env["compute_capability"]}
    except (BackendUnavailable, ArtifactError) as e:
        report["tensorrt"] = {"available": False, "version": package_version("tensorrt"), "reason": str(e)}
    polygraphy = package_version("polygraphy")
    report["polygraphy"] = {"available": polygraphy is not None, "version": polygraphy}
    report["backends"] = {"available": True, "version": ", ".join(BACKENDS)}
    return report
