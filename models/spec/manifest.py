"""What an artifact folder holds, as typed data: read by the exporter, the runtimes and the toolkit.

Owns the export `Variant` (target, cache layout, prefill logits, debug outputs, opset), the
`Precision` (weights, activations and KV cache as separate dtypes, so a quantized weight dtype is a
precision, not a code path), the graphs' contract sizes (`graph_dims`) and the `Manifest`
(manifest.json) with its file checks. tk export's flags and profiles are models/spec/options.py. Standard
library only, so runtimes and the CLI may import it without pulling in torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from tk.models.spec import contract
from tk.models.spec.dtypes import canonical_dtype
from tk.models.spec.errors import TkError


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


QUANTIZED = ("int4", "int8")  # weight-only, blockwise (models/quant/quantize.py)
BLOCK_SIZES = (16, 32, 64, 128, 256)  # what ONNX Runtime's MatMulNBits takes
METHODS = ("rtn", "search")  # how scales are chosen (models/quant/quantize.py)
MIXED = ("none", "lm-head", "sensitive")  # --mixed-precision: which weights are kept in int8
DEFAULT_METHOD = "search"  # models/quant/quantize.py; README "Quantized weights" has the measurements
DEFAULT_BLOCK = 32  # onnxruntime-genai's int4 CPU default; TensorRT takes 64 or 128 (tk build-engine says so)


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
    calibration: dict | None = None  # {"file", "sha256", "tokens", "scaled_weights"} of --calibration
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
            scaled = self.calibration.get("scaled_weights")
            extras += [f"calibrated on {self.calibration['tokens']:,} tokens"
                       + (f", {scaled} weights channel-scaled" if scaled else "")]
        return f"{self.weights} weights (block {self.block_size}, {', '.join(extras)}), {self.activations} activations"


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
    # the static decode graph attends over its attention_mask's width, not the whole cache (contract.inputs):
    # set for the portable target's static cache without rings (a ring's mask reads positions by index)
    narrow_mask: bool = False

    def __post_init__(self):  # accept the plain strings of the CLI and of manifest.json
        object.__setattr__(self, "target", Target(self.target))
        object.__setattr__(self, "cache", CacheLayout(self.cache))
        object.__setattr__(self, "prefill_logits", PrefillLogits(self.prefill_logits))

    def to_dict(self) -> dict:
        return {k: v.value if isinstance(v, Enum) else v for k, v in dataclasses.asdict(self).items()}


def graph_dims(config, precision: Precision, variant: Variant) -> contract.GraphDims:
    """The contract's sizes for graphs of `config` (a DecoderConfig) exported as `variant`: with a
    static cache, a sliding layer whose window (plus the decode step's run) is shorter than the
    capacity keeps a ring (contract.ring_sizes)."""
    c, v = config, variant
    ring = None
    if v.capacity is not None:
        ring = contract.ring_sizes(c.windows, v.capacity, contract.RING_RUN if v.decode_prefills else 1)
    return contract.GraphDims(c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size, precision.kv, v.capacity,
                              c.hidden_size if v.debug_outputs else None, v.prefill_logits.value, v.decode_prefills,
                              ring, v.narrow_mask and ring is None)


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
        from tk.models.spec.config import DecoderConfig  # standard library only, as this module

        dims = graph_dims(DecoderConfig.from_dict(self.config), self.precision, self.variant)
        return dims if self.contract_version != 2 else dataclasses.replace(dims, ring=None)  # before rings

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
        if found not in contract.READS:
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
