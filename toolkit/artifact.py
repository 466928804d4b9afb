"""`tk export` as a library call: load, export both graphs, check the contract, validate with the
parity core, write the manifest, and only then move the folder into place.

Everything is written to a temporary folder beside OUT; any failure removes it, so OUT either
does not exist or holds a complete, validated artifact.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import platform
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

import onnx

from exporters.contract_check import check_graph_file
from exporters.onnx_export import CONTRIB_OPS, DEFAULT_OPSET, MAX_OPSET, MIN_OPSET, TARGETS, export_graph, graph_dims
from exporters.trt_lint import lint_graphs
from models import contract
from models.config import canonical_dtype
from models.contract import sha256_file
from models.loading import load_decoder, read_config
from runtimes.base import ArtifactError, read_manifest
from runtimes.ort_runtime import open_ort
from runtimes.torch_runtime import TorchRuntime
from toolkit.parity import Comparison, format_table, random_cases, tolerance_for
from toolkit.parity_report import compare_backends, describe_divergence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
VALIDATION_STEPS = 8
KV_CACHES = ("dynamic", "static")
PREFILL_LOGITS = ("all", "last")


class ValidationFailed(Exception):
    """A check ran and the artifact failed it (exit 3). `table` says what differed."""

    def __init__(self, message: str, table: str = ""):
        super().__init__(message)
        self.table = table


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("tk", "torch", "onnx", "onnxscript", "onnxruntime", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _check_options(dtype: str, opset: int, kv_cache: str, max_seq_len: int | None, target: str,
                   prefill_logits: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    if prefill_logits not in PREFILL_LOGITS:
        raise ValueError(f"unknown prefill logits {prefill_logits!r}; use one of {', '.join(PREFILL_LOGITS)}")
    if kv_cache not in KV_CACHES:
        raise ValueError(f"unknown kv cache {kv_cache!r}; use one of {', '.join(KV_CACHES)}")
    if kv_cache == "static" and (max_seq_len is None or max_seq_len < 2):
        raise ValueError("--kv-cache static needs --max-seq-len N (N >= 2): the capacity of the cache")
    if kv_cache == "dynamic" and max_seq_len is not None:
        raise ValueError("--max-seq-len sets the capacity of a static cache; add --kv-cache static")
    dtype = canonical_dtype(dtype)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset {opset} is not supported; use {MIN_OPSET}..{MAX_OPSET} (default {DEFAULT_OPSET})")
    return dtype


def _ort_has_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def _prepare_out(out: Path, force: bool) -> tuple[Path, Path | None]:
    """Refuse an existing OUT without force; create OUT's missing parent folders; return a fresh
    temporary folder beside OUT and the top-most folder this created (None when all existed), so
    that a failed export can remove everything it made."""
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    parent = out.absolute().parent
    missing = [p for p in (parent, *parent.parents) if not p.exists()]
    created = missing[-1] if missing else None
    base = created.parent if created else parent
    if not base.is_dir():
        raise FileNotFoundError(f"cannot write {out}: {base} is not a folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent)), created
    except OSError as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise PermissionError(f"cannot write to {base} ({e.strerror}); choose a writable -o") from None


def _move_into_place(tmp: Path, out: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp made it private; the artifact gets the user's usual permissions
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def reference_runtime(artifact: Path, manifest: dict | None = None, dtype: str = "float32",
                      device: str = "cpu", debug: bool = False) -> TorchRuntime:
    """The PyTorch backend for an artifact: the reference decoder loaded from the source checkpoint
    recorded in its manifest (tk does not copy the weights a second time)."""
    manifest = manifest or read_manifest(artifact)
    source = Path(manifest["source"]["path"])
    if not (source / "config.json").is_file():
        raise ArtifactError(f"the torch backend loads the source checkpoint {source} recorded in the manifest, "
                            "and it is gone; restore it or re-export from its new place")
    if sha256_file(source / "config.json") != manifest["source"]["config_sha256"]:
        raise ArtifactError(f"the checkpoint at {source} changed since export (config.json differs); re-export")
    return TorchRuntime(load_decoder(source, dtype), device=device, debug=debug)


def validate(artifact: Path, manifest: dict, steps: int = VALIDATION_STEPS) -> tuple[dict, str, str | None]:
    """Export validation: ORT on the artifact vs the float32 PyTorch reference, through the parity
    engine without its probes. Returns the manifest record, a printable table, and where ORT first
    left its tolerance (None when it passed)."""
    tol = tolerance_for(manifest["dtype"], manifest["config"])
    debug = manifest["dims"].get("hidden_size") is not None  # a debug export: localize to the layer output
    with reference_runtime(artifact, manifest, debug=debug) as ref, open_ort(artifact) as ort:
        report = compare_backends(ref, {"ort": ort}, random_cases(ref.dims.vocab_size), tol, steps, probes=False,
                                  free_running=False)
    entry = report["backends"]["ort"]
    record = {"passed": report["passed"], "reference": "torch float32", "steps": steps,
              "tolerance": dataclasses.asdict(tol), "comparisons": entry["cases"],
              "first_divergence": entry["first_divergence"]}
    table = format_table([Comparison.from_dict(c) for c in entry["cases"]])
    where = describe_divergence("ort", entry["first_divergence"]) if entry["first_divergence"] else None
    return record, table, where


def export_artifact(model_dir: str | Path, out: str | Path, dtype: str = "fp32", opset: int = DEFAULT_OPSET,
                    run_validation: bool = True, force: bool = False,
                    progress: Callable[[str], None] = lambda msg: None, kv_cache: str = "dynamic",
                    max_seq_len: int | None = None, debug_outputs: bool = False, target: str = "portable",
                    prefill_logits: str = "all") -> dict:
    """Write a complete artifact to `out` and return its manifest.

    kv_cache "static" exports the decode graph with a cache of capacity `max_seq_len`, updated in
    place (opset 24 TensorScatter); the prefill graph is the ordinary one. debug_outputs adds each
    layer's hidden state as outputs (hidden.{i}), so tk parity can name the exact layer. target "ort"
    uses ONNX Runtime's fused kernels (same inputs and outputs; ONNX Runtime only, no TensorRT).
    prefill_logits "last" has prefill return the last position's logits only (faster first token).
    """
    model_dir, out = Path(model_dir), Path(out)
    dtype = _check_options(dtype, opset, kv_cache, max_seq_len, target, prefill_logits)
    if debug_outputs and (kv_cache == "static" or target != "portable"):
        raise ValueError("--debug-outputs works with the dynamic cache and the portable target; drop --kv-cache "
                         "static and --target for a debug export")
    config = read_config(model_dir)  # fail on a bad checkpoint before touching the filesystem
    if max_seq_len is not None and max_seq_len > config.max_position_embeddings:
        raise ValueError(f"--max-seq-len ({max_seq_len}) is beyond the model's context of "
                         f"{config.max_position_embeddings}")
    if run_validation and dtype == "bfloat16" and not _ort_has_cuda():
        raise ValueError("bf16 graphs cannot be validated here: ONNX Runtime's CPU provider has no bf16 MatMul; "
                         "export with --no-validate and check on a GPU (tk parity), or use --dtype fp16")
    tmp, created = _prepare_out(out, force)
    try:
        t = time.perf_counter()
        model = load_decoder(model_dir, dtype)
        progress(f"load {model_dir} ({dtype}): {time.perf_counter() - t:.1f} s")
        dims = graph_dims(model, dtype, max_seq_len if kv_cache == "static" else None, debug_outputs, prefill_logits)
        graphs = {}
        for graph in contract.GRAPHS:
            path = tmp / contract.GRAPH_FILES[graph]
            seconds = export_graph(model, graph, path, dims, opset, target)
            check_graph_file(path, graph, dims, CONTRIB_OPS[target])
            data = path.with_name(path.name + ".data")
            graphs[graph] = {"file": path.name, "sha256": sha256_file(path),
                             "data_file": data.name if data.exists() else None,
                             "data_bytes": data.stat().st_size if data.exists() else 0,
                             "opset": onnx_opset(path), "export_s": round(seconds, 2)}
            cache = f", static cache of {dims.kv_capacity}" if graph == contract.DECODE and dims.kv_capacity else ""
            fused = ", ONNX Runtime fused kernels" if target == "ort" else ""
            progress(f"export {graph}{cache}{fused}: {seconds:.1f} s, contract ok")
        del model
        lint = lint_graphs({g: onnx.load(str(tmp / contract.GRAPH_FILES[g]), load_external_data=False)
                            for g in contract.GRAPHS})
        progress(f"TensorRT lint: {'ok' if lint.ok else f'{len(lint.problems)} problem(s)'}, needs TensorRT "
                 f">= {lint.min_tensorrt}")
        copied = [f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
        for f in copied:
            shutil.copy2(model_dir / f, tmp / f)
        manifest = {
            "contract_version": contract.CONTRACT_VERSION,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "source": {"path": str(model_dir.resolve()), "config_sha256": sha256_file(model_dir / "config.json")},
            "config": config.to_dict(),
            "dims": dataclasses.asdict(dims),
            "dtype": dtype,
            "opset": opset,  # asked for; each graph records its own (a static decode graph needs 24)
            "kv_cache": kv_cache,
            "target": target,
            "graphs": graphs,
            "tokenizer_files": copied,
            "versions": versions(),
            "trt_lint": lint.to_dict(),
            "validation": {"skipped": True},
        }
        _write_manifest(tmp, manifest)
        if run_validation:
            t = time.perf_counter()
            manifest["validation"], table, where = validate(tmp, manifest)
            _write_manifest(tmp, manifest)
            verdict = "passed" if manifest["validation"]["passed"] else "FAILED"
            progress(f"validate ORT vs torch float32 ({VALIDATION_STEPS} decode steps): {verdict}, "
                     f"{time.perf_counter() - t:.1f} s")
            if not manifest["validation"]["passed"]:
                raise ValidationFailed(f"export validation failed: {where or 'ort failed its ' + dtype + ' tolerance'}",
                                       table)
        _move_into_place(tmp, out)
        return manifest
    except BaseException:
        shutil.rmtree(created or tmp, ignore_errors=True)
        raise


def onnx_opset(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _write_manifest(folder: Path, manifest: dict) -> None:
    (folder / contract.MANIFEST).write_text(json.dumps(manifest, indent=2))
