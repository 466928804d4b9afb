"""The decoder families tk reads, as one table: how each Hugging Face architecture's config.json
becomes a `DecoderConfig` (models/spec/config.py). An architecture is a row of `FAMILIES` (fixed fields,
which config keys it reads, how its layers slide, its experts' tensor names) plus, where the
translation is more than a lookup, a small reader function the row names. Nothing here knows about
weights or graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tk.models.checkpoint import readers
from tk.models.spec.config import DecoderConfig, UnsupportedModelError


@dataclass(frozen=True)
class ExpertNames:
    """Where a mixture-of-experts checkpoint keeps an MoE layer's tensors: model.layers.N.{block}.{router}
    (the router), .experts.E.{gate,up,down}, or, `stacked`, {block}.{gate} and {block}.{down} holding every
    expert ([experts, rows, hidden]: gate and up in one); a shared expert at `shared` (its gate at
    `shared_gate`, Qwen2-MoE; or `shared_fused` names its fused pair, Granite 4.0-H)."""

    block: str
    gate: str
    up: str
    down: str
    router: str = "gate"
    stacked: bool = False
    shared: str = "mlp.shared_expert."
    shared_gate: str = "mlp.shared_expert_gate"
    shared_fused: tuple[str, str] | None = None
    # stacked tensors' names end in these (gpt-oss: "" and "_bias"); `transposed`: each expert's matrix is stored
    # [in, out]; `interleaved`: gate and up rows alternate (gpt-oss: g0, u0, g1, u1, ...)
    suffixes: tuple[str, str] = (".weight", ".bias")
    transposed: bool = False
    interleaved: bool = False


MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
GRANITE_EXPERTS = ExpertNames("block_sparse_moe", "input_linear", "", "output_linear", router="router.layer",
                              stacked=True, shared="shared_mlp.", shared_fused=("input_linear", "output_linear"))
GPT_OSS_EXPERTS = ExpertNames("mlp", "experts.gate_up_proj", "", "experts.down_proj", router="router", stacked=True,
                              suffixes=("", "_bias"), transposed=True, interleaved=True)


@dataclass(frozen=True)
class Names:
    """Where a family keeps one layer's tensors (under {prefix}layers.N.), where they are not Llama's."""

    norms: dict | None = None  # our block norms -> theirs (None: by norm placement)
    attn: str = "self_attn."
    o_proj: str = "o_proj"
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"
    mlp: str = "mlp."
    ffn: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_ffn: tuple[str, str] | None = None  # (gate and up in one, down): Granite 4.0-H's dense shared_mlp
    final_norm: str = "norm"
    mixer: str = ""  # a recurrent layer's module: conv. (LFM2), linear_attn. (Qwen3.5), mamba. (Granite 4.0-H)
    gdn_grouped: bool = False  # Qwen3-Next: in_proj_qkvz and in_proj_ba interleaved by key head


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
    # the rope scaling applies to the full-attention layers alone (OLMo 3's v4-style rope_scaling): without a
    # table of their own, sliding layers get the unscaled one
    scaled_full_only: bool = False
    moe: Callable[[dict, int], dict] | None = None  # the experts' DecoderConfig fields from config.json
    experts: ExpertNames | None = None  # their tensors' names
    refuse: dict = field(default_factory=dict)  # HF key -> why a true value is not supported
    # a multimodal checkpoint (Gemma 3 4B and up): the decoder's config is config.json's text_config, of
    # this transformers model_type; its tensors sit under `prefix`, beside other towers' (`ignore`)
    text_config: str | None = None
    prefix: str = "model."
    lm_head: str = "lm_head.weight"
    ignore: tuple[str, ...] = ()
    names: Names = Names()  # its tensors' names, where not Llama's
    hybrid: Callable[[dict], dict] | None = None  # a hybrid's mixers: their DecoderConfig fields from config.json
    fields: Callable[[dict], dict] | None = None  # more of its own fields from config.json (Gemma 4's)


_GRANITE_FLOATS = {"embedding_multiplier": ("embedding_multiplier", 1.0),
                   "residual_multiplier": ("residual_multiplier", 1.0),
                   "attention_scale": ("attention_multiplier", 1.0),  # GraniteConfig's default: 1, not 1/sqrt(D)
                   "logits_scaling": ("logits_scaling", 1.0)}
_GEMMA = {"norm_offset": 1.0, "embed_scale": True}
_GEMMA_2_3 = dict(hf_act="hidden_activation", tied=True, sliding="layer-types", pre_attn_scalar=True)
# Gemma 4: plain-weight norms (not 1 + w), q/k norms per head and values normed too, a softmax scale of 1, the
# sliding layers' own RoPE table and the full layers' wider heads, KV-shared layers, per-layer inputs (readers.gemma4)
_GEMMA_4 = dict(fixed={"embed_scale": True, "norm_placement": "sandwich", "qk_norm": "head", "value_norm": True,
                       "attention_scale": 1.0}, hf_act="hidden_activation", tied=True, sliding="layer-types",
                layer_types=readers.gemma4_layer_types, softcaps=("final",), local_rope=True, fields=readers.gemma4)

# Qwen3.5 (gated DeltaNet, gated attention, (1 + w) norms) as users have it: text-only, image-text (its text
# model: tensors under model.language_model., beside the vision tower and the multi-token-prediction head tk
# ignores), with experts (Qwen3.5-MoE), and Qwen3-Next (experts, its DeltaNet projections grouped by key head)
_QWEN35 = dict(fixed={"norm_offset": 1.0, "qk_norm": "head", "attn_output_gate": True}, hf_bias="attention_bias",
               hybrid=readers.hybrid_qwen35)
_QWEN35_TEXT = dict(prefix="model.language_model.", ignore=("model.visual.", "mtp."))
_QWEN35_ROWS = {
    "Qwen3_5ForCausalLM": dict(names=Names(mixer="linear_attn."), ignore=("model.visual.", "mtp.")),
    "Qwen3_5ForConditionalGeneration": dict(names=Names(mixer="linear_attn."), text_config="qwen3_5_text",
                                            **_QWEN35_TEXT),
    "Qwen3_5MoeForCausalLM": dict(names=Names(mixer="linear_attn."), moe=readers.moe_qwen35, experts=QWEN_EXPERTS,
                                  ignore=("model.visual.", "mtp.")),
    "Qwen3_5MoeForConditionalGeneration": dict(names=Names(mixer="linear_attn."), moe=readers.moe_qwen35, experts=QWEN_EXPERTS,
                                               text_config="qwen3_5_moe_text", **_QWEN35_TEXT),
    "Qwen3NextForCausalLM": dict(names=Names(mixer="linear_attn.", gdn_grouped=True), moe=readers.moe_qwen,
                                 experts=QWEN_EXPERTS, ignore=("mtp.",)),
}

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(fixed={}, hf_bias="attention_bias"),
    "MistralForCausalLM": Family(fixed={}, sliding="always"),
    "Qwen2ForCausalLM": Family(fixed={"qkv_bias": True}, sliding="opt-in"),
    "Qwen3ForCausalLM": Family(fixed={"qk_norm": "head"}, hf_bias="attention_bias", sliding="opt-in"),
    "Phi3ForCausalLM": Family(fixed={"fused_projections": True}, sliding="always"),
    "GemmaForCausalLM": Family(fixed=_GEMMA, hf_act="hidden_activation", tied=True),
    "Gemma2ForCausalLM": Family(fixed={**_GEMMA, "norm_placement": "sandwich"}, **_GEMMA_2_3,
                                layer_types=readers.gemma_layer_types(None, 2), softcaps=("attn", "final")),
    # attn_logit_softcapping is ignored by Gemma3's attention (docs/families.md, section 3)
    "Gemma3ForCausalLM": Family(fixed={**_GEMMA, "norm_placement": "sandwich", "qk_norm": "head"}, **_GEMMA_2_3,
                                layer_types=readers.gemma_layer_types("sliding_window_pattern", 6), softcaps=("final",),
                                local_rope=True, refuse={"use_bidirectional_attention": "bidirectional attention"}),
    # the text of Gemma 3's image-text checkpoints (4B, 12B, 27B), which never softcaps its logits
    "Gemma3ForConditionalGeneration": Family(
        fixed={**_GEMMA, "norm_placement": "sandwich", "qk_norm": "head"}, **_GEMMA_2_3,
        layer_types=readers.gemma_layer_types("sliding_window_pattern", 6), local_rope=True,
        refuse={"use_bidirectional_attention": "bidirectional attention"}, text_config="gemma3_text",
        prefix="language_model.model.", lm_head="language_model.lm_head.weight",
        ignore=("vision_tower.", "multi_modal_projector.")),
    "Gemma4ForCausalLM": Family(**_GEMMA_4),
    # the text of Gemma 4's image-text (and audio) checkpoints, which users want alone
    "Gemma4ForConditionalGeneration": Family(**_GEMMA_4, text_config="gemma4_text", prefix="model.language_model.",
                                             ignore=("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                                                     "model.embed_audio.")),
    "GraniteForCausalLM": Family(fixed={}, hf_bias="attention_bias", hf_floats=_GRANITE_FLOATS),
    "Olmo2ForCausalLM": Family(fixed={"qk_norm": "projection", "norm_placement": "post"}, hf_bias="attention_bias"),
    # OLMo 2's post-norms and projection-wide q/k norms, three sliding layers to one full
    "Olmo3ForCausalLM": Family(fixed={"qk_norm": "projection", "norm_placement": "post"}, hf_bias="attention_bias",
                               sliding="layer-types", layer_types=readers.gemma_layer_types(None, 4), local_rope=True,
                               scaled_full_only=True),
    # sinks, biased attention, every second layer sliding, YaRN, experts with a router bias and a clamped SwiGLU
    # (their tensors stacked, transposed, gate and up interleaved; MXFP4 checkpoints' blocks and scales:
    # models/checkpoint/mxfp4.py)
    "GptOssForCausalLM": Family(fixed={"attention_sinks": True, "router_bias": True, "routing": "topk_softmax",
                                       "mlp_bias": True}, hf_bias="attention_bias", sliding="layer-types",
                                layer_types=readers.gemma_layer_types(None, 2), moe=readers.moe_gpt_oss,
                                experts=GPT_OSS_EXPERTS),
    "SmolLM3ForCausalLM": Family(fixed={}, hf_bias="attention_bias", sliding="layer-types", tied=True,
                                 layer_types=readers.smollm3_layer_types, sliding_gate="use_sliding_window",
                                 no_rope_layers=True),
    "MixtralForCausalLM": Family(fixed={}, sliding="always", moe=readers.moe_mixtral, experts=MIXTRAL_EXPERTS),
    "Qwen2MoeForCausalLM": Family(fixed={"qkv_bias": True}, sliding="opt-in", moe=readers.moe_qwen, experts=QWEN_EXPERTS),
    "Qwen3MoeForCausalLM": Family(fixed={"qk_norm": "head"}, hf_bias="attention_bias", sliding="opt-in", moe=readers.moe_qwen,
                                  experts=QWEN_EXPERTS),
    # the hybrids: layers whose state is not a KV cache (models/reference/recurrent.py)
    "Lfm2ForCausalLM": Family(fixed={"qk_norm": "head"}, tied=True, hybrid=readers.hybrid_lfm2, names=Names(
        norms={"attn_norm": "operator_norm", "ffn_norm": "ffn_norm"}, o_proj="out_proj", q_norm="q_layernorm",
        k_norm="k_layernorm", mlp="feed_forward.", ffn=("w1", "w3", "w2"), final_norm="embedding_norm", mixer="conv.")),
    **{arch: Family(**_QWEN35, **kw) for arch, kw in _QWEN35_ROWS.items()},
    "GraniteMoeHybridForCausalLM": Family(fixed={"shared_expert_gated": False}, hf_bias="attention_bias",
                                          hf_floats=_GRANITE_FLOATS, hybrid=readers.hybrid_granite, experts=GRANITE_EXPERTS,
                                          names=Names(mixer="mamba.", mlp="shared_mlp.",
                                                      fused_ffn=("input_linear", "output_linear"))),
}


def _rope_params(params: dict, hf: dict) -> tuple[float, dict | None, float]:
    params = dict(params)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "proportional":  # Gemma 4: its partial factor is a share of the frequencies, not of the head
        return theta, {"rope_type": rope_type, "partial_rotary_factor": partial, **params}, 1.0
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
        if scaling is not None:  # transformers reads YaRN's `truncate` from the outer dict here: never set, so True
            scaling.pop("truncate", None)
        local_theta, local_scaling, _ = _rope_params(local, hf) if local else (None, None, partial)
        if local_scaling is not None:
            raise UnsupportedModelError(f"rope type {local_scaling['rope_type']!r} on sliding layers is not supported "
                                        "(their RoPE is never scaled in the families tk reads)")
        return theta, scaling, partial, local_theta
    legacy = dict(hf.get("rope_scaling") or {})
    local = hf.get("rope_local_base_freq")
    return (*_rope_params({**legacy, **params}, hf), None if local is None else float(local))


def _text_config(hf: dict, model_type: str) -> dict:
    """A multimodal checkpoint's decoder config: its text_config, every key it leaves out at the default of
    its transformers config class (published Gemma 3 configs name a handful; a generic default, tk's or
    another family's, would be wrong), under the checkpoint's architecture and tying."""
    import transformers  # only here: the nested config's defaults are its class's

    text = dict(hf.get("text_config") or {})
    full = transformers.AutoConfig.for_model(text.pop("model_type", model_type), **text).to_dict()
    tied = hf.get("tie_word_embeddings", full.get("tie_word_embeddings"))
    return {**full, "architectures": hf["architectures"], "tie_word_embeddings": tied}


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
    if fam.text_config:
        hf = _text_config(hf, fam.text_config)
    for key, what in fam.refuse.items():
        if hf.get(key):
            raise UnsupportedModelError(f"{arch} with {key}=true ({what}) is not supported")
    theta, scaling, partial, local_theta = _rope_from_hf(hf)
    if fam.scaled_full_only and local_theta is None and scaling is not None:
        local_theta = theta  # OLMo 3: rope_scaling reaches its full layers only (Olmo3Config.convert_rope_params_to_dict)
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
    for reader in (fam.hybrid, fam.fields):
        if reader is not None:
            fields.update(reader(hf))
    fields.update(fam.fixed)
    if fields["qkv_bias"] and not fam.hf_bias:  # Qwen2: q/k/v biased, o not
        fields["o_bias"] = False
    return DecoderConfig(**fields)
