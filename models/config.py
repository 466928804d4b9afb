"""One config for every supported decoder family, and its translation from a Hugging Face config.

Families differ by fields (`num_kv_heads`, `head_dim`, `qkv_bias`, `qk_norm`, `norm_placement`,
`rope_layers`, `sliding_layers`, the softcaps, the multipliers, the experts, ...), never by
subclasses. Fields that vary by layer are lists (`PER_LAYER`), and `DecoderConfig.layer(i)` says what
one layer is. The per-architecture differences are one table, `FAMILIES`. This module knows nothing
about weights or graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from tk.models.errors import TkError

ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
QK_NORMS = ("head", "projection")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
PER_LAYER = ("rope_layers", "sliding_layers", "moe_layers")  # list fields with one entry per layer


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
    # "pre": x + f(norm(x)); "post": x + norm(f(x)), no pre-norms (OLMo 2); "sandwich": x + norm2(f(norm1(x)))
    # (Gemma 2/3: four norms a layer)
    norm_placement: str = "pre"
    norm_offset: float = 0.0  # every RMSNorm (q/k norms included) scales by (offset + w): 1.0 for Gemma
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size) (Gemma)
    embedding_multiplier: float = 1.0  # embeddings times this (Granite)
    residual_multiplier: float = 1.0  # each block's branch times this before its residual add (Granite)
    attention_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim) (Granite: attention_multiplier)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    rope_layers: list[bool] | None = None  # per layer: RoPE applies; None: every layer (SmolLM3's no_rope_layers)
    hidden_act: str = "silu"
    tie_embeddings: bool = False
    sliding_window: int | None = None  # a sliding layer's query sees this many keys, itself included
    sliding_layers: list[bool] | None = None  # per layer: it slides; None: every layer (when sliding_window is set)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, never scaled (Gemma 3); None: the global table
    attn_softcap: float | None = None  # scaled scores become tanh(s / c) * c before the mask (Gemma 2)
    final_softcap: float | None = None  # logits become tanh(z / c) * c (Gemma 2, Gemma 3)
    # mixtures of experts: a layer's FFN is a router over num_experts gated FFNs of expert_size, of which each
    # token takes experts_per_token (their softmax weights renormalized to sum to 1 when renormalize_experts),
    # plus a shared FFN of shared_expert_size scaled by sigmoid(its gate) (Qwen2-MoE)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int | None = None  # None: intermediate_size (Mixtral)
    renormalize_experts: bool = True
    shared_expert_size: int = 0
    moe_layers: list[bool] | None = None  # per layer: its FFN is the experts; None: every layer (with num_experts)
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
        for name in PER_LAYER:
            flags = getattr(self, name)
            if flags is None:
                continue
            if len(flags) != self.num_layers:
                raise ValueError(f"{name} has {len(flags)} entries for {self.num_layers} layers")
            flags = [bool(f) for f in flags]
            setattr(self, name, None if all(flags) else flags)  # every layer: the usual model, spelled once
        if self.sliding_window is None and self.sliding_layers is not None:
            raise ValueError("sliding_layers needs sliding_window: how many keys a sliding layer's query sees")
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ValueError(f"rope_local_theta must be positive, got {self.rope_local_theta!r}")
        if self.num_experts:
            _require_positive("num_experts", self.num_experts)
            _require_positive("experts_per_token", self.experts_per_token)
            if self.experts_per_token > self.num_experts:
                raise ValueError(f"experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})")
            if self.expert_size is None:
                self.expert_size = self.intermediate_size
            _require_positive("expert_size", self.expert_size)
        elif self.moe_layers is not None or self.shared_expert_size:
            raise ValueError("moe_layers and shared_expert_size describe experts; set num_experts")
        if isinstance(self.qk_norm, bool):  # manifests written before "projection" existed
            self.qk_norm = "head" if self.qk_norm else None
        if self.qk_norm not in (None, *QK_NORMS):
            raise ValueError(f"qk_norm must be one of None, {', '.join(QK_NORMS)}; got {self.qk_norm!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement must be one of {', '.join(NORM_PLACEMENTS)}; got {self.norm_placement!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_scale", "attn_softcap",
                     "final_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
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

    def layer(self, i: int) -> "LayerKind":
        """What layer i computes besides its own weights."""
        rope = self.rope_layers is None or self.rope_layers[i]
        sliding = self.sliding_window is not None and (self.sliding_layers is None or self.sliding_layers[i])
        table = ("local" if sliding and self.rope_local_theta is not None else "global") if rope else None
        moe = self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[i])
        return LayerKind(table, self.sliding_window if sliding else None, moe)

    def layer_rope(self, layer: int) -> bool:
        """Whether RoPE applies in `layer` (SmolLM3 leaves it out of every fourth)."""
        return self.layer(layer).rope is not None

    @property
    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it attends to every earlier position)."""
        return [self.layer(i).window for i in range(self.num_layers)]

    @property
    def uniform_layers(self) -> bool:
        """Every layer computes the same function of its own weights (an exporter may copy one)."""
        return len({self.layer(i) for i in range(self.num_layers)}) == 1

    def first_layers(self, n: int) -> "DecoderConfig":
        """This config cut to its first n layers (per-layer fields cut with it)."""
        cut = {name: getattr(self, name)[:n] for name in PER_LAYER if getattr(self, name) is not None}
        return dataclasses.replace(self, num_layers=n, **cut)

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

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


