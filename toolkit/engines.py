"""`tk build-engine` and `tk doctor`: composing the TensorRT build layer (exporters/trt_build.py)
with the environment probe (runtimes/trt_runtime.py), and writing engines atomically."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable

from exporters.trt_build import Limits, build_engines, compute_profiles
from models import contract
from runtimes.base import ArtifactError, BackendUnavailable, dims_from_manifest, read_manifest


def build(artifact: Path, precision: str | None, max_batch: int, max_input_len: int | None, max_seq_len: int | None,
          timing_cache: Path | None, workspace: float, force: bool, progress: Callable[[str], None]) -> dict:
    """Unset lengths default to the model's context (at most 2048) and half of it for prompts."""
    manifest = read_manifest(artifact)
    if manifest.get("target", "portable") != "portable":
        raise ArtifactError(f"{artifact} was exported with --target {manifest['target']} (ONNX Runtime's own fused "
                            "kernels), which TensorRT cannot parse; export with --target portable for TensorRT")
    capacity = manifest["dims"].get("kv_capacity")
    max_seq_len = max_seq_len or capacity or min(manifest["config"]["max_position_embeddings"], 2048)
    limits = Limits(max_batch, max_input_len or max(1, max_seq_len // 2), max_seq_len)
    compute_profiles(dims_from_manifest(manifest), limits, manifest["config"]["max_position_embeddings"])  # flags first
    if (artifact / contract.ENGINE_META).exists() and not force:
        raise FileExistsError(f"{artifact} already has engines; pass --force to rebuild them")
    from runtimes.trt_runtime import trt_environment

    env = trt_environment()  # says what is missing (TensorRT, a GPU) before any work
    meta, engines = build_engines(artifact, manifest, env, precision, limits, workspace, timing_cache, progress)
    written = []
    try:  # each file lands whole (temp + rename); engine.json last, so a half build is never loadable
        for graph, blob in engines.items():
            fd, tmp = tempfile.mkstemp(dir=artifact, prefix=".engine-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            written.append(tmp)
            os.replace(tmp, artifact / contract.ENGINE_FILES[graph])
        (artifact / f".{contract.ENGINE_META}.tmp").write_text(json.dumps(meta, indent=2))
        os.replace(artifact / f".{contract.ENGINE_META}.tmp", artifact / contract.ENGINE_META)
    finally:
        for tmp in written:
            Path(tmp).unlink(missing_ok=True)
    return meta


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def doctor_report() -> dict:
    report = {"python": {"available": True, "version": platform.python_version(), "platform": platform.platform()},
              "tk": {"available": True, "version": _version("tk") or "source"}}
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
        from runtimes.trt_runtime import trt_environment

        env = trt_environment()
        report["tensorrt"] = {"available": True, "version": env["tensorrt_version"], "gpu": env["gpu_name"],
                              "compute_capability": env["compute_capability"]}
    except (BackendUnavailable, ArtifactError) as e:
        report["tensorrt"] = {"available": False, "version": _version("tensorrt"), "reason": str(e)}
    report["polygraphy"] = {"available": _version("polygraphy") is not None, "version": _version("polygraphy")}
    return report
