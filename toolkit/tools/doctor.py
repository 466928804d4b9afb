"""`tk doctor`: which backends, providers, GPUs and library versions this machine has, and whether
TensorRT's wheels, cuda-python and the driver fit one another (a CUDA 13 wheel on a CUDA 12 driver
fails only when the first engine loads)."""

from __future__ import annotations

import platform

from tk.models.spec.engine import release
from tk.models.spec.manifest import ArtifactError
from tk.runtimes.base import BackendUnavailable
from tk.toolkit.backends import BACKENDS
from tk.toolkit.versions import package_version

TRT_OLDEST, TRT_MAJORS = (10, 15), (10, 11)  # what tk's TensorRT code is written and checked for (>=10.15,<12)
# the driver each wheel's CUDA major needs (NVIDIA's CUDA release notes: minor-version compatibility)
DRIVER_FOR = {12: "R525 or newer", 13: "R580 or newer"}
# cuda-python per CUDA major (cuda.bindings, which tk imports, is in 12.x from 12.8 on)
CUDA_PYTHON_FOR = {12: "cuda-python>=12.8,<13", 13: "cuda-python>=13,<14"}


def tensorrt_wheel() -> tuple[str | None, int | None]:
    """(version, CUDA major) of the installed TensorRT wheels: `tensorrt-cu13`/`-cu12` and their
    `-libs`/`-bindings` name the CUDA major; a bare `tensorrt` (a container's, a tarball's) does not."""
    for cuda in (13, 12):
        for part in ("", "-libs", "-bindings"):
            version = package_version(f"tensorrt-cu{cuda}{part}")
            if version:
                return version, cuda
    return package_version("tensorrt"), None


def _major(version: str | None) -> int | None:
    return (release(version) or (None,))[0]


def fit_problems(trt_version: str | None, wheel_cuda: int | None, driver: tuple[int, int] | None,
                 cuda_python: str | None) -> list[str]:
    """Why TensorRT, its wheels' CUDA, cuda-python and the driver do not fit, each with the fix."""
    problems = []
    trt_major, cp_major = _major(trt_version), _major(cuda_python)
    if trt_major is not None and (trt_major not in TRT_MAJORS or release(trt_version)[:2] < TRT_OLDEST):
        problems.append(f"TensorRT {trt_version} is not one tk knows (10.15 or newer, 10.x or 11.x): "
                        "pip install 'tensorrt>=10.15,<12'")
    shown = "none found" if driver is None else f"CUDA {driver[0]}.{driver[1]}"
    if wheel_cuda is not None and driver is not None and driver < (wheel_cuda, 0):
        other = f"; or, on this driver, pip install tensorrt-cu12 '{CUDA_PYTHON_FOR[12]}'" if wheel_cuda > 12 else ""
        problems.append(f"TensorRT {trt_version}'s wheels are built for CUDA {wheel_cuda}, which needs a driver for "
                        f"CUDA {wheel_cuda}.0 or newer ({DRIVER_FOR.get(wheel_cuda, 'a newer one')}); this driver "
                        f"supports {shown}: update the driver{other}")
    if cp_major is not None and driver is not None and driver < (cp_major, 0):
        problems.append(f"cuda-python {cuda_python} needs a driver for CUDA {cp_major}.0 or newer; this driver "
                        f"supports {shown}: pip install '{CUDA_PYTHON_FOR.get(driver[0], 'cuda-python<' + str(cp_major))}'"
                        " or update the driver")
    if cp_major is not None and wheel_cuda is not None and cp_major != wheel_cuda:
        problems.append(f"cuda-python {cuda_python} is for CUDA {cp_major} and TensorRT's wheels for CUDA "
                        f"{wheel_cuda}: pip install '{CUDA_PYTHON_FOR.get(wheel_cuda, 'cuda-python')}'")
    return problems


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

        from tk.runtimes.backends.ort_probes import integer_gemm_saturates, one_row_apart

        # what its CPU kernels compute here (runtimes/backends/ort_probes.py): a W8A8 head's, and whether an int4
        # export's lone row computes as it does among others (if not, tk runs none alone: Runs.paired)
        report["onnxruntime"] = {"available": True, "version": ort.__version__,
                                 "providers": ort.get_available_providers(),
                                 "w8a8_head": ("exact (7-bit weights; a full-range 8-bit one of an older tk: wrong "
                                               "here, no VNNI or AMX)" if integer_gemm_saturates() else "exact"),
                                 "int8_compute_rows": ("a lone row apart (~1e-6): tk runs none alone"
                                                       if one_row_apart() else "bit for bit")}
    except ImportError:
        report["onnxruntime"] = {"available": False, "hint": "pip install onnxruntime"}
    from tk.runtimes.backends.cuda import driver_cuda_version

    driver, cuda_python = driver_cuda_version(), package_version("cuda-python") or package_version("cuda-bindings")
    report["cuda_driver"] = {"available": driver is not None, "version": f"{driver[0]}.{driver[1]}" if driver else None,
                      "cuda_python": cuda_python}  # version: the newest CUDA the driver supports
    wheel_version, wheel_cuda = tensorrt_wheel()
    try:
        from tk.runtimes.backends.trt import trt_environment

        env = trt_environment()
        report["tensorrt"] = {"available": True, "version": env["tensorrt_version"], "gpu": env["gpu_name"],
                              "compute_capability": env["compute_capability"]}
    except (BackendUnavailable, ArtifactError) as e:
        report["tensorrt"] = {"available": False, "version": package_version("tensorrt") or wheel_version,
                              "reason": str(e)}
    version = report["tensorrt"]["version"]
    report["tensorrt"].update(major=_major(version), wheel_cuda=wheel_cuda)
    problems = fit_problems(version, wheel_cuda, driver, cuda_python)
    if problems:
        report["tensorrt"]["problems"] = problems
    polygraphy = package_version("polygraphy")
    report["polygraphy"] = {"available": polygraphy is not None, "version": polygraphy}
    report["backends"] = {"available": True, "version": ", ".join(BACKENDS)}
    return report