@dataclass(frozen=True)
class LayerKind:
    """What sets one layer apart from another of the same model (models/decoder.py builds it from this)."""

    rope: str | None  # which RoPE table: "global", "local" (Gemma 3's sliding layers), or None (NoPE)
    window: int | None  # sliding window, or None: global attention
    moe: bool  # the FFN is a mixture of experts


def _require_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _smollm3_layer_types(hf: dict, rope_layers: list[bool] | None) -> list[str]:
    """SmolLM3Config's default: the layers without RoPE slide."""
    return ["sliding_attention" if not r else "full_attention" for r in rope_layers or []]


def _gemma_layer_types(pattern_key: str | None, pattern: int):
    """Gemma 2 (every second layer global) and Gemma 3 (every `sliding_window_pattern`-th, 6 by default):
    layer i slides unless (i + 1) % pattern == 0 (Gemma2Config / Gemma3TextConfig.__init__)."""
    def types(hf: dict, rope_layers) -> list[str]:
        every = int(hf.get(pattern_key, hf.get("_" + pattern_key, pattern)) if pattern_key else pattern)
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(hf["num_hidden_layers"])]
    return types


def _moe_mixtral(hf: dict, num_layers: int) -> dict:
    """Mixtral: every layer routes over num_local_experts FFNs of intermediate_size, renormalized top-k."""
    return dict(num_experts=hf.get("num_local_experts", hf.get("num_experts")), experts_per_token=hf.get("num_experts_per_tok"),
                expert_size=hf.get("intermediate_size"), renormalize_experts=True)


