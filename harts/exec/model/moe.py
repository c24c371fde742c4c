"""Top-k mixture of experts with shared experts, weighted routing statistics.

Shapes: T rows, D model dim, E routed experts, k top-k, F expert FFN dim, L layers.

Routing is per row and deterministic: router logits -> scores (softmax, or sigmoid as in
DeepSeek-V3 / Kimi), the k highest scores pick the experts and are renormalised to sum to
one. A row therefore routes identically wherever it is computed, and a compact tree row
that stands for q_r trajectory tokens is routed once and counted q_r times through
`ctx.row_weight`:

    f_i = sum_r w_r 1[i in topk(r)] / (k sum_r w_r)      (routed fraction, not differentiable)
    P_i = sum_r w_r p_ri / sum_r w_r                      (mean router probability)
    aux = coef * E * sum_i f_i P_i

p_r is the softmax output, or for a sigmoid router the scores normalised to sum to one.
`load_E` = sum_r w_r 1[i in topk(r)], the expert-load counts of the expanded tokens.

Token dropping (capacity_factor) is only allowed when the context says its rows are plain
tokens (`allows_token_dropping`): a compact row stands for several tokens, so dropping it
would not drop what expanded training drops. Over-capacity assignments are dropped in row
order; statistics count the routing decisions before dropping.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harts.config.models import ConfigError, ModelConfig
from harts.exec.model.context import MixingContext
from harts.exec.model.layers import SwiGLU


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_experts, self.top_k, self.router_kind = c.num_experts, c.top_k, c.router
        self.aux_loss_coef, self.capacity_factor = c.aux_loss_coef, c.capacity_factor
        d, E, F_ = c.d_model, c.num_experts, c.expert_ffn_dim
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, F_, d))
        self.w_up = nn.Parameter(torch.empty(E, F_, d))
        self.w_down = nn.Parameter(torch.empty(E, d, F_))
        self.shared = SwiGLU(d, F_ * c.num_shared_experts) if c.num_shared_experts else None

    def route(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(probs_TE for the aux loss, top_i_Tk expert ids, top_w_Tk renormalised weights)."""
        logits_TE = self.router(x_TD)
        if self.router_kind == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
            probs_TE = scores_TE
        else:
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
        top_s_Tk, top_i_Tk = torch.topk(scores_TE, self.top_k, dim=-1)
        top_w_Tk = top_s_Tk / top_s_Tk.sum(-1, keepdim=True)
        return probs_TE, top_i_Tk, top_w_Tk

    def forward(self, x_TD: Tensor, ctx: MixingContext) -> tuple[Tensor, Tensor, Tensor]:
        """(y_TD, aux loss scalar, load_E)."""
        T = x_TD.shape[0]
        E, k = self.num_experts, self.top_k
        probs_TE, top_i_Tk, top_w_Tk = self.route(x_TD)

        w_T = ctx.row_weight.to(device=x_TD.device, dtype=x_TD.dtype)
        with torch.no_grad():
            selected_TE = torch.zeros(T, E, dtype=x_TD.dtype, device=x_TD.device)
            selected_TE.scatter_(1, top_i_Tk, 1.0)
            load_E = (w_T[:, None] * selected_TE).sum(0)
        total_w = w_T.sum()
        f_E = load_E / (k * total_w)
        P_E = (w_T[:, None] * probs_TE).sum(0) / total_w
        aux = self.aux_loss_coef * E * (f_E * P_E).sum()

        if self.capacity_factor is not None:
            if not getattr(ctx, "allows_token_dropping", False):
                raise ConfigError(
                    f"capacity_factor={self.capacity_factor}: token dropping is not allowed "
                    f"with {type(ctx).__name__} (tree mode needs capacity_factor=None)"
                )
            top_w_Tk = top_w_Tk * self._capacity_keep(top_i_Tk, T).to(top_w_Tk.dtype)

        y_TD = self._experts(x_TD, top_i_Tk, top_w_Tk)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        return y_TD, aux, load_E.detach()

    def _capacity_keep(self, top_i_Tk: Tensor, T: int) -> Tensor:
        capacity = math.ceil(self.capacity_factor * T * self.top_k / self.num_experts)
        onehot_NE = F.one_hot(top_i_Tk.reshape(-1), self.num_experts)
        rank_N = (onehot_NE.cumsum(0) * onehot_NE).sum(-1) - 1
        return (rank_N < capacity).view_as(top_i_Tk)

    def _experts(self, x_TD: Tensor, top_i_Tk: Tensor, top_w_Tk: Tensor) -> Tensor:
        T, k = top_i_Tk.shape
        flat_e = top_i_Tk.reshape(-1)
        flat_t = torch.arange(T, device=x_TD.device).repeat_interleave(k)
        flat_w = top_w_Tk.reshape(-1).to(x_TD.dtype)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=self.num_experts).tolist()
        y_TD = torch.zeros_like(x_TD)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = order[start : start + n]
            start += n
            rows = flat_t[idx]
            x_nD = x_TD[rows]
            h_nF = F.silu(x_nD @ self.w_gate[e].T) * (x_nD @ self.w_up[e].T)
            y_TD = y_TD.index_add(0, rows, (h_nF @ self.w_down[e].T) * flat_w[idx, None])
        return y_TD
