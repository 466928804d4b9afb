"""The layers whose state is not a KV cache, and their math as pure functions over tensors.

- `ShortConv` (LFM2): a gated depthwise causal convolution, B * x convolved, times C;
- `GatedDeltaNet` (Qwen3.5, Qwen3-Next): a convolution over q, k, v, then the gated delta rule
  S_t = e^g_t S_{t-1} + beta_t k_t (v_t - e^g_t S_{t-1}^T k_t)^T, read as o_t = S_t^T q_t, and a gated
  RMSNorm on the output;
- `Mamba2` (Granite 4.0-H): a convolution over x, B and C, then the gated rule S_t = e^(dt_t A) S_{t-1}
  + B_t (dt_t x_t)^T, read as y_t = S_t^T C_t + D x_t, and a gated, grouped RMSNorm.

Each carries its convolution's last inputs (`causal_conv`: k - 1 positions) and, but the
convolution, a matrix per head (`linear_attention`: d_k x d_v, ONNX LinearAttention's layout).
The state comes in and goes out as tensors, exactly the graph contract's (models/spec/contract.py).

`linear_attention` computes a run of tokens in closed form, no loop over them: the state's read and
update are matmuls, and the delta rule's triangular system (the "UT transform" of DeltaNet's
chunked form) is solved by inverting a unit lower triangular matrix by blocks of doubling size
(`unit_lower_inverse`: log2(STATE_RUN) steps of batched matmuls, as stable as forward
substitution). So a run is a graph of standard ONNX ops with no control flow; eager PyTorch runs
longer sequences in runs of STATE_RUN, the state carried between them. What carries state across
runs is exactly what carries it across decode steps: prefill in chunks equals prefill whole.
Every reader of a state input is an ancestor of the state's output, so a runtime may update the
state in place (exporters/ checks it on the written graph).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tk.models.spec.config import DecoderConfig
from tk.models.spec.contract import STATE_RUN


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution continuing from its carry: x (B, C, T), weight (C, 1, k), state
    (B, C, k - 1): the inputs before x -> (y (B, C, T), the new carry: the last k - 1 inputs)."""
    full = torch.cat([state.to(x.dtype), x], dim=-1)  # (B, C, k - 1 + T)
    y = F.conv1d(full, weight, bias, groups=x.shape[1])  # (B, C, T)
    return (F.silu(y) if silu else y), full[:, :, 1 - weight.shape[-1]:]


