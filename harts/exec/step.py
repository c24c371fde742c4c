"""The one step runner: forward, loss, backward, clipping and AdamW for every layout.

Shapes: T rows a microbatch executes, N targets, L MoE layers, E routed experts.

A trainer is a `StepRunner` over a `Layout` (`harts.exec.layouts`): the layout decides
which trajectories share a microbatch and builds each microbatch (its rows, mixing context
and targets); the runner runs every microbatch the same way. One update step:

1. the layout's partition (or a given one) and, possibly built ahead by `prepare` in a
   background thread (`run_steps`), the step's microbatches;
2. with `aux_scope="global"`, a no-grad statistics pass over them (`moe_statistics_pass`);
3. per microbatch: model forward, policy loss with the step-global denominators
   (`step_denominators`), the MoE aux loss, backward accumulating into .grad;
4. the per-microbatch values read back once, after the last launch, into a `StepResult`;
5. gradient clipping and one AdamW step.

Because the denominators are global, the accumulated gradient is the full-batch gradient
for any split, so a difference between layouts can only come from the layout.

MoE auxiliary loss, `ModelConfig.aux_scope`:
- "microbatch" (default): routing statistics are per microbatch (as in Megatron / verl), and
  each microbatch's aux loss is scaled by its share of the step's tokens, T_mb / T_step, so
  a step of one microbatch gets exactly the full-batch aux loss and the reported `aux_loss`
  is a token-weighted mean over microbatches. (f_i * P_i is not linear in the rows, so this
  is the one term that depends on the packing; the tree layouts use the same rule per
  microbatch with occurrence-weighted rows.)
- "global": before the training pass, `moe_statistics_pass` runs the model without grad
  over the same microbatches, sums the expert loads and row weights into step-global
  routed fractions, and `set_moe_global` hands them to each microbatch's context before its
  training forward. Each microbatch's aux loss is then its exact part of the full-batch aux
  loss (no share scaling), so the step's aux loss and its gradient do not depend on the
  split. The pass costs one extra forward (in on-policy PPO the same forward as the
  old-log-prob recomputation; not fused here) and is skipped when the model has no MoE
  layer or aux_loss_coef = 0. Each microbatch's layout info records `moe_stats_drift`, the
  routing assignments (weighted) that differ between the two passes: 0 with deterministic
  kernels.

What a distributed runner changes is confined to narrow hooks: `_begin_pass` /
`_finish_pass` around the microbatches (gathering and reducing gradients and results),
`_statistics_pass` (summing the statistics over replicas) and `_clip_gradients` (by the
full gradient's norm); a pipeline replaces `_run`, the pass over the microbatches, with its
schedule. A layout needing work between microbatches (sharing windows, an EP group's
shadows) does it while the runner iterates its microbatches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from harts.config.kernels import KernelConfig
from harts.config.optimizer import OptimizerConfig
from harts.exec.loss import (
    LossDenominators,
    PolicyLossConfig,
    PolicyLossOutput,
    TargetTable,
    loss_denominators,
    policy_loss,
)
from harts.exec.model.model import HybridModel
from harts.exec.model.moe import MoEGlobalStats, set_moe_global
from harts.exec.ops.record import KernelRecord
from harts.tree.trajectory import Trajectory

__all__ = ["LOSS_TERMS", "Layout", "Microbatch", "PreparedStep", "StepResult", "StepRunner", "loss_terms",
           "moe_statistics_pass", "scale_gradients", "step_denominators"]


@dataclass(frozen=True)
class StepResult:
    logprobs: list[np.ndarray]  # per trajectory, float64 [L]: log-prob of token p; NaN at p = 0
    entropy: list[np.ndarray]  # per trajectory, float64 [L]: entropy of the distribution predicting p
    losses: dict[str, float]  # loss, pg_loss, kl, entropy, aux_loss, clip_frac, ppo_kl
    grad_norm: float  # global L2 norm before clipping
    expert_load: np.ndarray  # float64 [L, E] routed-token counts summed over microbatches
    tokens: int  # expanded tokens computed
    trained_tokens: int
    microbatches: list[list[int]] = field(default_factory=list)  # trajectory indices
    seconds: float = 0.0
    # per microbatch: rows executed, plus layout statistics (tree mode: KDA rounds, replay)
    layout: list[dict] = field(default_factory=list)
    # the trainer's KernelConfig ("config") and what its ops ran so far ("ran", "fallbacks")
    kernels: dict = field(default_factory=dict)

    @property
    def executed_rows(self) -> int:
        return sum(m["rows"] for m in self.layout)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


# the step's loss terms, summed over its microbatches (StepResult.losses)
LOSS_TERMS = ("loss", "pg_loss", "kl", "entropy", "aux_loss", "clip_frac", "ppo_kl")


def step_denominators(trajectories: Sequence[Trajectory]) -> LossDenominators:
    return loss_denominators([int(t.loss_mask.sum()) for t in trajectories])


def loss_terms(pl: PolicyLossOutput, aux: torch.Tensor, share: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A microbatch's training loss (policy loss plus MoE aux loss) and its float64
    [len(LOSS_TERMS)] values. `share`: the microbatch's part of the step's expanded tokens,
    which scales the aux loss in the "microbatch" aux scope; None in the "global" scope,
    where `aux` already is the microbatch's exact part of the step's aux loss."""
    aux = aux if share is None else aux * share
    loss = pl.loss + aux
    terms = (loss, pl.pg_loss, pl.kl, pl.entropy, aux, pl.clip_frac, pl.ppo_kl)  # LOSS_TERMS' order
    return loss, torch.stack([v.detach().to(torch.float64).reshape(()) for v in terms])


