"""One config for every supported decoder family, and its translation from a Hugging Face config.

Families differ by fields (`num_kv_heads`, `head_dim`, `qkv_bias`, `qk_norm`, `norm_placement`,
`rope_layers`, the multipliers, ...), never by subclasses. The per-architecture differences are one
table, `FAMILIES`. This module knows nothing about weights or graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tk.models.errors import TkError

ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
QK_NORMS = ("head", "projection")
NORM_PLACEMENTS = ("pre", "post")


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
    # RMSNorm on q and k before RoPE: None, "head" (over each head's D: Qwen3) or "projection" (over
    # the whole q and k projections, before the head split: OLMo 2); older manifests say true/false
    qk_norm: str | None = None
    norm_placement: str = "pre"  # "pre": x + f(norm(x)); "post": x + norm(f(x)), no pre-norms (OLMo 2)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): 1.0 for Gemma
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size) (Gemma)
    embedding_multiplier: float = 1.0  # embeddings times this (Granite)
    residual_multiplier: float = 1.0  # each block's branch times this before its residual add (Granite)
    attention_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim) (Granite: attention_multiplier)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    rope_layers: list[bool] | None = None  # per layer: RoPE applies; None: every layer (SmolLM3's no_rope_layers)
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
        if isinstance(self.qk_norm, bool):  # manifests written before "projection" existed
            self.qk_norm = "head" if self.qk_norm else None
        if self.qk_norm not in (None, *QK_NORMS):
            raise ValueError(f"qk_norm must be one of None, {', '.join(QK_NORMS)}; got {self.qk_norm!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement must be one of {', '.join(NORM_PLACEMENTS)}; got {self.norm_placement!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if self.rope_layers is not None:
            if len(self.rope_layers) != self.num_layers:
                raise ValueError(f"rope_layers has {len(self.rope_layers)} entries for {self.num_layers} layers")
            self.rope_layers = [bool(r) for r in self.rope_layers]
            if all(self.rope_layers):
                self.rope_layers = None  # RoPE everywhere: the usual model, spelled once
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

    def layer_rope(self, layer: int) -> bool:
        """Whether RoPE applies in `layer` (SmolLM3 leaves it out of every fourth)."""
        return self.rope_layers is None or self.rope_layers[layer]

    @property
    def uniform_layers(self) -> bool:
        """Every layer computes the same function of its own weights (an exporter may copy one)."""
        return self.rope_layers is None or len(set(self.rope_layers)) == 1

    def first_layers(self, n: int) -> "DecoderConfig":
        """This config cut to its first n layers (per-layer fields cut with it)."""
        rope = None if self.rope_layers is None else self.rope_layers[:n]
        return dataclasses.replace(self, num_layers=n, rope_layers=rope)

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
    # "none" | "always" (Mistral, Phi-3) | "opt-in" (Qwen: use_sliding_window) | "layer-types"
    # (SmolLM3: use_sliding_window, then layer_types[i] == "sliding_attention" says which layers slide)
    sliding: str = "none"
    tied: bool = False  # tie_word_embeddings when config.json leaves it out (the HF config class's default)
    hf_floats: dict = field(default_factory=dict)  # DecoderConfig field -> (HF config key, HF default)
    no_rope_layers: bool = False  # reads SmolLM3's no_rope_layers (per layer, 1: RoPE, 0: none)


_GRANITE_FLOATS = {"embedding_multiplier": ("embedding_multiplier", 1.0),
                   "residual_multiplier": ("residual_multiplier", 1.0),
                   "attention_scale": ("attention_multiplier", 1.0),  # GraniteConfig's default: 1, not 1/sqrt(D)
                   "logits_scaling": ("logits_scaling", 1.0)}

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(fixed={}, hf_bias="attention_bias"),
    "MistralForCausalLM": Family(fixed={}, sliding="always"),
    "Qwen2ForCausalLM": Family(fixed={"qkv_bias": True}, sliding="opt-in"),
    "Qwen3ForCausalLM": Family(fixed={"qk_norm": "head"}, hf_bias="attention_bias", sliding="opt-in"),
    "Phi3ForCausalLM": Family(fixed={"fused_projections": True}, sliding="always"),
    "GemmaForCausalLM": Family(fixed={"norm_offset": 1.0, "embed_scale": True}, hf_act="hidden_activation",
                               tied=True),
    "GraniteForCausalLM": Family(fixed={}, hf_bias="attention_bias", hf_floats=_GRANITE_FLOATS),
    "Olmo2ForCausalLM": Family(fixed={"qk_norm": "projection", "norm_placement": "post"}, hf_bias="attention_bias"),
    "SmolLM3ForCausalLM": Family(fixed={}, hf_bias="attention_bias", sliding="layer-types", tied=True,
                                 no_rope_layers=True),
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


def _rope_layers(hf: dict, num_layers: int) -> list[bool]:
    """SmolLM3's no_rope_layers: per layer, 1 = RoPE, 0 = none (despite the name); left out, every
    no_rope_layer_interval-th layer (default 4) goes without (SmolLM3Config.__post_init__)."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    return [bool(f) for f in flags]


def _sliding_window(fam: Family, arch: str, hf: dict, rope_layers: list[bool] | None) -> int | None:
    if fam.sliding == "always":
        return hf.get("sliding_window")
    if fam.sliding == "opt-in" and hf.get("use_sliding_window"):
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported (per-layer windows)")
    if fam.sliding != "layer-types" or not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None
    types = hf.get("layer_types")  # SmolLM3Config's default: the layers without RoPE slide
    if types is None:
        types = ["sliding_attention" if not r else "full_attention" for r in rope_layers or []]
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None
    if not all(sliding):
        raise UnsupportedModelError(f"{arch} with sliding_attention on some layers only (layer_types) is not "
                                    "supported (per-layer windows)")
    return hf["sliding_window"]


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
    rope_layers = _rope_layers(hf, hf.get("num_hidden_layers") or 0) if fam.no_rope_layers else None
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
        tie_embeddings=bool(hf.get("tie_word_embeddings", fam.tied)),
        sliding_window=_sliding_window(fam, arch, hf, rope_layers),
        rope_layers=rope_layers,
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_list(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )
    for ours, (key, default) in fam.hf_floats.items():
        fields[ours] = float(default if hf.get(key) is None else hf[key])
    fields.update(fam.fixed)
    if fields["qkv_bias"] and not fam.hf_bias:  # Qwen2: q/k/v biased, o not
        fields["o_bias"] = False
    return DecoderConfig(**fields)
