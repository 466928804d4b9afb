"""`tk triton ARTIFACT -o REPO`: a Triton Inference Server model repository that a stock
`tritonserver` serves.

    REPO/<name>/config.pbtxt       decoupled python model, the batcher's limits as parameters
    REPO/<name>/1/model.py         toolkit/serving/triton/model.py (hands requests to toolkit/serving/triton/backend.py)
    REPO/<name>/1/artifact/        with --copy-artifact (else the parameter points at ARTIFACT)
    REPO/<name>_prefill, _decode   with --native: the raw graphs for Triton's onnxruntime backend
    REPO/<name>_prefill_trt, ...   with --native and built engines: the plans for its tensorrt backend
                                   (their config says which TensorRT built them: a plan loads in no other)

Written without any Triton package (the text format is plain); the test parses every
config.pbtxt with Triton's own protobuf schema. Written into a temporary sibling folder and renamed,
so a failure leaves nothing behind; with `force`, an existing repository is renamed aside first and
deleted once the new one is in place, so it is replaced whole or not at all.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from tk.models.spec import contract
from tk.models.spec.engine import EngineMeta
from tk.models.spec.manifest import ArtifactError, Manifest
from tk.models.spec.errors import UsageProblem
from tk.runtimes.cache_layouts import slots_problem
from tk.runtimes.serving.scheduler import BatcherLimits
from tk.toolkit.folders import move_into_place

INPUTS = [  # (name, Triton type, dims): every one optional; toolkit/serving/triton/backend.py says what each does
    ("text_input", "TYPE_STRING", [1]), ("prompt_ids", "TYPE_INT64", [-1]), ("max_tokens", "TYPE_INT32", [1]),
    ("temperature", "TYPE_FP32", [1]), ("top_p", "TYPE_FP32", [1]), ("top_k", "TYPE_INT32", [1]),
    ("repetition_penalty", "TYPE_FP32", [1]), ("seed", "TYPE_INT64", [1]), ("stop", "TYPE_STRING", [-1]),
    ("ignore_eos", "TYPE_BOOL", [1]), ("stream", "TYPE_BOOL", [1]),
]
OUTPUTS = [("text_output", "TYPE_STRING", [-1]), ("token_ids", "TYPE_INT64", [-1]), ("finish_reason", "TYPE_STRING", [1])]


def _tensors(kind: str, specs, optional: bool) -> str:
    rows = [f'  {{ name: "{n}" data_type: {t} dims: {json.dumps(d)}{" optional: true" if optional else ""} }}'
            for n, t, d in specs]
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def _parameters(params: dict[str, str]) -> str:
    rows = [f"  {{ key: {json.dumps(k)} value: {{ string_value: {json.dumps(v)} }} }}" for k, v in params.items()]
    return "parameters [\n" + ",\n".join(rows) + "\n]\n"


def python_config(name: str, params: dict[str, str]) -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            "# decoupled: a request gets its tokens as separate responses (streaming), the last one FINAL\n"
            "model_transaction_policy { decoupled: true }\n"
            + _tensors("input", INPUTS, True) + _tensors("output", OUTPUTS, False)
            + "# one instance: its batcher batches every request itself (continuous batching)\n"
            "instance_group [ { count: 1 kind: KIND_CPU } ]\n" + _parameters(params))


def native_config(name: str, platform: str, comment: str = "") -> str:
    """The raw graph's model: Triton completes inputs and outputs from the ONNX file or plan."""
    return f'{comment}name: "{name}"\nplatform: "{platform}"\nmax_batch_size: 0\n'


def plan_note(meta: EngineMeta) -> str:
    """Which TensorRT (and so which Triton image) the plans need. No release table: NGC's Frameworks
    Support Matrix is where each Triton release's TensorRT is listed."""
    return (f"the plans were built with TensorRT {meta.tensorrt_version} for {meta.gpu.name} (compute capability "
            f"{meta.gpu.compute_capability}) and load only in that TensorRT on that GPU: serve them with the Triton "
            f"release whose TensorRT is {meta.tensorrt_version} (NGC's Frameworks Support Matrix lists each "
            "release's TensorRT), or rebuild them there with tk build-engine")


