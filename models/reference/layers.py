"""The reference decoder's layers other than attention: RMSNorm, the gated FFN (SwiGLU, GeGLU, gpt-oss's clamped
SwiGLU), the mixture of experts over them, Gemma 4's per-layer input. What a family changes are config fields
(models/spec/config.py): the activation, the FFN's width, the clamp, the router's bias and how it turns logits
into weights. The blocks that hold them are models/reference/decoder.py's; attention is attention.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tk.models.spec.config import DecoderConfig

ACT = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class RMSNorm(nn.Module):
    """Computed in float32 and cast back, scaled by (offset + weight): offset 1 for Gemma."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def scale(self) -> torch.Tensor:
        return self.weight.float() if self.offset == 0 else self.offset + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The scale goes into rms_norm itself: one RMSNormalization node in the graph, no extra Mul.
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).to(x.dtype)


def times(x: torch.Tensor, s: float) -> torch.Tensor:
    """x * s for a Python float s as transformers computes it: in float32, rounded once to x's
    dtype. (Traced as a plain `x * s`, ONNX would multiply by s rounded to half precision first.)"""
    return (x.float() * s).to(x.dtype)


class FeedForward(nn.Module):
    """Gated FFN: SwiGLU (silu) or GeGLU (gelu-tanh), `size` wide (default: intermediate_size). With
    `swiglu_limit` (gpt-oss's experts) the gate is clamped above and up on both sides at the limit, the gate's
    SiLU has a gain (g * sigmoid(alpha * g)) and up is offset by one, as GptOssExperts._apply_gate computes it."""

    def __init__(self, cfg: DecoderConfig, size: int | None = None):
        super().__init__()
        size = size or cfg.intermediate_size
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * size, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACT[cfg.hidden_act]
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        if self.limit is None:
            return self.w_down(self.act(gate) * up)
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.w_down((up + 1) * (gate * torch.sigmoid(times(gate, self.alpha))))


class MoE(nn.Module):
    """A mixture of experts (Mixtral, Qwen2/3-MoE, Qwen3-Next, Granite 4.0-H, gpt-oss): the router's logits (with a
    bias: gpt-oss) become each token's weights for experts_per_token experts: a softmax over all experts in
    float32 then the top k (renormalized to sum to 1 when the family does), or a softmax over the top k logits
    (`routing` "topk_softmax": gpt-oss); each expert runs on its own tokens only, so a step costs the active
    experts, not all of them; plus a shared expert scaled by sigmoid(its gate) (Qwen2-MoE). Experts are plain
    FFNs: one matmul pair each."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.experts_per_token, cfg.renormalize_experts
        self.topk_first = cfg.routing == "topk_softmax"
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        self.experts = nn.ModuleList(FeedForward(cfg, cfg.expert_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_size
        self.shared = FeedForward(cfg, shared) if shared else None
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared and cfg.shared_expert_gated else None

    def routing(self, h: torch.Tensor) -> torch.Tensor:
        """(T, C) -> (E, T): each expert's weight for each token, 0 where the token does not take it."""
        logits = self.router(h)  # (T, E)
        if self.topk_first:  # gpt-oss: the top k logits, then a softmax over them (GptOssTopKRouter)
            top, chosen = logits.topk(self.top_k, dim=-1)  # (T, k)
            weights = F.softmax(top.float(), dim=-1)
            return torch.zeros_like(logits, dtype=torch.float32).scatter(1, chosen, weights).T  # (E, T)
        probs = F.softmax(logits.float(), dim=-1)  # (T, E), over every expert
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (T, k)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, chosen, weights).T  # (E, T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        h = x.reshape(B * S, C)  # (T, C)
        routing = self.routing(h).to(h.dtype)  # (E, T)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = routing[e].nonzero().reshape(-1)  # (n,): the tokens that take expert e (none: nothing runs)
            y = expert(h.index_select(0, rows)) * routing[e].index_select(0, rows)[:, None]  # (n, C)
            out = out.index_put((rows,), out.index_select(0, rows) + y)  # rows are distinct: a plain scatter
        if self.shared is not None:  # scaled by sigmoid(its gate) (Qwen), or added as it is (Granite 4.0-H)
            shared = self.shared(h)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(h)) * shared)
        return out.reshape(B, S, C)


class PerLayerInput(nn.Module):
    """Gemma 4's per-layer input, after the FFN's branch: h + norm(proj(act(gate(h)) * the layer's input))."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.per_layer_input_size, bias=False)
        self.proj = nn.Linear(cfg.per_layer_input_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.act = ACT[cfg.hidden_act]

    def forward(self, h: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:  # (B, S, C), (B, S, P)
        return h + self.norm(self.proj(self.act(self.gate(h)) * per_layer))
