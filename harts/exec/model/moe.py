"""Top-k mixture of experts with shared experts, weighted routing statistics.

Shapes: T rows, D model dim, E routed experts, k top-k, F expert FFN dim, L layers.

Routing is per row and deterministic: router logits -> scores (softmax, or sigmoid as in
DeepSeek-V3 / Kimi), the k highest scores pick the experts and are renormalised to sum to
one (`router_renormalize`; without it they weigh the experts as they are). A shared-expert gate
(`shared_expert_gate`, Qwen3-Next) scales the shared experts' output by sigmoid(w^T x). A row therefore routes identically wherever it is computed, and a compact tree row
that stands for q_r trajectory tokens is routed once and counted q_r times through
`ctx.row_weight`. A Hugging Face checkpoint may configure DeepSeek-V3 / Kimi-Linear routing
instead (`MoE._select`: a correction bias on the choice, grouped top-k, weights not
renormalised, a routed scaling factor, the router in float32); it is per row too. The
routing statistics:

    f_i = sum_r w_r 1[i in topk(r)] / (k sum_r w_r)      (routed fraction, not differentiable)
    P_i = sum_r w_r p_ri / sum_r w_r                      (mean router probability)
    aux = coef * E * sum_i f_i P_i

p_r is the softmax output, or for a sigmoid router the scores normalised to sum to one.
`load_E` = sum_r w_r 1[i in topk(r)], the expert-load counts of the expanded tokens.

Aux scope (`ModelConfig.aux_scope`). f_i * P_i is not linear in the rows, so an aux loss
computed per microbatch depends on how the step is split. With "global" the trainer first
runs a no-grad statistics pass over every microbatch of the step (same weights, same
deterministic routing as the training pass) and hands each context the step's routed
fractions and total weight Q_step = sum of row weights over all microbatches (the step's
expanded tokens), through `set_moe_global`:

    f_i^global = sum_{r in step} w_r 1[i in topk(r)] / (k Q_step)
    aux_mb     = coef * E * sum_i f_i^global * (sum_{r in mb} w_r p_ri) / Q_step

The aux losses of the microbatches then sum to the full-batch value whatever the split
(a tree, a packing, or a sharing window of producer and consumer microbatches), and the
gradient flows through P only, as in the microbatch scope. In on-policy PPO the
statistics pass coincides with the old-log-prob recomputation pass verl already runs
before the update, so the two can be fused; they are not fused here. The module reads the
statistics with getattr defaults (`moe_global_f`, `moe_total_weight`), so a context that
carries none computes the statistics over its own rows, which is the global value when
one call covers the whole step. Each MoE module indexes `moe_global_f` by its MoE-layer
ordinal `moe_index`, set by the model at construction.

Token dropping (capacity_factor) is only allowed when the context says its rows are plain
tokens (`allows_token_dropping`): a compact row stands for several tokens, so dropping it
would not drop what expanded training drops. Over-capacity assignments are dropped in row
order; statistics count the routing decisions before dropping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harts.config.models import ConfigError, ModelConfig
from harts.exec.compiled import region
from harts.exec.model.context import MixingContext
from harts.exec.model.layers import SwiGLU

# the expert functions, as harts.distributed.parallelize imports them from here
from harts.exec.ops.moe.grouped import experts_grouped  # noqa: F401
from harts.exec.ops.moe.naive import experts_loop  # noqa: F401


@dataclass(frozen=True)
class MoEGlobalStats:
    """Step-global routing statistics, what every microbatch's aux loss uses in the global scope."""

    f_LE: Tensor  # float64 [L, E]: routed fraction of each expert per MoE layer (rows sum to 1)
    total_weight: float  # Q_step: sum of row weights over every microbatch of the step

    @classmethod
    def from_loads(cls, load_LE: Tensor, total_weight: float, top_k: int) -> MoEGlobalStats:
        """From the step's summed expert loads (`ModelOutput.expert_load` summed over
        microbatches) and its summed row weights."""
        if not total_weight > 0:
            raise ValueError(f"the step's total row weight must be > 0; got {total_weight}")
        load_LE = load_LE.detach().to(torch.float64)
        return cls(load_LE / (top_k * total_weight), float(total_weight))

    def on(self, device: torch.device | str) -> list[Tensor]:
        """f_LE's rows on `device` (float64), copied there once per device: a MoE layer
        reads its row in every forward and recompute of every microbatch, and a copy from
        pageable host memory each time would synchronise the stream each time."""
        dev = torch.device(device)
        cache = self.__dict__.setdefault("_on", {})
        if dev not in cache:
            from harts.exec.transfer import to_device

            cache[dev] = list(to_device(self.f_LE, dev).unbind(0))
        return cache[dev]