def tk_sys_path() -> list[str]:
    """Where tk and its packages are installed (site directories: an editable install's finder is a
    .pth file there): the stub process does not read PYTHONPATH."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]


def write_repository(artifact: Path, out: Path, *, name: str | None = None, backend: str = "ort",
                     limits: BatcherLimits = BatcherLimits(), threads: int | None = None, prepack: bool = True,
                     quant_compute: str = "int8", copy_artifact: bool = False, native: bool = False, sys_path: bool = True,
                     force: bool = False, progress: Callable[[str], None] = lambda m: None) -> Path:
    """The repository at `out` -> `out`. Its config records the limits' slots and max_queue (the
    model's batcher takes the other limits' defaults). With `native` and built engines, `progress`
    hears which TensorRT the plans need."""
    artifact, out = Path(artifact).resolve(), Path(out)
    manifest = Manifest.read(artifact)
    if problem := slots_problem(manifest.dims):
        raise UsageProblem(f"{artifact}: {problem}")
    name = name or artifact.name
    if not name.replace("_", "").replace("-", "").isalnum():
        raise UsageProblem(f"model name {name!r}: use letters, digits, '-' and '_' (Triton names folders by it)")
    if out.exists() and not force:
        raise UsageProblem(f"{out} exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tk-triton-", dir=out.parent))
    try:
        version = tmp / name / "1"
        version.mkdir(parents=True)
        shutil.copy2(Path(__file__).with_name("model.py"), version / "model.py")
        if copy_artifact:
            shutil.copytree(artifact, version / "artifact", ignore=shutil.ignore_patterns("*.engine", "engine.json"))
        params = {"artifact": "artifact" if copy_artifact else str(artifact), "backend": backend,
                  "slots": str(limits.slots), "max_queue": str(limits.max_queue), "threads": str(threads or ""),
                  "prepack": "1" if prepack else "0", "quant_compute": quant_compute,
                  "max_context": str(min(manifest.max_context, manifest.dims.kv_capacity)),
                  "tk_sys_path": json.dumps(tk_sys_path() if sys_path else [])}
        (tmp / name / "config.pbtxt").write_text(python_config(name, params))
        if native:
            _native(artifact, manifest, tmp, name, copy_artifact, progress)
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _native(artifact: Path, manifest: Manifest, repo: Path, name: str, copy: bool,
            progress: Callable[[str], None]) -> None:
    """The prefill and decode graphs (and engines, where built) as models of Triton's own backends."""
    place = shutil.copy2 if copy else (lambda src, dst: Path(dst).symlink_to(src))
    meta = None
    if any((artifact / f).is_file() for f in contract.ENGINE_FILES.values()):
        meta_path = artifact / contract.ENGINE_META
        if not meta_path.is_file():  # tk build-engine writes it last: a build did not finish
            raise ArtifactError(f"{artifact} has engines but no {contract.ENGINE_META}; rebuild them with: "
                                f"tk build-engine {artifact} --force")
        meta = EngineMeta.from_dict(json.loads(meta_path.read_text()))
        progress(plan_note(meta))
    data = {manifest.graphs[g].data_file for g in manifest.graphs if manifest.graphs[g].data_file}
    for graph in manifest.dims.graphs:  # (a hybrid's one: decode)
        version = repo / f"{name}_{graph}" / "1"
        version.mkdir(parents=True)
        place(artifact / manifest.graphs[graph].file, version / "model.onnx")
        for f in data:  # the graphs find their weights next to them
            place(artifact / f, version / f)
        (version.parent / "config.pbtxt").write_text(native_config(f"{name}_{graph}", "onnxruntime_onnx"))
        plan = artifact / contract.ENGINE_FILES[graph]
        if meta is not None and plan.is_file():
            version = repo / f"{name}_{graph}_trt" / "1"
            version.mkdir(parents=True)
            place(plan, version / "model.plan")
            comment = f"# tensorrt_version: {meta.tensorrt_version}\n# {plan_note(meta)}\n"
            (version.parent / "config.pbtxt").write_text(native_config(f"{name}_{graph}_trt", "tensorrt_plan", comment))
