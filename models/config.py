"""One config for every supported decoder family, and its translation from a Hugging Face config.

Families differ by fields (`num_kv_heads`, `head_dim`, `qkv_bias`, `qk_norm`, `rope_scaling`,
`tie_embeddings`, ...), never by subclasses. The per-architecture differences are one table,
`FAMILIES`. This module knows nothing about weights or graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tk.models.errors import TkError

ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


class UnsupportedModelError(TkError, ValueError):
    """The checkpoint describes a model tk does not implement."""


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None  # None: MHA (= num_heads)
    head_dim: int | None = None  # None: hidden_size // num_heads; an explicit value is never overwritten
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): 1.0 for Gemma
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size) (Gemma)
    hidden_act: str = "silu"
    tie_embeddings: bool = False
    sliding_window: int | None = None
    fused_projections: bool = False  # checkpoint stores qkv_proj / gate_up_proj (Phi-3)
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "max_position_embeddings"):
            _require_positive(name, getattr(self, name))
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        _require_positive("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                    "set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_heads
        _require_positive("head_dim", self.head_dim)
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dim head_dim * partial_rotary_factor = {self.rotary_dim} must be even")
        if self.sliding_window is not None:
            _require_positive("sliding_window", self.sliding_window)
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def _require_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Family:
    """What sets one Hugging Face architecture apart, as config fields."""

    fixed: dict  # DecoderConfig fields this family always has
    hf_bias: str | None = None  # HF config key that turns on q/k/v/o biases
    hf_act: str = "hidden_act"
    sliding: str = "none"  # "none" | "always" (Mistral, Phi-3) | "opt-in" (Qwen: use_sliding_window)


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(fixed={}, hf_bias="attention_bias"),
    "MistralForCausalLM": Family(fixed={}, sliding="always"),
    "Qwen2ForCausalLM": Family(fixed={"qkv_bias": True}, sliding="opt-in"),
    "Qwen3ForCausalLM": Family(fixed={"qk_norm": True}, hf_bias="attention_bias", sliding="opt-in"),
    "Phi3ForCausalLM": Family(fixed={"fused_projections": True}, sliding="always"),
    "GemmaForCausalLM": Family(fixed={"norm_offset": 1.0, "embed_scale": True}, hf_act="hidden_activation"),
}


def _rope_from_hf(hf: dict) -> tuple[float, dict | None, float]:
    """(theta, scaling, partial_rotary_factor) from a v4 (`rope_theta`/`rope_scaling`) or v5
    (`rope_parameters`) Hugging Face config."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    params = {**legacy, **params}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None, partial
    return theta, {"rope_type": rope_type, **params}, partial


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def config_from_hf(hf: dict) -> DecoderConfig:
    """Translate a Hugging Face config.json (as a dict) for one of FAMILIES."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        name = ", ".join(archs) or f"model_type {hf.get('model_type')!r} without architectures"
        raise UnsupportedModelError(
            f"architecture {name} is not supported; supported: {', '.join(FAMILIES)}"
        )
    fam = FAMILIES[arch]
    theta, scaling, partial = _rope_from_hf(hf)
    sliding = None
    if fam.sliding == "always":
        sliding = hf.get("sliding_window")
    elif fam.sliding == "opt-in" and hf.get("use_sliding_window"):
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported (per-layer windows)")
    bias = bool(hf.get(fam.hf_bias, False)) if fam.hf_bias else False
    act = hf.get(fam.hf_act) or hf.get("hidden_act", "silu")
    fields = dict(
        vocab_size=hf.get("vocab_size"),
        hidden_size=hf.get("hidden_size"),
        intermediate_size=hf.get("intermediate_size"),
        num_layers=hf.get("num_hidden_layers"),
        num_heads=hf.get("num_attention_heads"),
        num_kv_heads=hf.get("num_key_value_heads"),
        head_dim=hf.get("head_dim"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        hidden_act=act,
        tie_embeddings=bool(hf.get("tie_word_embeddings", arch == "GemmaForCausalLM")),
        sliding_window=sliding,
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_list(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )
    fields.update(fam.fixed)
    if fields["qkv_bias"] and not fam.hf_bias:  # Qwen2: q/k/v biased, o not
        fields["o_bias"] = False
    return DecoderConfig(**fields)