@dataclass(frozen=True)
class Microbatch:
    """One microbatch as the step runner sees it, whatever the layout."""

    members: list[int]  # step-level trajectory indices it holds
    ids_T: torch.Tensor  # token id of each row it executes
    ctx: object  # the MixingContext over those rows
    # the targets whose loss terms it computes, `traj` indexing the step's trajectories:
    # its members' (a window plan serves a target on a row a producer computed there)
    table: TargetTable
    expanded_tokens: int  # tokens these trajectories hold when expanded
    info: dict = field(default_factory=dict)  # layout statistics (tree mode: rounds, replay)
    # a window producer: the layout takes its forward's output and loss (None in the
    # statistics pass) instead of the runner running its backward, and runs that backward
    # itself after the window's last consumer
    keep_forward: Callable[[object, torch.Tensor | None], None] | None = None
    # saved-tensor hooks entered around its forward and loss (a window producer's
    # `HostOffload`); None: autograd keeps saved tensors where they are
    saved_tensor_hooks: Callable[[], AbstractContextManager] | None = None


@dataclass(frozen=True)
class PreparedStep:
    """What a step needs that depends only on its data: the partition and every
    microbatch's layout, with its index tensors already on the device. Built by
    `StepRunner.prepare`, possibly in a background thread while the previous step runs
    (host-side layout work then overlaps GPU work, as a data loader's would), and consumed
    by `step(..., prepared=...)`: the numbers are those of the same step without it.
    `microbatches` is iterated once per pass (statistics, training)."""

    trajectories: Sequence[Trajectory]
    microbatch_tokens: int | None
    partition: list[list[int]]
    microbatches: Iterable[Microbatch]
    seconds: float  # host time spent preparing


class Layout(Protocol):
    """How a step's trajectories become microbatches (`harts.exec.layouts`)."""

    # whether a step's microbatches can be built before it runs
    preparable: bool
    # whether its partition holds every trajectory of the step (a replica's holds its own)
    covers_step: bool

    def bind(self, model: torch.nn.Module, kernels: KernelConfig, kernel_record: KernelRecord) -> Layout:
        """Attach the model the microbatches run on and the kernels their contexts use."""

    def partition(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None) -> list[list[int]]:
        """Which trajectories share a microbatch, in execution order."""

    def microbatches(self, trajectories: Sequence[Trajectory],
                     partition: Sequence[Sequence[int]]) -> Iterable[Microbatch]:
        """One pass's microbatches, built as the pass iterates them."""

    def prepare(self, trajectories: Sequence[Trajectory],
                partition: Sequence[Sequence[int]]) -> Iterable[Microbatch]:
        """The step's microbatches built now, iterable once per pass."""


