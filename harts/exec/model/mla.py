"""MLA (multi-head latent attention) layer, DeepSeek-V2 / Kimi-Linear shaped.

Shapes: T rows, D model dim, H heads, C KV latent rank, N no-RoPE qk head dim, R decoupled
(RoPE) key dim, E value head dim.

Keys and values come from a low-rank latent: kv_a_proj x -> [c_kv (C) | k_pe (R)],
c_kv is RMS-normalised and expanded by kv_b_proj into per-head k_nope (N) and v (E); the
decoupled key k_pe (R) is shared by all heads. q is full rank or low rank (q_lora_rank).
With `use_rope` the R-dim parts of q and k are rotated by the row's depth; without it
(Kimi-Linear) they are plain extra channels. Rows mix only in `ctx.attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from harts.config.models import ModelConfig
from harts.exec.model.context import MixingContext
from harts.exec.model.layers import RMSNorm, apply_rope


class MLAMixer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads = H = c.mla_num_heads
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_rank = c.kv_lora_rank
        self.use_rope, self.rope_theta = c.use_rope, c.rope_theta
        d, qk = c.d_model, self.nope + self.rope
        eps = c.norm_eps if c.mla_norm_eps is None else c.mla_norm_eps
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(c.q_lora_rank, eps, c.norm_float32)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj = nn.Linear(d, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, eps, c.norm_float32)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    def forward(self, x_TD: Tensor, ctx: MixingContext) -> Tensor:
        T, H, N, R, E = x_TD.shape[0], self.num_heads, self.nope, self.rope, self.v_dim
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_TD)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_TD), ctx))
        q_THQ = q.view(T, H, N + R)
        ckv_TC, k_pe_TR = self.kv_a_proj(x_TD).split([self.kv_rank, R], dim=-1)
        kv_TH2 = self.kv_b_proj(self.kv_a_norm(ckv_TC, ctx)).view(T, H, N + E)
        k_nope_THN, v_THE = kv_TH2.split([N, E], dim=-1)
        k_pe_T1R = k_pe_TR.unsqueeze(1)
        if self.use_rope:
            q_THQ = torch.cat(
                [q_THQ[..., :N], apply_rope(q_THQ[..., N:], ctx.position_ids, self.rope_theta)], dim=-1
            )
            k_pe_T1R = apply_rope(k_pe_T1R, ctx.position_ids, self.rope_theta)
        k_THQ = torch.cat([k_nope_THN, k_pe_T1R.expand(T, H, R)], dim=-1)
        o_THE = ctx.attention(self.layer, q_THQ, k_THQ, v_THE.contiguous(), (N + R) ** -0.5)
        return self.o_proj(o_THE.reshape(T, H * E))
