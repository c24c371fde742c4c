"""Gated DeltaNet layer, Qwen3-Next's `linear_attention` as its checkpoint stores it.

Shapes: T rows, D model dim, Hk q/k heads, Hv value heads (r = Hv / Hk per q/k head),
K key head dim, V value head dim, C = 2 Hk K + Hv V conv channels, W conv window.

in_proj_qkvz x is laid out per q/k head group: [q (K) | k (K) | v (r V) | z (r V)] for each
of the Hk groups, and in_proj_ba x as [b (r) | a (r)] per group (the checkpoint's order,
so weights load as they are). q, k, v are concatenated head-major as [q | k | v] (C
channels) and go through one causal depthwise conv + SiLU (`ctx.short_conv`); q and k are
L2-normalised per head and each q/k head is repeated for its r value heads. beta =
sigmoid(b); the decay is one scalar per value head, g = -exp(A_log) softplus(a + dt_bias).
The output is RMSNorm(o) * w * SiLU(z) per value head, then out_proj.

The recurrence runs through `ctx.kda` with g broadcast along K: the gated delta rule with
a per-head scalar decay is the KDA recurrence with a decay that is constant along the key
channels (`harts.exec.ops.gdn.naive`), so in a tree GDN layers get KDA's chunk-aligned
replay, boundary-state handoff and minimum-call planner unchanged, and the expanded
baseline runs the same kernels (tree and expanded stay bit-comparable).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harts.config.models import ModelConfig
from harts.exec.model.context import MixingContext
from harts.exec.model.layers import SiLUGatedRMSNorm, l2_norm_of


class GDNMixer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer = layer
        self.hk, self.hv = c.gdn_num_k_heads, c.gdn_num_v_heads
        self.head_k, self.head_v = c.gdn_head_k_dim, c.gdn_head_v_dim
        d, Hk, Hv, K, V, W = c.d_model, self.hk, self.hv, self.head_k, self.head_v, c.conv_window
        self.conv_dim = 2 * Hk * K + Hv * V
        self.in_proj_qkvz = nn.Linear(d, 2 * Hk * K + 2 * Hv * V, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * Hv, bias=False)
        self.conv = nn.Parameter(torch.empty(self.conv_dim, W))  # the checkpoint's conv1d.weight [C, 1, W]
        self.dt_bias = nn.Parameter(torch.empty(Hv))
        self.A_log = nn.Parameter(torch.empty(Hv))
        self.norm = SiLUGatedRMSNorm(V, c.norm_eps, c.norm_float32)
        self.out_proj = nn.Linear(Hv * V, d, bias=False)

    @torch.no_grad()
    def reset_special_parameters(self) -> None:
        W = self.conv.shape[1]
        self.conv.uniform_(-1 / math.sqrt(W), 1 / math.sqrt(W))  # nn.Conv1d's default, depthwise
        self.dt_bias.fill_(1.0)  # Qwen3-Next's initialisation
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())

    def forward(self, x_TD: Tensor, ctx: MixingContext) -> Tensor:
        T = x_TD.shape[0]
        Hk, Hv, K, V = self.hk, self.hv, self.head_k, self.head_v
        r = Hv // Hk
        q, k, v, z = self.in_proj_qkvz(x_TD).view(T, Hk, 2 * K + 2 * r * V).split([K, K, r * V, r * V], dim=-1)
        b, a = self.in_proj_ba(x_TD).view(T, Hk, 2 * r).split([r, r], dim=-1)
        mixed_TC = torch.cat([q.reshape(T, Hk * K), k.reshape(T, Hk * K), v.reshape(T, Hv * V)], dim=-1)
        mixed_TC = ctx.short_conv(self.layer, "qkv", mixed_TC, self.conv, None)
        q_TC, k_TC, v_TC = mixed_TC.split([Hk * K, Hk * K, Hv * V], dim=-1)
        q_THK = l2_norm_of(q_TC.reshape(T, Hk, K), ctx).repeat_interleave(r, dim=1)
        k_THK = l2_norm_of(k_TC.reshape(T, Hk, K), ctx).repeat_interleave(r, dim=1)
        v_THV = v_TC.reshape(T, Hv, V)
        beta_TH = torch.sigmoid(b.reshape(T, Hv))
        g_TH = -torch.exp(self.A_log) * F.softplus(a.reshape(T, Hv) + self.dt_bias)
        g_THK = g_TH[:, :, None].expand(T, Hv, K).contiguous()
        o_THV = ctx.kda(self.layer, q_THK, k_THK, v_THV, g_THK, beta_TH, K**-0.5)
        o_THV = self.norm(o_THV, z.reshape(T, Hv, V), ctx)
        return self.out_proj(o_THV.reshape(T, Hv * V))
