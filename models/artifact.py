"""What an artifact folder holds, as typed data: read by the exporter, the runtimes and the toolkit.

Owns the export `Variant` (target, cache layout, prefill logits, debug outputs, opset), the
`Precision` (weights, activations and KV cache as separate dtypes, so a quantized weight dtype is a
precision, not a code path), the export `PROFILES` (`tk export --for`: the variant for one
deployment), `ExportOptions` checked completely before any weight is read, and the `Manifest`
(manifest.json) with its file checks. Standard library only, so runtimes and the CLI may import it
without pulling in torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable

from tk.models import contract
from tk.models.dtypes import canonical_dtype
from tk.models.errors import TkError, UsageProblem


class ArtifactError(TkError):
    """The artifact folder is missing files or does not match this tk or this machine."""


# --- what an export is -----------------------------------------------------------------------


class Target(str, Enum):
    PORTABLE = "portable"  # standard ONNX: ONNX Runtime and TensorRT
    ORT = "ort"  # ONNX Runtime's fused contrib kernels, ONNX Runtime only


class CacheLayout(str, Enum):
    DYNAMIC = "dynamic"  # past in, a present one position longer out
    STATIC = "static"  # a fixed-capacity buffer written in place at per-row write indices


class PrefillLogits(str, Enum):
    ALL = "all"
    LAST = "last"  # the last position only: what generation needs


MIN_OPSET, DEFAULT_OPSET, MAX_OPSET = 18, 23, 23
STATIC_OPSET = 24  # TensorScatter


QUANTIZED = ("int4", "int8")  # weight-only, blockwise symmetric (models/quantize.py)
BLOCK_SIZES = (16, 32, 64, 128, 256)  # what ONNX Runtime's MatMulNBits takes
DEFAULT_BLOCK = 32  # onnxruntime-genai's int4 CPU default; TensorRT takes 64 or 128 (tk build-engine says so)


@dataclass(frozen=True)
class Precision:
    """Weights, activations and KV cache as separate dtypes. Quantized weights ("int4", "int8")
    carry their block size (K rows per scale) and whether the LM head is quantized too; their
    scales and every activation are in `activations`."""

    weights: str = "float32"
    activations: str = "float32"
    kv: str = "float32"
    block_size: int | None = None
    quantized_lm_head: bool = False

    @classmethod
    def of(cls, dtype: str) -> "Precision":
        d = canonical_dtype(dtype)
        return cls(d, d, d)

    @property
    def quantized(self) -> bool:
        return self.weights in QUANTIZED

    def describe(self) -> str:
        if not self.quantized:
            return self.weights
        head = ", LM head too" if self.quantized_lm_head else ""
        return f"{self.weights} weights (block {self.block_size}{head}), {self.activations} activations"


@dataclass(frozen=True)
class Variant:
    """What changes the graphs but not the contract's tensor names."""

    target: Target = Target.PORTABLE
    cache: CacheLayout = CacheLayout.DYNAMIC
    capacity: int | None = None  # the static cache's positions
    prefill_logits: PrefillLogits = PrefillLogits.ALL
    debug_outputs: bool = False  # each layer's hidden state as an extra output (hidden.{i})
    opset: int = DEFAULT_OPSET
    # the static decode graph also prefills (S >= 1 new tokens per row, contract.inputs): set for
    # --target ort --kv-cache static --prefill-logits last, where ONNX Runtime then runs one session
    decode_prefills: bool = False

    def __post_init__(self):  # accept the plain strings of the CLI and of manifest.json
        object.__setattr__(self, "target", Target(self.target))
        object.__setattr__(self, "cache", CacheLayout(self.cache))
        object.__setattr__(self, "prefill_logits", PrefillLogits(self.prefill_logits))

    def to_dict(self) -> dict:
        return {k: v.value if isinstance(v, Enum) else v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class Profile:
    """`tk export --for NAME`: the variant for one deployment. Another value of a flag it sets is a
    usage error; --dtype, --weights and --block-size compose with it, within what it runs (`note`)."""

    target: Target
    cache: CacheLayout
    prefill_logits: PrefillLogits
    why: str  # one line: what the profile is for
    dtype: str = "fp32"  # --dtype when not given
    dtypes: tuple[str, ...] = ()  # the only activation dtypes the deployment runs (empty: any)
    weights: tuple[str, ...] = QUANTIZED  # the --weights it takes
    block_sizes: tuple[int, ...] = ()  # the quantization blocks it takes, preferred first (empty: any, default 32)
    note: str = ""  # why dtypes, weights or block sizes are limited

    def flags(self) -> dict[str, str]:
        return {"target": self.target.value, "kv-cache": self.cache.value, "prefill-logits": self.prefill_logits.value}


# A profile's static cache holds the model's context, at most this many positions (--max-seq-len
# overrides): attention runs over the whole buffer and each row's cache is allocated up front, so a
# 128k-context model must not get a 128k cache by default. tk build-engine caps its default alike.
PROFILE_CAPACITY = 2048
ORT_FAST = (Target.ORT, CacheLayout.STATIC, PrefillLogits.LAST)  # decode_prefills: one CPU session
PORTABLE_STATIC = (Target.PORTABLE, CacheLayout.STATIC, PrefillLogits.LAST)
PROFILES: dict[str, Profile] = {
    # README "Faster graphs for ONNX Runtime": fused kernels, in-place cache, a decode graph that prefills
    "ort-cpu": Profile(*ORT_FAST, "ONNX Runtime on CPUs: fused kernels, in-place cache, one session"),
    # ORT's CUDA GroupQueryAttention kernel is registered for fp16 and bf16 only (a float32 graph would
    # run it on the CPU); on CUDA, OrtRuntime prefills through prefill.onnx
    "ort-cuda": Profile(*ORT_FAST, "ONNX Runtime's CUDA provider: fused kernels, in-place cache, fp16",
                        dtype="fp16", dtypes=("float16", "bfloat16"),
                        note="ONNX Runtime's CUDA GroupQueryAttention runs fp16 and bf16 only"),
    # the static cache maps to TensorRT's in-place KV-cache update layer and fixes every decode shape
    # but the batch (opset 23's RMSNormalization needs TensorRT 10.15 with either cache)
    "trt": Profile(*PORTABLE_STATIC, "TensorRT: standard ONNX, in-place cache", weights=("int4",),
                   block_sizes=(128, 64), note="TensorRT documents int4 weight-only quantization (blocks of 64 or "
                                               "128) and no int8 weight-only path"),
    # the static cache's rows are the slots; standard ONNX serves on every backend (ort, trt, torch) and
    # in Triton's own onnxruntime and tensorrt models (tk triton --native)
    "serve": Profile(*PORTABLE_STATIC, "tk serve and tk triton: slots of a static cache, every backend"),
}


@dataclass(frozen=True)
class ExportOptions:
    precision: Precision = Precision()
    variant: Variant = Variant()
    validate: bool = True
    force: bool = False
    profile: str | None = None  # tk export --for: capacity and block size may wait for the model (for_model)

    @classmethod
    def from_flags(cls, *, profile: str | None = None, dtype: str | None = None, opset: int = DEFAULT_OPSET,
                   kv_cache: str | None = None, max_seq_len: int | None = None, target: str | None = None,
                   prefill_logits: str | None = None, debug_outputs: bool = False, validate: bool = True,
                   force: bool = False, weights: str | None = None, block_size: int | None = None,
                   quantize_lm_head: bool = True) -> "ExportOptions":
        """The options of `tk export`, each checked alone and in combination (usage errors, exit 2).
        A flag left None takes its default, or the profile's value."""
        if profile is not None and profile not in PROFILES:
            raise UsageProblem(f"unknown profile {profile!r}; use one of {', '.join(PROFILES)}")
        prof = PROFILES.get(profile)
        if weights is not None and weights not in QUANTIZED:
            raise UsageProblem(f"unknown --weights {weights!r}; use one of {', '.join(QUANTIZED)} (or leave it out "
                               "for weights in --dtype)")
        if weights is None and block_size is not None:
            raise UsageProblem("--block-size sets the quantization block; add --weights int4 or int8")
        if weights is not None and opset < 21:
            raise UsageProblem(f"--weights {weights} needs --opset 21 or later (blocked DequantizeLinear, INT4)")
        if weights is not None and block_size is None and not (prof and prof.block_sizes):
            block_size = DEFAULT_BLOCK  # a profile's own blocks wait for the model's K (for_model)
        if block_size is not None and block_size not in BLOCK_SIZES:
            raise UsageProblem(f"--block-size {block_size} is not one ONNX Runtime's MatMulNBits takes; use one of "
                               f"{', '.join(map(str, BLOCK_SIZES))}")
        given = {"target": target, "kv-cache": kv_cache, "prefill-logits": prefill_logits}
        for value, kind in zip(given.values(), (Target, CacheLayout, PrefillLogits)):
            if value is not None and value not in {k.value for k in kind}:
                raise UsageProblem(f"unknown {kind.__name__} {value!r}; use one of "
                                   f"{', '.join(k.value for k in kind)}")
        if prof is not None:
            cls._check_profile(profile, prof, {**given, "dtype": dtype, "weights": weights, "block-size": block_size},
                               debug_outputs)
            target, kv_cache, prefill_logits = prof.flags().values()
            dtype = dtype or prof.dtype
        target, kv_cache, prefill_logits = target or "portable", kv_cache or "dynamic", prefill_logits or "all"
        if kv_cache == "static" and (2 if prof and max_seq_len is None else max_seq_len or 0) < 2:
            raise UsageProblem("--kv-cache static needs --max-seq-len N (N >= 2): the capacity of the cache")
        if kv_cache == "dynamic" and max_seq_len is not None:
            raise UsageProblem("--max-seq-len sets the capacity of a static cache; add --kv-cache static")
        if not MIN_OPSET <= opset <= MAX_OPSET:
            raise UsageProblem(f"opset {opset} is not supported; use {MIN_OPSET}..{MAX_OPSET} (default {DEFAULT_OPSET})")
        if debug_outputs and (kv_cache == "static" or target != "portable"):
            raise UsageProblem("--debug-outputs works with the dynamic cache and the portable target; drop "
                               "--kv-cache static and --target for a debug export")
        prefills = target == Target.ORT.value and kv_cache == "static" and prefill_logits == "last"
        variant = Variant(target, kv_cache, max_seq_len, prefill_logits, debug_outputs, opset, prefills)
        precision = Precision.of(dtype or "fp32")
        if weights is not None:
            precision = dataclasses.replace(precision, weights=weights, block_size=block_size,
                                            quantized_lm_head=quantize_lm_head)
        return cls(precision, variant, validate, force, profile)

    @staticmethod
    def _check_profile(name: str, prof: Profile, given: dict, debug_outputs: bool) -> None:
        """Refuse a flag the profile sets, given another value, and a precision its deployment does not run."""
        if debug_outputs:
            raise UsageProblem(f"--for {name} conflicts with --debug-outputs: a debug export has the dynamic cache "
                               "and the portable target; drop one of them")
        fits = {"dtype": lambda v: not prof.dtypes or canonical_dtype(v) in prof.dtypes,
                "weights": lambda v: v in prof.weights,
                "block-size": lambda v: not prof.block_sizes or v in prof.block_sizes}
        for flag, value in given.items():
            if value is not None and not fits.get(flag, lambda v: v == prof.flags()[flag])(value):
                why = prof.note if flag in fits else f"the profile exports --{flag} {prof.flags()[flag]}"
                raise UsageProblem(f"--for {name} conflicts with --{flag} {value}: {why}; drop one of them")

    def for_model(self, config) -> "ExportOptions":
        """These options with what a profile leaves to the model (a DecoderConfig) filled in: the
        static cache's capacity (the model's context, at most PROFILE_CAPACITY) and the first of the
        profile's quantization blocks that divides every K."""
        v, p = self.variant, self.precision
        if v.cache is CacheLayout.STATIC and v.capacity is None:
            v = dataclasses.replace(v, capacity=min(config.max_position_embeddings, PROFILE_CAPACITY))
        if p.quantized and p.block_size is None:
            from tk.models.quantize import layer_ks

            prof, ks = PROFILES[self.profile], layer_ks(config)  # only a profile leaves the block to the model
            fits = [b for b in prof.block_sizes if all(k % b == 0 for k in ks.values())]
            if not fits:
                layer, k = next((layer, k) for layer, k in ks.items() if k % min(prof.block_sizes))
                raise UsageProblem(f"--for {self.profile} --weights {p.weights}: blocks of "
                                   f"{' or '.join(map(str, prof.block_sizes))} rows are what it takes, and neither "
                                   f"divides the K of {layer}, {k}; leave out --weights")
            p = dataclasses.replace(p, block_size=fits[0])
        return dataclasses.replace(self, variant=v, precision=p)

    def check(self, config, has_cuda_provider: Callable[[], bool] = lambda: False) -> None:
        """Refusals that depend on the model (a DecoderConfig), all before any weight is read.
        `has_cuda_provider` is asked only where it matters (validating bf16)."""
        v = self.variant
        if v.capacity is not None and v.capacity > config.max_position_embeddings:
            raise UsageProblem(f"--max-seq-len ({v.capacity}) is beyond the model's context of "
                               f"{config.max_position_embeddings}")
        if v.target is Target.ORT:
            from tk.models.ort_kernels import unsupported

            problems = unsupported(config)
            if problems:
                raise UsageProblem(f"--target ort does not support {' or '.join(problems)} ({config.architecture}); "
                                   "export with --target portable")
        p = self.precision
        if p.quantized:
            from tk.models.quantize import layer_ks

            for layer, k in layer_ks(config).items():
                if k % p.block_size:
                    raise UsageProblem(f"--block-size {p.block_size} does not divide the K of {layer}, {k}; "
                                       f"choose a block size that divides {k}")
            if p.activations == "bfloat16" and not has_cuda_provider():
                raise UsageProblem(f"{p.weights} weights with bf16 activations have no ONNX Runtime CPU kernel "
                                   "(MatMulNBits takes fp32 or fp16); use --dtype fp32 or fp16")
        if self.validate and self.precision.activations == "bfloat16" and not has_cuda_provider():
            raise UsageProblem("bf16 graphs cannot be validated here: ONNX Runtime's CPU provider has no bf16 "
                               "MatMul; export with --no-validate and check on a GPU (tk parity), or use --dtype fp16")


# --- the manifest ----------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """The sha256 an artifact records for each file it depends on."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class GraphFile:
    file: str
    sha256: str
    data_file: str | None
    data_bytes: int
    opset: int
    export_s: float = 0.0


@dataclass
class Manifest:
    """manifest.json: what was exported from where, how, and whether it validated."""

    config: dict  # DecoderConfig.to_dict(); models/ reads it back, runtimes need only a few sizes
    precision: Precision
    variant: Variant
    graphs: dict[str, GraphFile]
    source: dict  # {"path": checkpoint folder, "config_sha256": ...}
    created: str = ""
    tokenizer_files: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    trt_lint: dict = field(default_factory=dict)
    validation: dict = field(default_factory=lambda: {"skipped": True})
    contract_version: int = contract.CONTRACT_VERSION
    # the weights file's tensors: name -> [offset, length, dtype, shape]; runtimes map them once for
    # both graphs (empty for artifacts written before tk recorded it)
    weights: dict = field(default_factory=dict)
    profile: str | None = None  # tk export --for NAME (None: explicit flags, or written before profiles)

    @property
    def dims(self) -> contract.GraphDims:
        """The sizes and variant of the graphs' I/O (the contract resolves every spec from them)."""
        c = self.config
        return contract.GraphDims(c["num_layers"], c["num_kv_heads"], c["head_dim"], c["vocab_size"], self.precision.kv,
                                  self.variant.capacity, c["hidden_size"] if self.variant.debug_outputs else None,
                                  self.variant.prefill_logits.value, self.variant.decode_prefills)

    @property
    def dtype(self) -> str:
        """The activations' dtype: what the tolerance table and the torch backend follow."""
        return self.precision.activations

    @property
    def max_context(self) -> int:
        return self.config["max_position_embeddings"]

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.config.get("eos_token_ids", []))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["variant"] = self.variant.to_dict()
        return {"contract_version": d.pop("contract_version"), **d}

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        if "variant" in d:
            variant, precision = Variant(**d["variant"]), Precision(**d["precision"])
        else:  # written by tk before the typed manifest: one dtype, the variant spread over dims
            dims = d["dims"]
            variant = Variant(d.get("target", "portable"), d.get("kv_cache", "dynamic"), dims.get("kv_capacity"),
                              dims.get("prefill_logits", "all"), dims.get("hidden_size") is not None,
                              d.get("opset", DEFAULT_OPSET))
            precision = Precision.of(d["dtype"])
        graphs = {g: GraphFile(**entry) for g, entry in d["graphs"].items()}
        return cls(d["config"], precision, variant, graphs, d["source"], d.get("created", ""),
                   d.get("tokenizer_files", []), d.get("versions", {}), d.get("trt_lint", {}),
                   d.get("validation", {"skipped": True}), d.get("contract_version"), d.get("weights", {}),
                   d.get("profile"))

    @classmethod
    def read(cls, artifact: str | Path) -> "Manifest":
        artifact = Path(artifact)
        path = artifact / contract.MANIFEST
        if not artifact.is_dir():
            raise ArtifactError(f"artifact folder {artifact} does not exist; create it with tk export")
        if not path.is_file():
            raise ArtifactError(f"{artifact} has no {contract.MANIFEST}; it is not a tk artifact (tk export makes one)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{path} is not valid JSON ({e}); re-export the artifact") from None
        found = raw.get("contract_version")
        if found != contract.CONTRACT_VERSION:
            raise ArtifactError(f"artifact has graph contract version {found}, this tk reads version "
                                f"{contract.CONTRACT_VERSION}; re-export it with this version of tk (tk export)")
        try:
            return cls.from_dict(raw)
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{path} is not a manifest this tk can read ({type(e).__name__}: {e}); "
                                "re-export the artifact") from None

    def write(self, folder: Path) -> None:
        (Path(folder) / contract.MANIFEST).write_text(json.dumps(self.to_dict(), indent=2))

    def verify_files(self, artifact: Path) -> dict[str, Path]:
        """Graph paths by name, after checking each exists and matches its recorded sha256 and size."""
        artifact = Path(artifact)
        paths = {}
        for graph in contract.GRAPHS:
            entry = self.graphs[graph]
            path = artifact / entry.file
            if not path.is_file():
                raise ArtifactError(f"{artifact} is missing {entry.file}; re-export the artifact")
            if sha256_file(path) != entry.sha256:
                raise ArtifactError(f"{path} does not match the sha256 in {contract.MANIFEST}; it was changed "
                                    "after export: re-export the artifact")
            data = artifact / entry.data_file if entry.data_file else None
            if data is not None and (not data.is_file() or data.stat().st_size != entry.data_bytes):
                raise ArtifactError(f"{data} is missing or has the wrong size; re-export the artifact")
            paths[graph] = path
        return paths
