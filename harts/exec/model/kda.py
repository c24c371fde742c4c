"""KDA (Kimi Delta Attention) layer, Kimi-Linear / fla `KimiDeltaAttention` shaped.

Shapes: T rows, D model dim, H heads, K key head dim, V value head dim, W conv window,
R gate rank.

q/k/v: linear projection, short causal conv + SiLU (through the context), q/k L2-normalised
per head. beta = sigmoid(b_proj x). Forget gate in log space per key channel:
g = -exp(A_log[h]) * softplus(f_proj(x) + dt_bias), f_proj low-rank D -> R -> HK. Output:
RMSNorm(o) * w * sigmoid(g_proj(x)) per head (g_proj low-rank, with a bias unless
`kda_gate_bias` is off), then o_proj.
The convs and the recurrence run through the context (`kda_mixing`: `ctx.short_conv`, `ctx.kda`,
or the context's own fused form), so this module never sees sequence structure.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harts.config.models import ModelConfig
from harts.exec.compiled import region
from harts.exec.model.context import MixingContext
from harts.exec.model.layers import GatedRMSNorm, l2_norm_of


class KDAMixer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads, self.head_k, self.head_v = c.kda_num_heads, c.kda_head_dim, c.kda_head_v_dim
        d, H, K, V, W, R = c.d_model, self.num_heads, self.head_k, self.head_v, c.conv_window, c.gate_rank
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * V, bias=False)
        self.q_conv = nn.Parameter(torch.empty(H * K, W))
        self.k_conv = nn.Parameter(torch.empty(H * K, W))
        self.v_conv = nn.Parameter(torch.empty(H * V, W))
        self.f_proj = nn.Sequential(nn.Linear(d, R, bias=False), nn.Linear(R, H * K, bias=False))
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.g_proj = nn.Sequential(nn.Linear(d, R, bias=False), nn.Linear(R, H * V, bias=c.kda_gate_bias))
        self.o_norm = GatedRMSNorm(V, c.norm_eps, c.norm_float32)
        self.o_proj = nn.Linear(H * V, d, bias=False)

    @torch.no_grad()
    def reset_special_parameters(self) -> None:
        W = self.q_conv.shape[1]
        for w in (self.q_conv, self.k_conv, self.v_conv):
            # nn.Conv1d's default for a depthwise kernel of width W
            w.uniform_(-1 / math.sqrt(W), 1 / math.sqrt(W))
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        # Mamba-style: softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x_TD: Tensor, ctx: MixingContext) -> Tensor:
        T = x_TD.shape[0]
        H, K, V = self.num_heads, self.head_k, self.head_v
        beta_TH = torch.sigmoid(self.b_proj(x_TD))
        o_THV = kda_mixing(ctx, self.layer, self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD),
                           (self.q_conv, self.k_conv, self.v_conv), self.f_proj[0](x_TD),
                           self._gate(getattr(ctx, "kernels", None)), beta_TH, K**-0.5)
        o_THV = self.o_norm(o_THV, self.g_proj(x_TD).view(T, H, V), ctx)
        return self.o_proj(o_THV.reshape(T, H * V))

    def forget_gate(self, f_TR: Tensor) -> Tensor:
        """g_THK = -exp(A_log) * softplus(f_proj's second half (f_TR) + dt_bias), per row."""
        return kda_gate(self.f_proj[1](f_TR), self.dt_bias, self.A_log, self.num_heads, self.head_k)

    def _gate(self, kernels) -> Callable[[Tensor], Tensor]:
        """`forget_gate`, its elementwise part (`kda_gate`) under torch.compile where
        `kernels.compile` asks for it (`harts.exec.compiled.region`)."""
        gate = region(kda_gate, kernels, self.f_proj[1].weight, self.dt_bias, self.A_log)
        if gate is kda_gate:
            return self.forget_gate
        return lambda f_TR: gate(self.f_proj[1](f_TR), self.dt_bias, self.A_log, self.num_heads, self.head_k)


def kda_gate(proj_TX: Tensor, dt_bias: Tensor, A_log: Tensor, H: int, K: int) -> Tensor:
    """g_THK = -exp(A_log) * softplus(proj + dt_bias) per row and head, from the gate's
    second low-rank projection's output proj_TX ([T, H K])."""
    f_THK = proj_TX.view(proj_TX.shape[0], H, K) + dt_bias.view(H, K)
    return -torch.exp(A_log).view(H, 1) * F.softplus(f_THK)


def kda_mixing(ctx: MixingContext, layer: int, q_TD: Tensor, k_TD: Tensor, v_TD: Tensor,
               convs: tuple[Tensor, Tensor, Tensor], gate_TR: Tensor, gate: Callable[[Tensor], Tensor],
               beta_TH: Tensor, scale: float) -> Tensor:
    """o_THV of the KDA layer's mixing from its projections: SiLU short conv of q, k and v
    (weights `convs`, [D, W] each), q and k L2-normalised per head, the forget gate
    g_THK = gate(gate_TR) (a per-row map of the gate's low-rank features), then the recurrence.

    A context may run this its own way by defining `kda_mixing` with this signature (less
    `ctx`) and the same result; it returns None to take this plain path (`ctx.short_conv`
    three times, then `ctx.kda`). The tree context uses it to write the convs' outputs
    straight in its KDA rounds' order and to gather the gate's narrow features rather than
    g (`TreeContext.kda_mixing`)."""
    own = getattr(ctx, "kda_mixing", None)
    o_THV = own(layer, q_TD, k_TD, v_TD, convs, gate_TR, gate, beta_TH, scale) if own is not None else None
    if o_THV is not None:
        return o_THV
    g_THK = gate(gate_TR)
    T, H, K = g_THK.shape
    q_THK = ctx.short_conv(layer, "q", q_TD, convs[0], None).view(T, H, K)
    k_THK = ctx.short_conv(layer, "k", k_TD, convs[1], None).view(T, H, K)
    v_THV = ctx.short_conv(layer, "v", v_TD, convs[2], None).view(T, H, -1)
    q_THK, k_THK = l2_norm_of(q_THK, ctx), l2_norm_of(k_THK, ctx)
    return ctx.kda(layer, q_THK, k_THK, v_THV, g_THK, beta_TH, scale)