def _moe_qwen(hf: dict, num_layers: int) -> dict:
    """Qwen2-MoE and Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, on every
    decoder_sparse_step-th layer (the others are dense FFNs of intermediate_size); experts of
    moe_intermediate_size, renormalized when norm_topk_prob; a gated shared expert (Qwen2-MoE)."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # Qwen3MoeConfig saves the latter
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    layers = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    if not any(layers):
        return {}
    return dict(num_experts=experts, experts_per_token=hf.get("num_experts_per_tok"),
                expert_size=hf.get("moe_intermediate_size"), renormalize_experts=bool(hf.get("norm_topk_prob", False)),
                shared_expert_size=hf.get("shared_expert_intermediate_size") or 0, moe_layers=layers)


@dataclass(frozen=True)
class ExpertNames:
    """Where a mixture-of-experts checkpoint keeps an MoE layer's tensors: model.layers.N.{block}.gate
    (the router), .experts.E.{gate,up,down}; a shared expert at mlp.shared_expert(_gate) (Qwen2-MoE)."""

    block: str
    gate: str
    up: str
    down: str


MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """What sets one Hugging Face architecture apart, as config fields."""

    fixed: dict  # DecoderConfig fields this family always has
    hf_bias: str | None = None  # HF config key that turns on q/k/v/o biases
    hf_act: str = "hidden_act"
    # "none" | "always" (Mistral, Phi-3, Mixtral: sliding_window on every layer) | "opt-in" (Qwen:
    # use_sliding_window, refused) | "layer-types" (layer_types[i] == "sliding_attention" says which layers
    # slide; absent, `layer_types` derives them; with `sliding_gate`, only when that HF key is true)
    sliding: str = "none"
    layer_types: Callable[[dict, list[bool] | None], list[str]] | None = None
    sliding_gate: str | None = None
    tied: bool = False  # tie_word_embeddings when config.json leaves it out (the HF config class's default)
    hf_floats: dict = field(default_factory=dict)  # DecoderConfig field -> (HF config key, HF default)
    no_rope_layers: bool = False  # reads SmolLM3's no_rope_layers (per layer, 1: RoPE, 0: none)
    softcaps: tuple[str, ...] = ()  # which of attn_logit_softcapping, final_logit_softcapping it applies
    pre_attn_scalar: bool = False  # softmax scale query_pre_attn_scalar ** -0.5 (Gemma 2/3)
    local_rope: bool = False  # sliding layers have a RoPE base of their own (Gemma 3: rope_local_base_freq)
    moe: Callable[[dict, int], dict] | None = None  # the experts' DecoderConfig fields from config.json
    experts: ExpertNames | None = None  # their tensors' names
    refuse: dict = field(default_factory=dict)  # HF key -> why a true value is not supported


_GRANITE_FLOATS = {"embedding_multiplier": ("embedding_multiplier", 1.0),
                   "residual_multiplier": ("residual_multiplier", 1.0),
                   "attention_scale": ("attention_multiplier", 1.0),  # GraniteConfig's default: 1, not 1/sqrt(D)
                   "logits_scaling": ("logits_scaling", 1.0)}
_GEMMA = {"norm_offset": 1.0, "embed_scale": True}
_GEMMA_2_3 = dict(hf_act="hidden_activation", tied=True, sliding="layer-types", pre_attn_scalar=True)

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(fixed={}, hf_bias="attention_bias"),
    "MistralForCausalLM": Family(fixed={}, sliding="always"),
    "Qwen2ForCausalLM": Family(fixed={"qkv_bias": True}, sliding="opt-in"),
    "Qwen3ForCausalLM": Family(fixed={"qk_norm": "head"}, hf_bias="attention_bias", sliding="opt-in"),
    "Phi3ForCausalLM": Family(fixed={"fused_projections": True}, sliding="always"),
    "GemmaForCausalLM": Family(fixed=_GEMMA, hf_act="hidden_activation", tied=True),
    "Gemma2ForCausalLM": Family(fixed={**_GEMMA, "norm_placement": "sandwich"}, **_GEMMA_2_3,
                                layer_types=_gemma_layer_types(None, 2), softcaps=("attn", "final")),
    # attn_logit_softcapping is ignored by Gemma3's attention (docs/families.md, section 3)
    "Gemma3ForCausalLM": Family(fixed={**_GEMMA, "norm_placement": "sandwich", "qk_norm": "head"}, **_GEMMA_2_3,
                                layer_types=_gemma_layer_types("sliding_window_pattern", 6), softcaps=("final",),
                                local_rope=True, refuse={"use_bidirectional_attention": "bidirectional attention"}),
    "GraniteForCausalLM": Family(fixed={}, hf_bias="attention_bias", hf_floats=_GRANITE_FLOATS),
    "Olmo2ForCausalLM": Family(fixed={"qk_norm": "projection", "norm_placement": "post"}, hf_bias="attention_bias"),
    "SmolLM3ForCausalLM": Family(fixed={}, hf_bias="attention_bias", sliding="layer-types", tied=True,
                                 layer_types=_smollm3_layer_types, sliding_gate="use_sliding_window",
                                 no_rope_layers=True),
    "MixtralForCausalLM": Family(fixed={}, sliding="always", moe=_moe_mixtral, experts=MIXTRAL_EXPERTS),
    "Qwen2MoeForCausalLM": Family(fixed={"qkv_bias": True}, sliding="opt-in", moe=_moe_qwen, experts=QWEN_EXPERTS),
    "Qwen3MoeForCausalLM": Family(fixed={"qk_norm": "head"}, hf_bias="attention_bias", sliding="opt-in", moe=_moe_qwen,
                                  experts=QWEN_EXPERTS),
}


def _rope_params(params: dict, hf: dict) -> tuple[float, dict | None, float]:
    params = dict(params)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None, partial
    return theta, {"rope_type": rope_type, **params}, partial


def _rope_from_hf(hf: dict) -> tuple[float, dict | None, float, float | None]:
    """(theta, scaling, partial_rotary_factor, the sliding layers' own theta or None) from a v4
    (`rope_theta`/`rope_scaling`/`rope_local_base_freq`) or v5 (`rope_parameters`, nested by layer type
    where the types differ: Gemma 3) Hugging Face config."""
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:  # transformers 5, per layer type
        local = params.get("sliding_attention") or {}
        theta, scaling, partial = _rope_params(params["full_attention"], hf)
        local_theta, local_scaling, _ = _rope_params(local, hf) if local else (None, None, partial)
        if local_scaling is not None:
            raise UnsupportedModelError(f"rope type {local_scaling['rope_type']!r} on sliding layers is not supported "
                                        "(their RoPE is never scaled in the families tk reads)")
        return theta, scaling, partial, local_theta
    legacy = dict(hf.get("rope_scaling") or {})
    local = hf.get("rope_local_base_freq")
    return (*_rope_params({**legacy, **params}, hf), None if local is None else float(local))


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


def _sliding(fam: Family, arch: str, hf: dict, rope_layers: list[bool] | None) -> tuple[int | None, list[bool] | None]:
    """(sliding_window, sliding_layers): the window, and which layers slide (None: all)."""
    window = hf.get("sliding_window") or None  # Qwen2-MoE writes 0 for none
    if fam.sliding == "always":
        return window, None
    if fam.sliding == "opt-in" and hf.get("use_sliding_window"):
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported (its max_window_layers "
                                    "rule); export it with use_sliding_window false, as it was trained")
    if fam.sliding != "layer-types" or window is None or (fam.sliding_gate and not hf.get(fam.sliding_gate)):
        return None, None
    types = hf.get("layer_types") or fam.layer_types(hf, rope_layers)
    sliding = [t == "sliding_attention" for t in types]
    return (window, sliding) if any(sliding) else (None, None)


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
    for key, what in fam.refuse.items():
        if hf.get(key):
            raise UnsupportedModelError(f"{arch} with {key}=true ({what}) is not supported")
    theta, scaling, partial, local_theta = _rope_from_hf(hf)
    num_layers = hf.get("num_hidden_layers") or 0
    rope_layers = _rope_layers(hf, num_layers) if fam.no_rope_layers else None
    window, sliding_layers = _sliding(fam, arch, hf, rope_layers)
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
        sliding_window=window,
        sliding_layers=sliding_layers,
        rope_local_theta=local_theta if fam.local_rope and window is not None else None,
        rope_layers=rope_layers,
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_list(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )
    for ours, (key, default) in fam.hf_floats.items():
        fields[ours] = float(default if hf.get(key) is None else hf[key])
    for cap in fam.softcaps:  # None or absent: off
        value = hf.get(f"{cap}_logit_softcapping")
        fields[f"{cap}_softcap"] = None if value is None else float(value)
    if fam.pre_attn_scalar:  # Gemma2Config / Gemma3TextConfig default 256
        fields["attention_scale"] = float(hf.get("query_pre_attn_scalar") or 256) ** -0.5
    if fam.moe is not None:
        fields.update(fam.moe(hf, num_layers))
    fields.update(fam.fixed)
    if fields["qkv_bias"] and not fam.hf_bias:  # Qwen2: q/k/v biased, o not
        fields["o_bias"] = False
    return DecoderConfig(**fields)
