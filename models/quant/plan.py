"""Which weights a quantized export stores quantized, and each one's scheme (quantize.py stores
them): every projection, the LM head when asked, and the int8 upgrades of `--mixed-precision`.
"""

from __future__ import annotations

from tk.models.quant.quantize import Scheme


def quantized_layers(cfg, lm_head: bool) -> list[str]:
    """Our names of the linear weights a quantized export stores quantized: every projection of
    every layer (each expert's, and a shared expert's, in a mixture of experts; a recurrent layer's
    input and output projections), and the LM head when asked. Embeddings, routers, the shared
    expert's gate (one column) and a recurrent layer's convolution, decay and skip parameters (a few
    numbers per channel or head, which its state compounds token after token) stay in the activation
    dtype."""
    names = []
    for i in range(cfg.num_layers):
        mixer = "attn.wqkv", "attn.wo"
        if cfg.mixer(i) != "attention":
            mixer = "mixer.w_in", "mixer.w_out"
        names += [f"layers.{i}.{w}.weight" for w in mixer]
        ffns = [f"layers.{i}.ffn."]
        if cfg.layer(i).moe:
            ffns = [f"layers.{i}.ffn.experts.{e}." for e in range(cfg.num_experts)]
            ffns += [f"layers.{i}.ffn.shared."] if cfg.shared_expert_size else []
        names += [f + w for f in ffns for w in ("w_gate_up.weight", "w_down.weight")]
    return names + (["lm_head.weight"] if lm_head else [])


def sensitive_layers(num_layers: int) -> list[int]:
    """The layers whose value and down projections cost most when rounded: llama.cpp's Q4_K_M rule
    (`use_more_bits`), as onnxruntime-genai's `mixed_layers` writes it: the first and last eighth of
    the layers and every third one between."""
    n = num_layers
    return [i for i in range(n) if i < n / 8 or i >= 7 * n / 8 or (i - round(n / 8)) % 3 == 2]


def quant_plan(cfg, precision) -> dict[str, Scheme]:
    """Each weight a quantized export stores quantized (our names; `embed.weight` is an untied
    embedding, stored transposed like a linear layer's weight: a tied one is read from the LM
    head's table), with its scheme: the precision's, or int8 where `mixed` keeps it (the LM head
    and embedding for `lm-head`; also the fused QKV and down projections of `sensitive_layers`), the
    LM head and embedding in blocks of `head_block` when given. `lm-head-w8a8` keeps the LM head (and
    its table, a tied embedding) in int8 with a scale a column, rounded to nearest (all K rows one
    block, symmetric), for ONNX Runtime's integer GEMM over inputs rounded to int8 a row at a time."""
    base = Scheme(precision.weights, precision.block_size, precision.method, precision.zero_points)
    int8 = Scheme("int8", base.block, base.method, base.zero_points)
    names = quantized_layers(cfg, precision.quantized_lm_head)
    if precision.quantized_embedding and not cfg.tie_embeddings:
        names.append("embed.weight")
    plan = {name: base for name in names}
    # the LM head (and so a tied embedding, its table): an untied quantized embedding keeps the base scheme, as
    # llama.cpp's Q4_0 and Q4_K_M keep token_embd at 4 bits and raise only the output matrix (a row a token,
    # read once, costs little when rounded; README "Quantized weights" has the measurement)
    upgrade = {"lm_head.weight"} if precision.mixed in ("lm-head", "sensitive") else set()
    if precision.mixed == "lm-head-w8a8" and "lm_head.weight" in plan:
        plan["lm_head.weight"] = Scheme("int8", cfg.hidden_size, "rtn", False, int8_inputs=True)
    if precision.mixed == "sensitive":
        upgrade |= {f"layers.{i}.{w}" for i in sensitive_layers(cfg.num_layers)
                    for w in ("attn.wqkv.weight", "ffn.w_down.weight")}
    plan = {name: int8 if name in upgrade else s for name, s in plan.items()}
    for name in ("lm_head.weight", "embed.weight"):
        if name in plan and precision.head_block:  # (never with lm-head-w8a8: options refuse the pair)
            plan[name] = Scheme(plan[name].bits, precision.head_block, base.method, base.zero_points)
    return plan
