"""What an artifact folder holds, as typed data: read by the exporter, the runtimes and the toolkit.

Owns the `Precision` (weights, activations and KV cache as separate dtypes, so a quantized weight dtype
is a precision, not a code path) and the `Manifest` (manifest.json) with its records (`Source`,
`ValidationRecord`, `CalibrationRecord`, `WeightEntry`) and file checks. The export `Variant` is
models/spec/variant.py's, tk export's flags and profiles models/spec/options.py's. Standard library only,
so runtimes and the CLI may import it without pulling in torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from tk.models.spec import contract
from tk.models.spec.config import DecoderConfig
from tk.models.spec.dtypes import canonical_dtype
from tk.models.spec.errors import TkError, read_json
from tk.models.spec.variant import DEFAULT_OPSET, Variant


class ArtifactError(TkError):
    """The artifact folder is missing files or does not match this tk or this machine."""


# --- what an export is -----------------------------------------------------------------------


QUANTIZED = ("int4", "int8")  # weight-only, blockwise (models/quant/quantize.py)
BLOCK_SIZES = (16, 32, 64, 128, 256)  # what ONNX Runtime's MatMulNBits takes
METHODS = ("rtn", "search")  # how scales are chosen (models/quant/quantize.py)
MIXED = ("none", "lm-head", "lm-head-w8a8", "sensitive")  # --mixed-precision: which weights are kept in int8
DEFAULT_METHOD = "search"  # models/quant/quantize.py; README "Quantized weights" has the measurements
DEFAULT_BLOCK = 32  # onnxruntime-genai's int4 CPU default; TensorRT takes 64 or 128 (tk build-engine says so)


@dataclass(frozen=True)
class CalibrationRecord:
    """What --calibration measured (toolkit/pipeline/calibrate.py): the text file's name and sha256, its
    tokens, and how many weights got channel scales."""

    file: str
    sha256: str
    tokens: int
    scaled_weights: int


@dataclass(frozen=True)
class Precision:
    """Weights, activations and KV cache as separate dtypes. Quantized weights ("int4", "int8")
    carry their block size (K rows per scale), whether the LM head is quantized too, how scales were
    chosen (`method`, models/quant/quantize.py), whether blocks have zero points, which layers are kept
    in int8 (`mixed`), whether the embedding is quantized (read from the LM head's table when tied),
    and what calibration text weighted the search; their scales and every activation are in
    `activations`. The manifest's weights table holds each tensor's own integer type."""

    weights: str = "float32"
    activations: str = "float32"
    kv: str = "float32"
    block_size: int | None = None
    quantized_lm_head: bool = False
    method: str = "rtn"
    zero_points: bool = False
    mixed: str = "none"
    quantized_embedding: bool = False
    calibration: CalibrationRecord | None = None  # what --calibration measured
    head_block: int | None = None  # the LM head's (and embedding's) own block size, when it differs

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
        extras = [self.method] + (["zero points"] if self.zero_points else [])
        extras += ["LM head too"] if self.quantized_lm_head else []
        extras += ["embedding too"] if self.quantized_embedding else []
        extras += [f"int8 {self.mixed} layers"] if self.mixed != "none" else []
        extras += [f"LM head in blocks of {self.head_block}"] if self.head_block else []
        if self.calibration:
            scaled = self.calibration.scaled_weights
            extras += [f"calibrated on {self.calibration.tokens:,} tokens"
                       + (f", {scaled} weights channel-scaled" if scaled else "")]
        return f"{self.weights} weights (block {self.block_size}, {', '.join(extras)}), {self.activations} activations"


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


@dataclass(frozen=True)
class Source:
    """The checkpoint an artifact was exported from: the torch backend reloads it from there."""

    path: str
    config_sha256: str


class WeightEntry(NamedTuple):
    """One tensor of the weights file, as the manifest records it."""

    offset: int
    length: int
    dtype: str
    shape: list[int]
    graphs: list[str]  # the graphs whose initializers include it


@dataclass
class ValidationRecord:
    """What export validation found (toolkit/pipeline/validate.py): ORT against the torch reference."""

    passed: bool
    reference: str  # which reference: "torch float32", with quantized weights where the artifact's are
    steps: int
    tolerance: dict  # the Tolerance's fields
    comparisons: list[dict]  # per case, its steps' metrics (toolkit/verify/report.py case_dict)
    first_divergence: dict | None = None  # None too in records written before tk kept it
    fused_matmulnbits: dict | None = None  # quantized: MatMulNBits per graph (toolkit/verify/quant.py)
    quantization: dict | None = None  # quantized: the error against full precision (toolkit/verify/quant.py)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v is not None or k not in ("fused_matmulnbits", "quantization")}

    @classmethod
    def from_dict(cls, d: dict) -> "ValidationRecord | None":
        """None where validation was skipped ({"skipped": true})."""
        if d.get("skipped"):
            return None
        known = {f.name for f in dataclasses.fields(cls)}  # an older tk's extra keys are not read
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(kw_only=True)
class Manifest:
    """manifest.json: what was exported from where, how, and whether it validated."""

    config: DecoderConfig  # models/ reads all of it, runtimes a few sizes
    precision: Precision
    variant: Variant
    graphs: dict[str, GraphFile]
    source: Source
    created: str = ""
    tokenizer_files: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    trt_lint: dict = field(default_factory=dict)
    validation: ValidationRecord | None = None  # None: skipped (tk export --no-validate)
    contract_version: int = contract.CONTRACT_VERSION
    # the weights file's tensors; runtimes map them once for both graphs (empty for artifacts written
    # before tk recorded it)
    weights: dict[str, WeightEntry] = field(default_factory=dict)
    profile: str | None = None  # tk export --for NAME (None: explicit flags, or written before profiles)

    @property
    def dims(self) -> contract.GraphDims:
        """The sizes and variant of the graphs' I/O (the contract resolves every spec from them)."""
        dims = contract.GraphDims.of(self.config, self.precision, self.variant)
        return dims if self.contract_version != 2 else dataclasses.replace(dims, ring=None)  # before rings

    @property
    def dtype(self) -> str:
        """The activations' dtype: what the tolerance table and the torch backend follow."""
        return self.precision.activations

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.config.eos_token_ids)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        d["variant"] = self.variant.to_dict()
        d["validation"] = {"skipped": True} if self.validation is None else self.validation.to_dict()
        return {"contract_version": d.pop("contract_version"), **d}

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        if "variant" in d:
            p = d["precision"]
            variant = Variant(**d["variant"])
            precision = Precision(**{**p, "calibration": p.get("calibration") and CalibrationRecord(**p["calibration"])})
        else:  # written by tk before the typed manifest: one dtype, the variant spread over dims
            dims = d["dims"]
            variant = Variant(target=d.get("target", "portable"), cache=d.get("kv_cache", "dynamic"),
                              capacity=dims.get("kv_capacity"), prefill_logits=dims.get("prefill_logits", "all"),
                              debug_outputs=dims.get("hidden_size") is not None, opset=d.get("opset", DEFAULT_OPSET))
            precision = Precision.of(d["dtype"])
        return cls(config=DecoderConfig.from_dict(d["config"]), precision=precision, variant=variant,
                   graphs={g: GraphFile(**entry) for g, entry in d["graphs"].items()}, source=Source(**d["source"]),
                   created=d.get("created", ""), tokenizer_files=d.get("tokenizer_files", []),
                   versions=d.get("versions", {}), trt_lint=d.get("trt_lint", {}),
                   validation=ValidationRecord.from_dict(d.get("validation", {"skipped": True})),
                   contract_version=d.get("contract_version"),
                   weights={n: WeightEntry(*e) for n, e in d.get("weights", {}).items()}, profile=d.get("profile"))

    @classmethod
    def read(cls, artifact: str | Path) -> "Manifest":
        artifact = Path(artifact)
        raw = read_json(artifact, contract.MANIFEST, ArtifactError,
                        no_folder="artifact folder {folder} does not exist; create it with tk export",
                        no_file=f"{{folder}} has no {contract.MANIFEST}; it is not a tk artifact (tk export makes one)",
                        bad_json="; re-export the artifact")
        found = raw.get("contract_version")
        if found not in contract.READS:
            raise ArtifactError(f"artifact has graph contract version {found}, this tk reads version "
                                f"{contract.CONTRACT_VERSION}; re-export it with this version of tk (tk export)")
        try:
            return cls.from_dict(raw)
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{artifact / contract.MANIFEST} is not a manifest this tk can read ({type(e).__name__}: {e}); "
                                "re-export the artifact") from None

    def write(self, folder: Path) -> None:
        (Path(folder) / contract.MANIFEST).write_text(json.dumps(self.to_dict(), indent=2))

    def verify_files(self, artifact: Path) -> dict[str, Path]:
        """Graph paths by name, after checking each exists and matches its recorded sha256 and size."""
        artifact = Path(artifact)
        paths = {}
        for graph in self.dims.graphs:
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
