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

# the tables of allowed values and the checks are checks.py's; callers import UnsupportedModelError from here too
from tk.models.spec.checks import PER_LAYER, UnsupportedModelError, check_config  # noqa: F401


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
    rope_scaling: dict | None = None  # {"rope_type": one of ROPE_TYPES, "factor": ..., ...}: the global table's
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
    # gpt-oss: a learned logit per head in each softmax's denominator (a "sink" no value is read from); a bias
    # on the router; the routing (ROUTINGS); an expert's SwiGLU clamped (the gate above, up both sides, at
    # swiglu_limit), its SiLU with a gain (g * sigmoid(swiglu_alpha * g)) and up offset by one: (up + 1) * silu
    attention_sinks: bool = False
    router_bias: bool = False
    routing: str = "softmax_topk"
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # Gemma 4: full-attention (non-sliding) layers with a wider head (and their own kv heads); the last
    # kv_shared_layers layers read the cache of the last earlier layer of their kind (the same window) and keep
    # none; values RMS-normed per head without a scale; full layers whose values are their keys' projection
    # (attention_k_eq_v); a second embedding (per_layer_vocab_size x num_layers * per_layer_input_size) feeding
    # every layer; each layer's output times a learned scalar; KV-shared layers' FFN twice as wide
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    kv_shared_layers: int = 0
    value_norm: bool = False
    values_from_keys: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int | None = None
    layer_scalars: bool = False
    wide_shared_ffn: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        check_config(self)

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
        wide = not sliding and self.global_head_dim is not None  # Gemma 4's full-attention layers
        head_dim = self.global_head_dim if wide else self.head_dim
        kv_heads = self.global_kv_heads if wide and self.global_kv_heads else self.num_kv_heads
        reads = self.kv_source(i) if i >= self.num_layers - self.kv_shared_layers else None
        return LayerKind(table, self.sliding_window if sliding else None, moe, mixer, head_dim, kv_heads, reads,
                         wide and self.values_from_keys and reads is None)

    def kv_source(self, i: int) -> int:
        """The layer whose cache KV-shared layer i reads: the last layer before the shared ones with the same
        window (Gemma4TextConfig.kv_sharing_modes: the last non-shared layer of its layer type)."""
        first = self.num_layers - self.kv_shared_layers
        window = self._window(i)
        source = next((j for j in reversed(range(first)) if self._window(j) == window), None)
        if source is None:
            raise ValueError(f"layer {i} shares the KV cache of an earlier layer with its window ({window}), "
                             "and there is none")
        return source

    def _window(self, i: int) -> int | None:
        sliding = self.sliding_window is not None and (self.sliding_layers is None or self.sliding_layers[i])
        return self.sliding_window if sliding else None

    def cache_tensors(self, i: int) -> int:
        """How many cache tensors layer i carries in the contract: a key and a value, its recurrent state's, or
        none (a KV-shared layer)."""
        if self.mixer(i) != "attention":
            return len(self.layer_state(i))
        return 0 if self.layer(i).reads is not None else 2

    def layer_cache(self, i: int) -> tuple[int, int] | None:
        """(kv heads, head dim) of attention layer i's own cache; None: it keeps none (a KV-shared layer or a
        recurrent one)."""
        kind = self.layer(i)
        return None if kind.mixer != "attention" or kind.reads is not None else (kind.kv_heads, kind.head_dim)

    @property
    def uniform_cache(self) -> bool:
        """Every layer keeps keys and values of num_kv_heads x head_dim (the contract needs no per-layer sizes)."""
        return not self.stateful and all(self.layer_cache(i) == (self.num_kv_heads, self.head_dim)
                                         for i in range(self.num_layers))

    def ffn_size(self, i: int) -> int:
        """Layer i's dense FFN width (Gemma 4's KV-shared layers: twice intermediate_size, use_double_wide_mlp)."""
        wide = self.wide_shared_ffn and i >= self.num_layers - self.kv_shared_layers
        return self.intermediate_size * (2 if wide else 1)

    def rope_dim(self, table: str) -> int:
        """The rotated width of a RoPE table: its layers' head dim (Gemma 4's global one is wider) times
        partial_rotary_factor."""
        wide = table == "global" and self.global_head_dim is not None
        return int((self.global_head_dim if wide else self.head_dim) * self.partial_rotary_factor)

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
    head_dim: int = 0  # an attention layer's head dim and kv heads (Gemma 4's full layers: wider)
    kv_heads: int = 0
    reads: int | None = None  # a KV-shared layer: the layer whose cache it reads (it keeps none)
    values_from_keys: bool = False  # its values are its keys' projection (Gemma 4's attention_k_eq_v)
