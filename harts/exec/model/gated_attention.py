"""Gated full attention, Qwen3-Next's `full_attention` as its checkpoint stores it.

Shapes: T rows, D model dim, H query heads, G key/value heads (GQA, H / G queries per
key/value head), E head dim, R rotated channels (partial RoPE).

q_proj x gives per head [query (E) | gate (E)]; query and key are RMS-normalised per head
(zero-centred weights when `norm_offset`), their first R channels rotated (rotate-half
RoPE, position = the row's depth in its tree, `ctx.position_ids`), keys and values repeated
for the query heads they serve; attention runs through `ctx.attention` (same head count for
q, k, v there); the output is multiplied by sigmoid(gate) and projected by o_proj.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from harts.config.models import ModelConfig
from harts.exec.model.context import MixingContext
from harts.exec.model.layers import OffsetRMSNorm, RMSNorm, apply_rope


class GatedAttentionMixer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.attn_num_heads, c.attn_num_kv_heads, c.attn_head_dim
        self.rotary_dim, self.rope_theta = c.attn_rotary_dim, c.rope_theta
        d, H, G, E = c.d_model, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(d, 2 * H * E, bias=False)
        self.k_proj = nn.Linear(d, G * E, bias=False)
        self.v_proj = nn.Linear(d, G * E, bias=False)
        self.o_proj = nn.Linear(H * E, d, bias=False)
        norm = OffsetRMSNorm if c.norm_offset else RMSNorm
        self.q_norm = norm(E, c.norm_eps, c.norm_float32)
        self.k_norm = norm(E, c.norm_eps, c.norm_float32)

    def _rope(self, x_THE: Tensor, position_ids: Tensor) -> Tensor:
        R = self.rotary_dim
        if R == 0:
            return x_THE
        return torch.cat([apply_rope(x_THE[..., :R], position_ids, self.rope_theta), x_THE[..., R:]], dim=-1)

    def forward(self, x_TD: Tensor, ctx: MixingContext) -> Tensor:
        T, H, G, E = x_TD.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        query_THE, gate_THE = self.q_proj(x_TD).view(T, H, 2 * E).chunk(2, dim=-1)
        q_THE = self._rope(self.q_norm(query_THE, ctx), ctx.position_ids)
        k_TGE = self._rope(self.k_norm(self.k_proj(x_TD).view(T, G, E), ctx), ctx.position_ids)
        v_TGE = self.v_proj(x_TD).view(T, G, E)
        if G != H:
            k_TGE, v_TGE = (t.repeat_interleave(H // G, dim=1) for t in (k_TGE, v_TGE))
        o_THE = ctx.attention(self.layer, q_THE.contiguous(), k_TGE.contiguous(), v_TGE.contiguous(), E**-0.5)
        o_TD = o_THE.reshape(T, H * E) * torch.sigmoid(gate_THE.reshape(T, H * E))
        return self.o_proj(o_TD)