def set_moe_global(ctx: object, stats: MoEGlobalStats | None) -> None:
    """Hand a context the step-global statistics (None: back to its own rows' statistics).
    Sets `ctx.moe_global_f` (list of [E] tensors by MoE-layer ordinal, on the device of the
    context's row weights) and `ctx.moe_total_weight`; call it on every microbatch's
    context before its forward."""
    weight = getattr(ctx, "row_weight", None)
    device = weight.device if isinstance(weight, Tensor) else stats.f_LE.device if stats is not None else None
    ctx.moe_global_f = None if stats is None else stats.on(device)
    ctx.moe_total_weight = None if stats is None else stats.total_weight


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, moe_index: int = 0):
        super().__init__()
        c = config
        # ordinal among the model's MoE layers: indexes the step-global statistics
        self.moe_index = moe_index
        self.num_experts, self.top_k, self.router_kind = c.num_experts, c.top_k, c.router
        self.aux_loss_coef, self.capacity_factor = c.aux_loss_coef, c.capacity_factor
        d, E, F_ = c.d_model, c.num_experts, c.expert_ffn_dim
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, F_, d))
        self.w_up = nn.Parameter(torch.empty(E, F_, d))
        self.w_down = nn.Parameter(torch.empty(E, d, F_))
        self.shared = SwiGLU(d, c.shared_ffn_dim) if c.shared_ffn_dim else None
        # Qwen3-Next: the shared expert's output scaled by sigmoid(shared_gate x) per row
        self.shared_gate = nn.Linear(d, 1, bias=False) if c.shared_expert_gate and self.shared is not None else None
        self.groups, self.topk_groups = c.router_groups, c.router_topk_groups
        self.renormalize, self.scaling = c.router_renormalize, c.routed_scaling_factor
        self.router_float32 = c.router_float32
        # DeepSeek-V3's e_score_correction_bias: shifts which experts are chosen, not their
        # weights; a buffer (balanced outside the gradient), saved with the weights
        self.score_bias = nn.Buffer(torch.zeros(E)) if c.router_score_bias else None
        self._plain_topk = (not c.router_score_bias and c.router_groups == 1 and c.router_renormalize
                            and c.routed_scaling_factor == 1.0)

    def route(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(probs_TE for the aux loss, top_i_Tk expert ids, top_w_Tk renormalised weights)."""
        scores_TE, probs_TE = router_scores(self._logits(x_TD), self.router_kind == "softmax")
        if not self._plain_topk:
            return (probs_TE, *self._select(scores_TE))
        return (probs_TE, *top_k_renormalised(scores_TE, self.top_k))

    def _logits(self, x_TD: Tensor) -> Tensor:
        """logits_TE: the router (the module, with whatever hooks it carries), or its weight
        in float32 where `router_float32` and x is narrower."""
        if self.router_float32 and x_TD.dtype.itemsize < 4:
            return F.linear(x_TD.float(), self.router.weight.float())
        return self.router(x_TD)

    def _select(self, scores_TE: Tensor) -> tuple[Tensor, Tensor]:
        """(top_i_Tk, top_w_Tk) as transformers' KimiLinearTopkRouter / DeepSeek-V3 compute
        them: choose on scores + score_bias within the best router_topk_groups groups (a
        group's score: the sum of its two best), weigh by the plain scores, renormalised
        (denominator + 1e-20, as there) when configured, times routed_scaling_factor."""
        T, E = scores_TE.shape
        choice_TE = scores_TE if self.score_bias is None else scores_TE + self.score_bias.to(scores_TE.dtype)
        if self.groups > 1:
            G = self.groups
            group_TG = choice_TE.view(T, G, E // G).topk(2, dim=-1)[0].sum(-1)
            keep_TG = torch.zeros_like(group_TG).scatter_(
                1, torch.topk(group_TG, self.topk_groups, dim=-1)[1], 1.0)
            keep_TE = keep_TG.unsqueeze(-1).expand(T, G, E // G).reshape(T, E).bool()
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        top_i_Tk = torch.topk(choice_TE, self.top_k, dim=-1)[1]
        top_w_Tk = scores_TE.gather(1, top_i_Tk)
        if self.renormalize:
            top_w_Tk = top_w_Tk / (top_w_Tk.sum(-1, keepdim=True) + 1e-20)
        return top_i_Tk, top_w_Tk * self.scaling

    def forward(self, x_TD: Tensor, ctx: MixingContext) -> tuple[Tensor, Tensor, Tensor]:
        """(y_TD, aux loss scalar, load_E)."""
        E, k = self.num_experts, self.top_k
        w_T = ctx.row_weight.to(device=x_TD.device, dtype=x_TD.dtype)
        global_f = getattr(ctx, "moe_global_f", None)
        if self._plain_topk and global_f is None:
            # the routing and this microbatch's statistics as one function of tensors, the
            # region `KernelConfig.compile` compiles
            logits_TE = self._logits(x_TD)
            route = region(route_and_balance, getattr(ctx, "kernels", None), logits_TE, w_T)
            top_i_Tk, top_w_Tk, aux, load_E = route(logits_TE, w_T, k, self.router_kind == "softmax",
                                                    self.aux_loss_coef * E)
            return self._finish(x_TD, top_i_Tk, top_w_Tk, aux, load_E, ctx)
        probs_TE, top_i_Tk, top_w_Tk = self.route(x_TD)
        load_E = expert_load(top_i_Tk, w_T, E)
        if global_f is None:
            aux = microbatch_aux(load_E, probs_TE, w_T, k, self.aux_loss_coef * E)
        else:
            if self.moe_index >= len(global_f):
                raise ValueError(
                    f"moe_global_f holds {len(global_f)} MoE layers; this is MoE layer {self.moe_index}"
                )
            f_E = global_f[self.moe_index].to(device=x_TD.device, dtype=x_TD.dtype)
            # this microbatch's part of the step's P_i: its rows over the step's total weight
            P_E = (w_T[:, None] * probs_TE).sum(0) / ctx.moe_total_weight
            aux = self.aux_loss_coef * E * (f_E * P_E).sum()
        return self._finish(x_TD, top_i_Tk, top_w_Tk, aux, load_E, ctx)

    def _finish(self, x_TD: Tensor, top_i_Tk: Tensor, top_w_Tk: Tensor, aux: Tensor, load_E: Tensor,
                ctx: MixingContext) -> tuple[Tensor, Tensor, Tensor]:
        """The experts and shared experts from the routing: (y_TD, aux, load_E)."""
        T = x_TD.shape[0]
        if self.capacity_factor is not None:
            if not getattr(ctx, "allows_token_dropping", False):
                raise ConfigError(
                    f"capacity_factor={self.capacity_factor}: token dropping is not allowed "
                    f"with {type(ctx).__name__} (tree mode needs capacity_factor=None)"
                )
            top_w_Tk = top_w_Tk * self._capacity_keep(top_i_Tk, T).to(top_w_Tk.dtype)

        y_TD = self._experts(x_TD, top_i_Tk, top_w_Tk, ctx)
        if self.shared is not None:
            shared_TD = self.shared(x_TD, ctx)
            if self.shared_gate is not None:
                shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        return y_TD, aux, load_E.detach()

    def _capacity_keep(self, top_i_Tk: Tensor, T: int) -> Tensor:
        capacity = math.ceil(self.capacity_factor * T * self.top_k / self.num_experts)
        onehot_NE = F.one_hot(top_i_Tk.reshape(-1), self.num_experts)
        rank_N = (onehot_NE.cumsum(0) * onehot_NE).sum(-1) - 1
        return (rank_N < capacity).view_as(top_i_Tk)

    def _experts(self, x_TD: Tensor, top_i_Tk: Tensor, top_w_Tk: Tensor, ctx: object = None) -> Tensor:
        """The routed experts on `moe_impl`'s pick for the context's `kernels` (defaults
        where the context has none)."""
        from harts.exec.backend import DEFAULT_KERNELS, experts

        return experts(x_TD, top_i_Tk, top_w_Tk, self.w_gate, self.w_up, self.w_down,
                       kernels=getattr(ctx, "kernels", DEFAULT_KERNELS), record=getattr(ctx, "kernel_record", None))


def router_scores(logits_TE: Tensor, softmax: bool) -> tuple[Tensor, Tensor]:
    """(scores_TE the top-k picks by, probs_TE the aux loss reads): softmax of the router
    logits (both), or their sigmoid and its row-normalised form."""
    if softmax:
        scores_TE = torch.softmax(logits_TE, dim=-1)
        return scores_TE, scores_TE
    scores_TE = torch.sigmoid(logits_TE)
    return scores_TE, scores_TE / scores_TE.sum(-1, keepdim=True)


def top_k_renormalised(scores_TE: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(top_i_Tk, top_w_Tk): the k highest scores' experts and the scores renormalised to
    sum to one."""
    top_s_Tk, top_i_Tk = torch.topk(scores_TE, k, dim=-1)
    return top_i_Tk, top_s_Tk / top_s_Tk.sum(-1, keepdim=True)


def expert_load(top_i_Tk: Tensor, w_T: Tensor, num_experts: int) -> Tensor:
    """load_E = sum_r w_r 1[i in topk(r)] (no gradient), in w_T's dtype."""
    with torch.no_grad():
        selected_TE = torch.zeros(top_i_Tk.shape[0], num_experts, dtype=w_T.dtype, device=w_T.device)
        selected_TE.scatter_(1, top_i_Tk, 1.0)
        return (w_T[:, None] * selected_TE).sum(0)


def microbatch_aux(load_E: Tensor, probs_TE: Tensor, w_T: Tensor, k: int, scale: float) -> Tensor:
    """The aux loss over this microbatch's statistics: scale x sum_i f_i P_i (scale = coef x E)."""
    total_w = w_T.sum()
    f_E = load_E / (k * total_w)
    P_E = (w_T[:, None] * probs_TE).sum(0) / total_w
    return scale * (f_E * P_E).sum()


def route_and_balance(logits_TE: Tensor, w_T: Tensor, k: int, softmax: bool,
                      aux_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(top_i_Tk, top_w_Tk, aux, load_E) of a plain top-k router with per-microbatch
    statistics from its logits: `MoE.route` past the router and the statistics as one
    function of tensors, the region `KernelConfig.compile` runs under torch.compile."""
    scores_TE, probs_TE = router_scores(logits_TE, softmax)
    top_i_Tk, top_w_Tk = top_k_renormalised(scores_TE, k)
    load_E = expert_load(top_i_Tk, w_T, scores_TE.shape[1])
    return top_i_Tk, top_w_Tk, microbatch_aux(load_E, probs_TE, w_T, k, aux_scale), load_E

