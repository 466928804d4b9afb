"""One config for every supported decoder family, and its translation from a Hugging Face config.

Families differ by fields (`num_kv_heads`, `head_dim`, `qkv_bias`, `qk_norm`, `norm_placement`,
`rope_layers`, `sliding_layers`, the softcaps, the multipliers, the experts, ...), never by
subclasses. Fields that vary by layer are lists (`PER_LAYER`), and `DecoderConfig.layer(i)` says what
one layer is. How each Hugging Face architecture's config.json maps onto these fields is
models/checkpoint/families.py. This module knows nothing about weights or graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tk.models.spec.errors import TkError

ROPE_TYPES = ("default", "linear", "llama3")
# what mixes a layer's tokens (DecoderConfig.layer_types): attention over a KV cache, or a layer whose state
# is not a cache that grows: LFM2's gated short convolution ("conv": a carry of conv_kernel - 1 positions),
# the gated DeltaNet of Qwen3.5 / Qwen3-Next ("gdn": a carry and a d_k x d_v matrix per value head), and
# Mamba2 ("mamba": a carry and a d_state x head_dim matrix per head, Granite 4.0-H)
MIXERS = ("attention", "conv", "gdn", "mamba")
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
    shared_expert_gated: bool = True  # the shared expert is scaled by sigmoid(its gate) (Qwen); False: added (Granite)
    # per layer, what mixes its tokens (MIXERS); None: attention in every layer. The others' sizes:
    layer_types: list[str] | None = None
    attn_output_gate: bool = False  # attention's output times sigmoid(a gate the q projection also makes) (Qwen3.5)
    conv_kernel: int = 4  # the short causal depthwise convolution's width (LFM2's conv_L_cache: 3)
    conv_bias: bool = False  # LFM2: its conv and projections have biases; Mamba2: its conv has one
    linear_key_heads: int = 0  # gated DeltaNet: q/k heads, each serving linear_value_heads / linear_key_heads values
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    mamba_heads: int = 0  # Mamba2: heads of mamba_head_dim, a state of mamba_state per head dim, B/C in groups
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1
    mamba_proj_bias: bool = False
    mamba_dt_limit: list[float] | None = None  # the time step clamped to [lo, hi] (None: (0, inf), no clamp)
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
        self._check_mixers()
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )

    def _check_mixers(self) -> None:
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(MIXERS))
        if unknown:
            raise UnsupportedModelError(f"layer type {unknown[0]!r} is not supported; supported: {', '.join(MIXERS)}")
        self.layer_types = list(self.layer_types)
        if all(t == "attention" for t in self.layer_types):
            self.layer_types = None  # the usual model, spelled once
            return
        _require_positive("conv_kernel", self.conv_kernel)
        if "gdn" in self.layer_types:
            for name in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim"):
                _require_positive(name, getattr(self, name))
            if self.linear_value_heads % self.linear_key_heads:
                raise ValueError(f"linear_value_heads ({self.linear_value_heads}) must be a multiple of "
                                 f"linear_key_heads ({self.linear_key_heads})")
        if "mamba" in self.layer_types:
            for name in ("mamba_heads", "mamba_head_dim", "mamba_state", "mamba_groups"):
                _require_positive(name, getattr(self, name))
            if self.mamba_heads % self.mamba_groups:
                raise ValueError(f"mamba_heads ({self.mamba_heads}) must be a multiple of mamba_groups "
                                 f"({self.mamba_groups})")

    @property
    def stateful(self) -> bool:
        """Some layer's state is not a KV cache (a hybrid: LFM2, Qwen3.5, Qwen3-Next, Granite 4.0-H)."""
        return self.layer_types is not None

    def mixer(self, i: int) -> str:
        """What mixes layer i's tokens (MIXERS)."""
        return "attention" if self.layer_types is None else self.layer_types[i]

    @property
    def gdn_conv_channels(self) -> int:
        """The gated DeltaNet's convolved channels: q, k (linear_key_heads x linear_key_dim each) and v."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @property
    def mamba_conv_channels(self) -> int:
        """Mamba2's convolved channels: x (mamba_heads x mamba_head_dim), then B and C (groups x state each)."""
        return self.mamba_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state

    def layer_state(self, i: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Layer i's state other than a KV cache, per row: (name, shape) of each tensor. A carry holds the
        last conv_kernel - 1 inputs of the layer's convolution; a recurrent state is one d_k x d_v matrix
        per head (ONNX LinearAttention's layout: a gated DeltaNet's keys by values, Mamba2's state by head dim)."""
        carry = self.conv_kernel - 1
        mixer = self.mixer(i)
        if mixer == "conv":
            return (("conv", (self.hidden_size, carry)),)
        if mixer == "gdn":
            return (("conv", (self.gdn_conv_channels, carry)),
                    ("recurrent", (self.linear_value_heads, self.linear_key_dim, self.linear_value_dim)))
        if mixer == "mamba":
            return (("conv", (self.mamba_conv_channels, carry)),
                    ("recurrent", (self.mamba_heads, self.mamba_state, self.mamba_head_dim)))
        return ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer(self, i: int) -> "LayerKind":
        """What layer i computes besides its own weights."""
        rope = self.rope_layers is None or self.rope_layers[i]
        sliding = self.sliding_window is not None and (self.sliding_layers is None or self.sliding_layers[i])
        table = ("local" if sliding and self.rope_local_theta is not None else "global") if rope else None
        moe = self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[i])
        mixer = self.mixer(i)
        if mixer != "attention":  # no RoPE table, no window: its state carries position
            return LayerKind(None, None, moe, mixer)
        return LayerKind(table, self.sliding_window if sliding else None, moe, mixer)

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
        cut = {name: getattr(self, name)[:n] for name in (*PER_LAYER, "layer_types") if getattr(self, name) is not None}
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
    """What sets one layer apart from another of the same model (models/reference/decoder.py builds it from this)."""

    rope: str | None  # which RoPE table: "global", "local" (Gemma 3's sliding layers), or None (NoPE)
    window: int | None  # sliding window, or None: global attention
    moe: bool  # the FFN is a mixture of experts
    mixer: str = "attention"  # what mixes its tokens (MIXERS)


def _require_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def fused_unsupported(cfg: DecoderConfig) -> list[str]:
    """What of a DecoderConfig ONNX Runtime's fused kernels cannot express (empty: the ort target can export it).
    A partial rotary embedding (Phi-3, Qwen3.5) is GroupQueryAttention's when its cos/sin tables are that narrow.
    q/k norms (over each head or the whole projections) are applied to the packed qkv
    GroupQueryAttention reads; NoPE layers (SmolLM3) run it with do_rotary=0; each layer gets its own
    window (local_window_size) and RoPE tables (Gemma 3); Granite's and Gemma's scales are its `scale`,
    Gemma 2's softcap its `softcap`; post and sandwich norms are plain RMSNorms; experts run as in the
    portable graphs."""
    return [why for why, bad in (  # its CPU kernel: "head_size shall be a multiple of 16" (ONNX Runtime 1.32)
                                 (f"head_dim {cfg.head_dim} (GroupQueryAttention takes multiples of 16)",
                                  cfg.head_dim % 16),
                                 # "cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8"
                                 (f"a rotary dim of {cfg.rotary_dim} (GroupQueryAttention rotates multiples of 16)",
                                  cfg.rotary_dim < cfg.head_dim and cfg.rotary_dim % 16)) if bad]


def layer_ks(cfg: DecoderConfig) -> dict[str, int]:
    """Each kind of quantized layer's K (its input size), named as an error message would."""
    ks = {"layers.*.attn.wqkv and layers.*.ffn.w_gate_up (hidden_size)": cfg.hidden_size,
          "layers.*.attn.wo (num_heads x head_dim)": cfg.num_heads * cfg.head_dim}
    mixers = {cfg.mixer(i) for i in range(cfg.num_layers)}
    if "gdn" in mixers:
        ks["layers.*.mixer.w_out (linear_value_heads x linear_value_dim)"] = cfg.linear_value_heads * cfg.linear_value_dim
    if "mamba" in mixers:
        ks["layers.*.mixer.w_out (mamba_heads x mamba_head_dim)"] = cfg.mamba_heads * cfg.mamba_head_dim
    moe = [cfg.layer(i).moe for i in range(cfg.num_layers)]
    if not all(moe):
        ks["layers.*.ffn.w_down (intermediate_size)"] = cfg.intermediate_size
    if any(moe):
        ks["layers.*.ffn.experts.*.w_down (expert_size)"] = cfg.expert_size
    if any(moe) and cfg.shared_expert_size:
        ks["layers.*.ffn.shared.w_down (shared_expert_size)"] = cfg.shared_expert_size
    return ks