@torch.no_grad()
def moe_statistics_pass(model: HybridModel, microbatches: Iterable[Microbatch]) -> tuple[MoEGlobalStats, list[torch.Tensor]]:
    """No-grad forward over every microbatch of a step, in order: the step-global MoE
    statistics (loads and row weights summed over all microbatches) and each microbatch's
    float64 [L, E] expert loads. Routing ignores any global statistics a context already
    carries (they change only the aux value), so the loads are the training pass's loads.
    A microbatch's `keep_forward(out, loss)` (a window producer stashing what its consumers
    read) is called with loss=None: this pass has no loss and no backward."""
    loads = []
    total_weight = 0.0
    for mb in microbatches:
        out = model(mb.ids_T, mb.ctx)
        if mb.keep_forward is not None:
            mb.keep_forward(out, None)
        loads.append(out.expert_load.detach().to(torch.float64).cpu())
        total_weight += float(mb.ctx.row_weight.detach().to(torch.float64).sum())
    if not loads:
        raise ValueError("the MoE statistics pass needs at least one microbatch")
    return MoEGlobalStats.from_loads(torch.stack(loads).sum(0), total_weight, model.config.top_k), loads


def scale_gradients(model: torch.nn.Module, max_norm: float | None, grad_norm: float) -> None:
    """Clip by an already known norm (torch's `clip_grad_norm_` rule: the coefficient
    max_norm / (norm + 1e-6), at most 1): what a distributed runner does with the full
    gradient's norm, which no rank's local gradients give."""
    if max_norm is None:
        return
    coef = min(max_norm / (grad_norm + 1e-6), 1.0)
    if coef == 1.0:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)