def unit_lower_inverse(a: torch.Tensor, n: int = STATE_RUN) -> torch.Tensor:
    """(I + a)^-1 for `a` (..., T, T) strictly lower triangular, T <= n a power of two's bound: `a` is
    padded to n x n and inverted by blocks of doubling size ([[A, 0], [C, B]]^-1 = [[A^-1, 0],
    [-B^-1 C A^-1, B^-1]]), then cut back to T x T."""
    T = a.shape[-1]
    lead = a.shape[:-2]
    a = F.pad(a, (0, n - T, 0, n - T))  # (..., n, n)
    inv = torch.ones(*lead, n, 1, 1, dtype=a.dtype, device=a.device)  # the 1 x 1 diagonal blocks of the inverse
    s = 1
    while s < n:
        m = n // s  # blocks of size s along each side
        blocks = a.reshape(*lead, m, s, m, s).transpose(-3, -2)  # (..., m, m, s, s): block (i, j)
        flat = blocks.reshape(*lead, m * m, s, s)
        # the sub-diagonal block of each 2s-block on the diagonal: (2b + 1, 2b)
        below = flat.index_select(-3, torch.arange(m // 2, device=a.device) * (2 * m + 2) + m)  # (..., m/2, s, s)
        upper, lower = inv[..., 0::2, :, :], inv[..., 1::2, :, :]  # (..., m/2, s, s) each
        corner = -(lower @ below @ upper)
        zeros = torch.zeros_like(corner)
        inv = torch.cat([torch.cat([upper, zeros], -1), torch.cat([corner, lower], -1)], -2)  # (..., m/2, 2s, 2s)
        s *= 2
    return inv.reshape(*lead, n, n)[..., :T, :T]


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated rule (beta None: Mamba2) or the gated delta rule over a run of tokens, in float32:
    q, k (B, H, T, dk), v (B, H, T, dv), state (B, H, dk, dv), decay (B, H, T) (log space, <= 0), beta
    (B, H, T) -> (o (B, H, T, dv), the new state). Eager PyTorch takes any T, in runs of STATE_RUN; an
    exported graph takes runs of at most STATE_RUN (or, with the gated rule, any)."""
    q, k, v, state, decay = (t.float() for t in (q, k, v, state, decay))
    beta = None if beta is None else beta.float()
    T = q.shape[2]
    if torch.compiler.is_exporting() or T <= STATE_RUN:
        return _run(q * scale, k, v, state, decay, beta)
    outs = []
    for start in range(0, T, STATE_RUN):
        part = slice(start, start + STATE_RUN)
        o, state = _run(q[:, :, part] * scale, k[:, :, part], v[:, :, part], state, decay[:, :, part],
                        None if beta is None else beta[:, :, part])
        outs.append(o)
    return torch.cat(outs, dim=2), state


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): sum of g over (j, i] at [i, j] for i >= j, -inf above. Summed term by term
    (Mamba2's segsum), not as a difference of cumulative sums, which a long run of strong decay (or a
    left-padded prompt's padding) would round away."""
    T = g.shape[-1]
    below = torch.ones(T, T, dtype=torch.bool, device=g.device).tril(-1)
    terms = g[..., :, None].expand(*g.shape, T).masked_fill(~below, 0.0)  # [i, j] = g_i where i > j
    return terms.cumsum(-2).masked_fill(~below.logical_or(torch.eye(T, dtype=torch.bool, device=g.device)),
                                        float("-inf"))


def _run(q, k, v, state, g, beta):
    """One run in closed form (the chunked algorithm with the run as its one chunk)."""
    T = q.shape[2]
    cum = g.cumsum(-1)  # (B, H, T): log of the decay from the run's start through each token
    seg = segment_sums(g)  # (B, H, T, T): log of the decay from token j to token i
    pair = seg.exp()  # i >= j, else 0
    reads = [q * cum.exp()[..., None]]  # what reads the state: queries decayed from the run's start
    if beta is not None:  # the delta rule: each token's value corrected by what the state already predicts
        kb = k * beta[..., None]
        strict = ((kb @ k.transpose(-1, -2)) * pair).tril(-1)  # (B, H, T, T)
        inv = unit_lower_inverse(strict)
        v = inv @ (v * beta[..., None])  # (B, H, T, dv)
        reads.insert(0, inv @ (kb * cum.exp()[..., None]))  # (B, H, T, dk)
    read = torch.cat(reads, dim=2) @ state  # one reader of the state: (B, H, T or 2T, dv)
    if beta is not None:
        v = v - read[:, :, :T]
    last = cum[..., -1:]  # (B, H, 1)
    o = read[:, :, -T:] + ((q @ k.transpose(-1, -2)) * pair) @ v  # (B, H, T, dv)
    if beta is None:  # the gated rule's only reader does not feed the state: make the update wait for it
        v = v + 0 * read.sum((-2, -1), keepdim=True)
    new = state * last.exp()[..., None] + (k * seg[..., -1, :].exp()[..., None]).transpose(-1, -2) @ v
    return o, new


class Kernels(NamedTuple):
    """The two steps a recurrent layer runs on its state: `conv` (causal_conv's signature) and `attend`
    (linear_attention's). The reference's are the functions above; --target ort's are ONNX Runtime's
    fused kernels (models/reference/ort_kernels.py), which take the same tensors."""

    conv: Callable
    attend: Callable


REFERENCE = Kernels(causal_conv, linear_attention)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as flash-linear-attention (and transformers) computes it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _depthwise(channels: int, kernel: int, bias: bool):
    """A depthwise convolution's weight (C, 1, k) and bias (C) or None, as plain parameters."""
    return nn.Parameter(torch.zeros(channels, 1, kernel)), nn.Parameter(torch.zeros(channels)) if bias else None


def _repeat(t: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, S, G, d) -> (B, S, G * rep, d), each group's head repeated for the heads it serves (none: as it is)."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=2)


def _zeros_like_state(x: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(x.shape[0], *shape, dtype=dtype, device=x.device)


def _masked(x: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Padding tokens' inputs zeroed (transformers' apply_mask_to_padding_states): a left-padded row's
    state stays zero until its first real token."""
    return x if token_mask is None else x * token_mask[:, :, None].to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x gated by silu(z), in float32: over each group of `group` channels, scaled by its
    weight (no offset); the gate before the norm (Mamba2) or after it (the gated DeltaNet)."""

    def __init__(self, dim: int, eps: float, group: int, gate_first: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.group, self.gate_first = eps, group, gate_first

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # (..., dim) each
        dtype, h, gate = x.dtype, x.float(), F.silu(z.float())
        if self.gate_first:
            h = h * gate
        lead = h.shape[:-1]
        if self.group != h.shape[-1]:  # (one RMSNormalization node in the graph, over each group)
            h = h.reshape(*lead, -1, self.group)
        h = F.rms_norm(h, (self.group,), None, self.eps).reshape(*lead, -1)
        if self.gate_first:
            return self.weight * h.to(dtype)
        return (self.weight.float() * h.to(dtype).float() * gate).to(dtype)


class ShortConv(nn.Module):
    """LFM2's token mixer: B, C, x = in_proj(x); y = C * conv(B * x), out_proj(y). State: the carry."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        C = cfg.hidden_size
        self.w_in = nn.Linear(C, 3 * C, bias=cfg.conv_bias)
        self.conv_weight, self.conv_bias = _depthwise(C, cfg.conv_kernel, cfg.conv_bias)
        self.w_out = nn.Linear(C, C, bias=cfg.conv_bias)
        self.state_shape = ((C, cfg.conv_kernel - 1),)

    def forward(self, x, token_mask, past, kernels: Kernels = REFERENCE):
        carry = past[0] if past is not None else _zeros_like_state(x, self.state_shape[0], x.dtype)
        b, c, h = self.w_in(_masked(x, token_mask)).transpose(1, 2).chunk(3, dim=1)  # (B, C, S) each
        y, carry = kernels.conv(b * h, self.conv_weight, self.conv_bias, carry, False)
        return self.w_out((c * y).transpose(1, 2)), (carry,)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's and Qwen3-Next's linear attention. One input projection (rows: q, k, v, z, b, a),
    the convolution (silu) over q, k, v, q and k l2-normed and repeated to the value heads, the
    gated delta rule with beta = sigmoid(b) and decay -exp(A_log) * softplus(a + dt_bias), the
    output RMS-normed per head and gated by silu(z), out_proj."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.hk, self.hv, self.dk, self.dv = (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
                                              cfg.linear_value_dim)
        self.conv_dim = cfg.gdn_conv_channels
        value = self.hv * self.dv
        self.splits = [self.conv_dim, value, self.hv, self.hv]  # the convolved q, k, v; z; b; a
        self.w_in = nn.Linear(cfg.hidden_size, sum(self.splits), bias=False)
        self.conv_weight, self.conv_bias = _depthwise(self.conv_dim, cfg.conv_kernel, False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        # (not "norm.weight": that suffix is an RMSNorm's, whose offset the writer adds; this one has none)
        self.norm_gated = GatedRMSNorm(self.dv, cfg.rms_norm_eps, self.dv, gate_first=False)
        self.w_out = nn.Linear(value, cfg.hidden_size, bias=False)
        self.state_shape = ((self.conv_dim, cfg.conv_kernel - 1), (self.hv, self.dk, self.dv))

    def project(self, x, token_mask):
        """(the convolution's input (B, conv_dim, S), z (B, S, Hv, dv), beta and decay (B, Hv, S) float32)."""
        B, S, _ = x.shape
        mixed, z, b, a = self.w_in(_masked(x, token_mask)).split(self.splits, dim=-1)
        beta = torch.sigmoid(b.float()).transpose(1, 2)
        decay = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())).transpose(1, 2)
        return mixed.transpose(1, 2), z.reshape(B, S, self.hv, self.dv), beta, decay

    def heads(self, mixed):
        """The convolved (B, conv_dim, S) -> q, k l2-normed and repeated to the value heads, and v, each
        (B, Hv, S, d) float32."""
        B, _, S = mixed.shape
        q, k, v = mixed.transpose(1, 2).float().split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], -1)
        rep = self.hv // self.hk
        q, k = (l2norm(_repeat(t.reshape(B, S, self.hk, self.dk), rep)).transpose(1, 2) for t in (q, k))
        return q, k, v.reshape(B, S, self.hv, self.dv).transpose(1, 2)

    def forward(self, x, token_mask, past, kernels: Kernels = REFERENCE):
        carry, state = past if past is not None else (_zeros_like_state(x, self.state_shape[0], x.dtype),
                                                      _zeros_like_state(x, self.state_shape[1], torch.float32))
        mixed, z, beta, decay = self.project(x, token_mask)
        mixed, carry = kernels.conv(mixed, self.conv_weight, self.conv_bias, carry, True)
        q, k, v = self.heads(mixed)
        o, state = kernels.attend(q, k, v, state, decay, beta, self.dk ** -0.5)  # (B, Hv, S, dv)
        return self.finish(o, z), (carry, state)

    def finish(self, o, z):
        """The rule's output (B, Hv, S, dv) float32 -> normed, gated, projected (B, S, C)."""
        B, _, S, _ = o.shape
        y = self.norm_gated(o.transpose(1, 2).to(z.dtype), z)  # (B, S, Hv, dv)
        return self.w_out(y.reshape(B, S, self.hv * self.dv))


class Mamba2(nn.Module):
    """Granite 4.0-H's Mamba2 mixer: in_proj into the gate z, x B C (convolved, silu) and dt; dt =
    softplus(dt + dt_bias) (clamped to mamba_dt_limit), the gated rule with decay dt * A (A =
    -exp(A_log)), keys B, queries C (per group, repeated to the heads) and values dt * x; y + D x,
    gated by silu(z) and RMS-normed per group, out_proj."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.h, self.p, self.n, self.g = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state, cfg.mamba_groups
        inner = self.h * self.p
        self.conv_dim = cfg.mamba_conv_channels
        self.splits = [inner, self.conv_dim, self.h]  # z; x, B, C; dt
        self.w_in = nn.Linear(cfg.hidden_size, sum(self.splits), bias=cfg.mamba_proj_bias)
        self.conv_weight, self.conv_bias = _depthwise(self.conv_dim, cfg.conv_kernel, cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.h))
        self.A_log = nn.Parameter(torch.zeros(self.h))
        self.D = nn.Parameter(torch.ones(self.h))
        self.dt_limit = tuple(cfg.mamba_dt_limit) if cfg.mamba_dt_limit else None
        self.norm_gated = GatedRMSNorm(inner, cfg.rms_norm_eps, inner // self.g, gate_first=True)
        self.w_out = nn.Linear(inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)
        self.state_shape = ((self.conv_dim, cfg.conv_kernel - 1), (self.h, self.n, self.p))

    def project(self, x, token_mask):
        """(z (B, S, inner), the convolution's input (B, conv_dim, S), dt (B, H, S) float32)."""
        z, xbc, dt = self.w_in(_masked(x, token_mask)).split(self.splits, dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.dt_limit is not None:
            dt = dt.clamp(*self.dt_limit)
        return z, xbc.transpose(1, 2), dt.transpose(1, 2)

    def heads(self, xbc, dt, token_mask):
        """The convolved (B, conv_dim, S) -> queries C, keys B (B, H, S, n), values dt x and x (B, H, S, p),
        float32; padding zeroed again (its convolution's bias)."""
        B, _, S = xbc.shape
        xbc = _masked(xbc.transpose(1, 2), token_mask).float()
        x, b, c = xbc.split([self.h * self.p, self.g * self.n, self.g * self.n], dim=-1)
        rep = self.h // self.g
        b, c = (_repeat(t.reshape(B, S, self.g, self.n), rep).transpose(1, 2) for t in (b, c))
        x = x.reshape(B, S, self.h, self.p).transpose(1, 2)  # (B, H, S, p)
        return c, b, x * dt[..., None], x

    def forward(self, x, token_mask, past, kernels: Kernels = REFERENCE):
        carry, state = past if past is not None else (_zeros_like_state(x, self.state_shape[0], x.dtype),
                                                      _zeros_like_state(x, self.state_shape[1], torch.float32))
        z, xbc, dt = self.project(x, token_mask)
        xbc, carry = kernels.conv(xbc, self.conv_weight, self.conv_bias, carry, True)
        c, b, v, xs = self.heads(xbc, dt, token_mask)
        decay = dt * -self.A_log.float().exp()[:, None]  # (B, H, S)
        y, state = kernels.attend(c, b, v, state, decay, None, 1.0)  # (B, H, S, p)
        return self.finish(y, xs, z), (carry, state)

    def finish(self, y, xs, z):
        """The rule's output and x (B, H, S, p) float32 -> + D x, gated and normed, projected (B, S, C)."""
        B, _, S, _ = y.shape
        y = (y + self.D.float()[:, None, None] * xs).transpose(1, 2).reshape(B, S, self.h * self.p)
        return self.w_out(self.norm_gated(y, z).to(z.dtype))


MIXERS = {"conv": ShortConv, "gdn": GatedDeltaNet, "mamba": Mamba2}
