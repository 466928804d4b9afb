"""The backends tk can run an artifact on: one registry, read by the CLI's choices, `tk doctor`,
`tk bench` and `tk parity`. A new backend is one module (a `tk.runtimes.base.Runtime`) and one
`register(...)` line. Opening a backend is cheap: runtimes load on activation. Nothing heavy is
imported here until a backend is opened.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tk.models.spec.manifest import ArtifactError, Manifest, sha256_file


PROVIDERS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class BackendOptions:
    threads: int | None = None  # ONNX Runtime intra-op threads
    device: str = "auto"  # torch: auto | cpu | cuda
    provider: str = "auto"  # ONNX Runtime: auto | cpu | cuda
    prepack: bool | None = None  # ONNX Runtime: each session repacks its weights (faster, a copy per session);
    # None: not asked, so off, except where decode runs take several tokens (for_runs)
    quant_compute: str = "int8"  # ONNX Runtime, quantized artifacts: int8 (fast) or float (what the reference computes)
    static_cache: bool = False  # torch: keep the artifact's static cache (serving's slots), not the plain graphs' math
    arena: bool = True  # ONNX Runtime: its CPU memory arena (a server runs without: it grows with the shapes seen)

    def for_runs(self, backend: str) -> "BackendOptions":
        """Options for decode runs of several tokens a row (speculation's verify runs, a draft's
        catch-up) or of several rows (a server's batches), on `backend`: the one place of the rule.
        ONNX Runtime prepacks unless declined: its MatMul over unpacked float weights packs them again
        every run of more than one row (on the 0.5B fp32 checkpoint a 9-token run took 343 ms unpacked
        and 205 ms packed; one token: 123 and 120; examples/bench_verify.py). The torch reference keeps
        the artifact's static cache, whose write indices a verify run and a rewind move."""
        prepack = self.prepack if self.prepack is not None else True
        return dataclasses.replace(self, prepack=prepack, static_cache=self.static_cache or backend == "torch")


@dataclass(frozen=True)
class Backend:
    name: str
    open: Callable  # (artifact: Path, manifest: Manifest, options: BackendOptions) -> Runtime
    summary: str


BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    BACKENDS[backend.name] = backend


def open_runtime(artifact: str | Path, name: str, options: BackendOptions = BackendOptions()):
    """A runtime for backend `name` over the artifact (not yet activated)."""
    artifact = Path(artifact)
    return BACKENDS[name].open(artifact, Manifest.read(artifact), options)


def reference_runtime(artifact: str | Path, manifest: Manifest | None = None, dtype: str = "float32",
                      device: str = "cpu", debug: bool = False, quantized: bool = True, static_cache: bool = False):
    """The PyTorch backend for an artifact: the reference decoder, loaded on activation from the source
    checkpoint recorded in its manifest (tk does not copy the weights a second time). For a quantized
    artifact, the quantized reference, unless `quantized` is False (the full-precision one)."""
    manifest = manifest or Manifest.read(artifact)
    source = Path(manifest.source.path)
    if not (source / "config.json").is_file():
        raise ArtifactError(f"the torch backend loads the source checkpoint {source} recorded in the manifest, "
                            "and it is gone; restore it or re-export from its new place")
    if sha256_file(source / "config.json") != manifest.source.config_sha256:
        raise ArtifactError(f"the checkpoint at {source} changed since export (config.json differs); re-export")
    quantized = manifest.precision if manifest.precision.quantized and quantized else None
    calibration = None
    if quantized is not None and quantized.calibration:
        from tk.models.quant.calibration import load

        calibration = load(Path(artifact))
    return torch_reference(source, manifest.dims, manifest.max_context, dtype=dtype, device=device, debug=debug,
                           quantized=quantized, static_cache=static_cache, calibration=calibration)


def torch_reference(source: Path, dims, max_context: int, *, dtype: str = "float32", device: str = "cpu",
                    debug: bool = False, quantized=None, static_cache: bool = False, calibration=None):
    """The reference decoder of the checkpoint at `source` for graphs of `dims`, loaded on activation;
    with `quantized` (a quantized Precision), the quantized reference: its linear weights are what
    the artifact's quantized weights dequantize to (with the export's `calibration`)."""
    from tk.runtimes.backends.torch import TorchRuntime

    def load():
        from tk.models.checkpoint.loading import load_decoder, quantize_weights_

        model = load_decoder(source, dtype)
        return quantize_weights_(model, quantized, calibration) if quantized is not None else model

    # the reference runs the plain graphs' math: no static buffer (unless kept), every position's
    # logits, no debug outputs (the decoder returns its hidden states itself)
    variant = dataclasses.replace(dims.variant, prefill_logits="all", debug_outputs=False)
    dims = dataclasses.replace(dims, kv_dtype=dtype, kv_capacity=dims.kv_capacity if static_cache else None,
                               ring=dims.ring if static_cache else None, variant=variant)
    return TorchRuntime(loader=load, device=device, debug=debug, dims=dims, max_context=max_context)


def _open_torch(artifact: Path, manifest: Manifest, options: BackendOptions):
    return reference_runtime(artifact, manifest, dtype=manifest.dtype, device=options.device,
                             static_cache=options.static_cache)


def _open_ort(artifact: Path, manifest: Manifest, options: BackendOptions):
    from tk.runtimes.backends.ort import OrtRuntime

    return OrtRuntime(artifact, manifest, threads=options.threads, provider=options.provider,
                      prepack=options.prepack, quant_compute=options.quant_compute, arena=options.arena)


def _open_trt(artifact: Path, manifest: Manifest, options: BackendOptions):
    from tk.runtimes.backends.trt import TrtRuntime

    return TrtRuntime(artifact, manifest)


register(Backend("torch", _open_torch, "the PyTorch reference decoder (the checkpoint the artifact came from)"))
register(Backend("ort", _open_ort, "ONNX Runtime over prefill.onnx and decode.onnx"))
register(Backend("trt", _open_trt, "TensorRT engines built by tk build-engine (NVIDIA GPU)"))