class StepRunner:
    """One update step over any `Layout` (module docstring); the trainers of
    `harts.exec.factory` are this runner with their layout."""

    def __init__(self, model: HybridModel, layout: Layout, optimizer: OptimizerConfig | None = None,
                 loss: PolicyLossConfig | None = None, *, kernels: KernelConfig | None = None):
        """`kernels`: which kernels the step's ops run (default: `KernelConfig.from_env()`,
        built here once); every microbatch's context gets it and records what ran into
        `kernel_record`."""
        optimizer = optimizer or OptimizerConfig()
        loss = loss or PolicyLossConfig()
        self.kernels = kernels if kernels is not None else KernelConfig.from_env()
        self.kernel_record = KernelRecord()
        self.model = model
        self.optimizer_config = optimizer
        self.loss_config = loss.validate()
        self.layout = layout.bind(model, self.kernels, self.kernel_record)
        decay, no_decay = [], []
        for p in model.parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": optimizer.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
            # one fused kernel over all parameters on CUDA (the default foreach path
            # launches several kernels per parameter group); the same update rule
            fused=True if all(p.is_cuda for p in model.parameters()) else None,
        )

    @property
    def preparable(self) -> bool:
        """Whether `prepare` can build a step's microbatches before it runs."""
        return self.layout.preparable

    def _check_tokens(self, trajectories: Sequence[Trajectory]) -> None:
        vocab = self.model.config.vocab_size
        for t in trajectories:
            if t.tokens.size and int(t.tokens.max()) >= vocab:
                raise ValueError(
                    f"trajectory {t.id!r}: token id {int(t.tokens.max())} is outside the "
                    f"vocabulary of {self.model.config.name} (size {vocab})"
                )

    def partition(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None) -> list[list[int]]:
        """Which trajectories share a microbatch (the layout's partition)."""
        return self.layout.partition(trajectories, microbatch_tokens)

    def prepare(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None,
                partition: Sequence[Sequence[int]] | None = None) -> PreparedStep:
        """Build the step's partition and microbatch layouts now (see `PreparedStep`)."""
        if not self.preparable:
            raise NotImplementedError(f"{type(self).__name__} builds microbatches from earlier ones' results; "
                                      "it cannot prepare a step ahead")
        if not trajectories:
            raise ValueError("a step needs at least one trajectory")
        start = time.perf_counter()
        bins = self._bins(trajectories, microbatch_tokens, partition)
        mbs = self.layout.prepare(trajectories, bins)
        return PreparedStep(trajectories, microbatch_tokens, bins, mbs, time.perf_counter() - start)

    def _bins(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None,
              partition: Sequence[Sequence[int]] | None) -> list[list[int]]:
        bins = [list(b) for b in partition] if partition is not None else self.partition(trajectories, microbatch_tokens)
        covered = sorted(j for b in bins for j in b)
        if self.layout.covers_step and covered != list(range(len(trajectories))):
            raise ValueError("the microbatch partition must hold every trajectory exactly once")
        return bins

    def forward_backward(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None = None,
                         partition: Sequence[Sequence[int]] | None = None,
                         prepared: PreparedStep | None = None) -> StepResult:
        """Accumulate the step's gradient into .grad (not zeroed first); no optimizer step.
        grad_norm is the norm of .grad afterwards. `partition` fixes which trajectories
        share a microbatch (default: the layout's own packing under the budget);
        `prepared` (from `prepare` on the same trajectories) supplies them ready-built."""
        return self._run(trajectories, microbatch_tokens, backward=True, partition=partition, prepared=prepared)

    @torch.no_grad()
    def evaluate(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None = None,
                 partition: Sequence[Sequence[int]] | None = None) -> StepResult:
        """Forward only: log-probs, entropy, losses and expert loads; grad_norm is 0."""
        return self._run(trajectories, microbatch_tokens, backward=False, partition=partition)

    def recompute_old_logprobs(self, trajectories: Sequence[Trajectory],
                               microbatch_tokens: int | None = None) -> list[Trajectory]:
        """The trajectories with old_logprobs replaced by the current policy's (on-policy
        PPO, as verl's actor recomputes old_log_prob before the update)."""
        result = self.evaluate(trajectories, microbatch_tokens)
        return [
            replace(t, old_logprobs=np.nan_to_num(lp, nan=0.0))
            for t, lp in zip(trajectories, result.logprobs, strict=True)
        ]

    def step(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None = None,
             partition: Sequence[Sequence[int]] | None = None, prepared: PreparedStep | None = None) -> StepResult:
        """One update: zero grads, forward/backward over all microbatches, clip, AdamW step."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        result = self.forward_backward(trajectories, microbatch_tokens, partition, prepared)
        self._clip_gradients(result.grad_norm)
        self.optimizer.step()
        return replace(result, seconds=time.perf_counter() - start)

    def kernels_used(self) -> dict:
        """{"config": the KernelConfig, "ran": {op: [impl]}, "fallbacks": [...]}: for results."""
        return {"config": self.kernels.to_dict(), **self.kernel_record.to_dict()}

    # ---- the pass over a step's microbatches --------------------------------------------------

    def _run(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None, backward: bool,
             partition: Sequence[Sequence[int]] | None = None, prepared: PreparedStep | None = None) -> StepResult:
        if not trajectories:
            raise ValueError("a step needs at least one trajectory")
        self._check_tokens(trajectories)
        start = time.perf_counter()
        if prepared is not None:
            if prepared.trajectories is not trajectories or prepared.microbatch_tokens != microbatch_tokens:
                raise ValueError("this prepared step was built for other trajectories or another token budget")
            if partition is not None and [list(b) for b in partition] != prepared.partition:
                raise ValueError("the partition differs from the prepared step's")
            bins = prepared.partition

            def microbatches():
                return iter(prepared.microbatches)
        else:
            bins = self._bins(trajectories, microbatch_tokens, partition)

            def microbatches():
                return self.layout.microbatches(trajectories, bins)

        self._begin_pass()
        result = self._pass(trajectories, bins, microbatches, backward)
        result = self._finish_pass(result, backward)
        return replace(result, seconds=time.perf_counter() - start)

    def _pass(self, trajectories: Sequence[Trajectory], bins: list[list[int]],
              microbatches: Callable[[], Iterable[Microbatch]], backward: bool) -> StepResult:
        """The statistics pass (global aux scope) and the training pass over the step's
        microbatches; `microbatches()` gives a fresh iteration of them for each pass."""
        model = self.model
        lengths = [len(t) for t in trajectories]
        total_tokens = sum(lengths)
        den = step_denominators(trajectories)
        # per-position results of every trajectory in one flat buffer each (trajectory j's
        # position p at starts[j] + p), split into per-trajectory views at the end
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        logprob_flat = np.full(total_tokens, np.nan)
        entropy_flat = np.full(total_tokens, np.nan)
        sums = dict.fromkeys(LOSS_TERMS, 0.0)
        expert_load = None
        infos = []
        config = model.config
        stats, stats_loads = None, []
        pending: list[tuple[torch.Tensor, ...]] = []
        if config.aux_scope == "global" and config.num_moe_layers and config.aux_loss_coef:
            stats, stats_loads = self._statistics_pass(microbatches())
        for mb in microbatches():
            if stats is not None:
                set_moe_global(mb.ctx, stats)
            with mb.saved_tensor_hooks() if mb.saved_tensor_hooks is not None else nullcontext():
                out = model(mb.ids_T, mb.ctx)
                pl = policy_loss(out.hidden_TD, model.lm_head_weight, mb.table, den, self.loss_config)
            # "microbatch" scope: the aux loss weighs by the microbatch's share of the step's
            # (expanded) tokens; "global": already its exact part of the step's aux loss
            loss, terms = loss_terms(pl, out.aux_loss, None if stats is not None else mb.expanded_tokens / total_tokens)
            if mb.keep_forward is not None:
                mb.keep_forward(out, loss)
            elif backward:
                loss.backward()
            pending.append((terms, out.expert_load.detach().to(torch.float64), pl.logprob_N.detach().to(torch.float64),
                            pl.entropy_N.detach().to(torch.float64), mb.table.traj, mb.table.position))
            infos.append({"rows": int(mb.ids_T.numel()), **mb.info})
        # the step's per-microbatch values read back once, after its last launch: a read per
        # microbatch would hold the host until that microbatch finished before it could launch
        # the next one, and leave the device idle while it does
        if pending:
            values = torch.stack([p[0] for p in pending]).cpu().tolist()
            loads = torch.stack([p[1] for p in pending]).cpu()
            lp = torch.cat([p[2] for p in pending]).cpu().numpy()
            ent = torch.cat([p[3] for p in pending]).cpu().numpy()
            traj_N = torch.cat([p[4] for p in pending]).cpu().numpy()
            pos_N = torch.cat([p[5] for p in pending]).cpu().numpy()
            for i, row in enumerate(values):
                for name, value in zip(LOSS_TERMS, row, strict=True):
                    sums[name] += value
                load = loads[i].numpy()
                expert_load = load if expert_load is None else expert_load + load
                if stats is not None:
                    infos[i]["moe_stats_drift"] = float((loads[i] - stats_loads[i]).abs().sum()) / 2
            at = starts[traj_N] + pos_N  # one vectorised scatter (a per-trajectory mask loop idles the GPU)
            logprob_flat[at] = lp
            entropy_flat[at] = ent
        del pending
        return StepResult(
            logprobs=np.split(logprob_flat, starts[1:-1]),
            entropy=np.split(entropy_flat, starts[1:-1]),
            losses=sums,
            grad_norm=0.0,
            expert_load=expert_load,
            tokens=total_tokens,
            trained_tokens=int(den.total_tokens),
            microbatches=bins,
            layout=infos,
            kernels=self.kernels_used(),
        )

    # ---- hooks a distributed runner overrides -------------------------------------------------

    def _begin_pass(self) -> None:
        """Before a pass's first microbatch (a distributed runner gathers its shards)."""

    def _finish_pass(self, result: StepResult, backward: bool) -> StepResult:
        """After a pass's last microbatch: the result with the gradient's norm (a
        distributed runner reduces gradients and gathers results over its replicas first)."""
        return replace(result, grad_norm=self._grad_norm() if backward else 0.0)

    def _grad_norm(self) -> float:
        """L2 norm of the accumulated .grad: one multi-tensor norm kernel rather than one
        launch per parameter."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0

    def _statistics_pass(self, microbatches: Iterable[Microbatch]) -> tuple[MoEGlobalStats, list[torch.Tensor]]:
        """The step-global MoE statistics (`moe_statistics_pass`); a distributed runner
        sums them over its replicas."""
        return moe_statistics_pass(self.model, microbatches)

    def _clip_gradients(self, grad_norm: float) -> None:
        """Clip the accumulated gradient to `OptimizerConfig.grad_clip` (torch's
        `clip_grad_norm_` over this process's gradients; a distributed runner scales by the
        full gradient's norm, `scale_gradients`)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.optimizer_config.grad_clip
        if max_norm is not None and params:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
