"""`tk build-engine`: composing the TensorRT build layer (exporters/trt_build.py) with the
environment probe (runtimes/backends/trt.py), and writing engines atomically. Progress: the steps
check, build (one engine a graph, counted as each is built) and write."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from tk.exporters.trt_build import build_engines, check_precision, compute_profiles
from tk.models.spec import contract
from tk.models.spec.engine import EngineMeta, Limits
from tk.models.spec.manifest import ArtifactError, Manifest
from tk.models.spec.variant import Target
from tk.models.spec.errors import UsageProblem, FilesystemProblem
from tk.toolkit.progress import Progress


def build(artifact: Path, *, precision: str | None, max_batch: int, max_input_len: int | None,
          max_seq_len: int | None, timing_cache: Path | None, workspace: float | None, force: bool,
          progress: Progress | Callable[[str], None], decomposable_attention: bool = False,
          verbose: bool = False) -> EngineMeta:
    """Unset lengths default to the model's context (at most 2048) and half of it for prompts; an
    unset workspace is TensorRT's own default."""
    progress = Progress.of(progress)
    progress.step("check")
    manifest = Manifest.read(artifact)
    if manifest.variant.target is not Target.PORTABLE:
        raise ArtifactError(f"{artifact} was exported with --target {manifest.variant.target.value} (ONNX Runtime's "
                            "own fused kernels), which TensorRT cannot parse; export with --target portable for "
                            "TensorRT")
    if manifest.dims.stateful:
        raise ArtifactError(f"{artifact}: {manifest.config.architecture}'s recurrent layers carry a state that TensorRT "
                            "would return as a new buffer every run, and tk's TensorRT runtime updates its caches in "
                            "place only (tk inspect shows the lint); run it with --backend ort or torch")
    quant = [p for p in manifest.trt_lint.get("problems", []) if p["rule"] in ("int4-block", "int8-weights", "quant-zero-points")]
    if quant:
        raise UsageProblem(f"{artifact}: {quant[0]['message']}")
    max_seq_len = max_seq_len or manifest.variant.capacity or min(manifest.max_context, 2048)
    limits = Limits(max_batch, max_input_len or max(1, max_seq_len // 2), max_seq_len)
    compute_profiles(manifest.dims, limits, manifest.max_context)  # the flags are checked first
    precision = check_precision(manifest, precision)
    if workspace is not None and not workspace > 0:
        raise UsageProblem(f"--workspace must be a positive number of GiB, got {workspace}")
    meta_path = artifact / contract.ENGINE_META
    if meta_path.exists() and not force:
        raise FilesystemProblem(f"{artifact} already has engines; pass --force to rebuild them")
    from tk.runtimes.backends.trt import trt_environment

    env = trt_environment()  # says what is missing (TensorRT, a GPU) before any work
    progress.step("build")
    with progress.task("build", len(contract.GRAPHS), "engines") as task:
        def note(msg: str) -> None:  # trt_build says "built NAME.engine (N MiB)" as each engine is done
            progress(msg)
            task.advance(int(msg.startswith("built ")))
        meta, engines = build_engines(artifact, manifest, env, precision, limits, workspace_gib=workspace,
                                      timing_cache=timing_cache, decomposable=decomposable_attention, verbose=verbose,
                                      progress=note)
    progress.step("write")
    # engine.json goes first and comes back last: while the engines are replaced, none of them loads,
    # and each engine's sha256 in it refuses a pair that was not built together
    meta_path.unlink(missing_ok=True)
    written = []
    try:  # each file lands whole (temp + rename)
        for graph, blob in engines.items():
            fd, tmp = tempfile.mkstemp(dir=artifact, prefix=".engine-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            written.append(tmp)
            os.replace(tmp, artifact / contract.ENGINE_FILES[graph])
        (artifact / f".{contract.ENGINE_META}.tmp").write_text(json.dumps(meta.to_dict(), indent=2))
        os.replace(artifact / f".{contract.ENGINE_META}.tmp", meta_path)
    finally:
        for tmp in written:
            Path(tmp).unlink(missing_ok=True)
    return meta
