"""The trajectory-expanded reference trainer: the Baseline every HARTS number is measured against.

Shapes: T packed rows of a microbatch, N targets, S trajectories of the step, L MoE layers,
E routed experts.

One update step: trajectories are packed into microbatches under a token budget
(first-fit-decreasing; a trajectory longer than the budget gets a microbatch of its own);
each microbatch runs the model over a `PackedContext` (sequences never see each other),
the policy loss with step-global denominators, and a backward pass accumulating into
.grad; then optional gradient clipping and one AdamW step. Because the denominators are
global, the accumulated gradient equals the full-batch gradient for any packing.

MoE auxiliary loss, `ModelConfig.aux_scope`:
- "microbatch" (default): routing statistics are per microbatch (as in Megatron / verl), and
  each microbatch's aux loss is scaled by its share of the step's tokens, T_mb / T_step, so
  a step of one microbatch gets exactly the full-batch aux loss and the reported `aux_loss`
  is a token-weighted mean over microbatches. (f_i * P_i is not linear in the rows, so this
  is the one term that depends on the packing; the tree executor uses the same rule per
  microbatch with occurrence-weighted rows.)
- "global": before the training pass, `moe_statistics_pass` runs the model without grad
  over every microbatch the same `_microbatches` generator yields, sums the expert loads
  and row weights into step-global routed fractions, and `set_moe_global` hands them to
  each microbatch's context before its training forward. Each microbatch's aux loss is
  then its exact part of the full-batch aux loss (no share scaling), so the step's aux
  loss and its gradient do not depend on the split; any subclass that yields `Microbatch`
  objects gets this for free. The pass costs one extra forward; in on-policy PPO it is the
  same forward as the old-log-prob recomputation and could be fused with it (not done
  here). It is skipped when the model has no MoE layer or aux_loss_coef = 0. Each
  microbatch's layout info records `moe_stats_drift`, the routing assignments (weighted)
  that differ between the two passes: 0 with deterministic kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from harts.config.kernels import KernelConfig
from harts.config.optimizer import OptimizerConfig
from harts.exec.loss import (
    LossDenominators,
    PolicyLossConfig,
    TargetTable,
    loss_denominators,
    policy_loss,
)
from harts.exec.model.context import PackedContext
from harts.exec.model.model import HybridModel
from harts.exec.model.moe import MoEGlobalStats, set_moe_global
from harts.exec.ops.record import KernelRecord
from harts.exec.transfer import to_device
from harts.plan.partition import pack_microbatches, packed_partition  # noqa: F401  (imported from here too)
from harts.tree.trajectory import Trajectory


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


def trajectory_targets(
    trajectories: Sequence[Trajectory], traj_indices: Sequence[int], row_offsets: Sequence[int]
) -> TargetTable:
    """Targets of positions 1..L-1 of each trajectory (masked ones included with weight 0, so
    every position gets a log-prob); trajectory j's row p-1 sits at row_offsets[j] + p - 1."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("row", "label", "traj", "position", "weight", "adv", "old", "ref")}
    have_ref = all(trajectories[j].ref_logprobs is not None for j in traj_indices)
    for j, off in zip(traj_indices, row_offsets, strict=True):
        t = trajectories[j]
        p = np.arange(1, len(t), dtype=np.int64)
        parts["row"].append(off + p - 1)
        parts["label"].append(t.tokens[1:])
        parts["traj"].append(np.full(p.size, j, dtype=np.int64))
        parts["position"].append(p)
        parts["weight"].append(t.loss_mask[1:].astype(np.float64))
        parts["adv"].append(t.advantage[1:])
        parts["old"].append(t.old_logprobs[1:])
        if have_ref:
            parts["ref"].append(t.ref_logprobs[1:])
    cat = {k: torch.from_numpy(np.concatenate(v)) if v else None for k, v in parts.items()}
    return TargetTable(
        row=cat["row"], label=cat["label"], traj=cat["traj"], position=cat["position"],
        weight=cat["weight"], advantage=cat["adv"], old_logprob=cat["old"], ref_logprob=cat["ref"],
    )


def step_denominators(trajectories: Sequence[Trajectory]) -> LossDenominators:
    return loss_denominators([int(t.loss_mask.sum()) for t in trajectories])


@dataclass(frozen=True)
class Microbatch:
    """One microbatch as the step loop sees it, whatever the layout (packed or tree)."""

    members: list[int]  # step-level trajectory indices whose targets it owns
    ids_T: torch.Tensor  # token id of each row it executes
    ctx: object  # the MixingContext over those rows
    table: TargetTable  # its targets, `traj` indexing the step's trajectories
    expanded_tokens: int  # tokens these trajectories hold when expanded
    info: dict = field(default_factory=dict)  # layout statistics (tree mode: rounds, replay)
    # hidden rows the loss reads, from the model's (sharing windows append context rows)
    hidden_of: Callable[[torch.Tensor], torch.Tensor] | None = None
    # called with (model output, loss) instead of an immediate backward (a window
    # producer, whose backward runs after its consumers'); loss is None in no-loss passes
    after_forward: Callable[[object, torch.Tensor | None], None] | None = None
    # saved-tensor hooks entered around its forward and loss (a window producer's
    # `HostOffload`); None: autograd keeps saved tensors where they are
    saved_tensors: Callable[[], AbstractContextManager] | None = None


@dataclass(frozen=True)
class PreparedStep:
    """What a step needs that depends only on its data: the partition and every
    microbatch's layout, with its index tensors already on the device. Built by
    `ExpandedTrainer.prepare`, possibly in a background thread while the previous step
    runs (host-side layout work then overlaps GPU work, as a data loader's would), and
    consumed by `step(..., prepared=...)`: the numbers are those of the same step without it."""

    trajectories: Sequence[Trajectory]
    microbatch_tokens: int
    partition: list[list[int]]
    microbatches: list[Microbatch]
    seconds: float  # host time spent preparing


@torch.no_grad()
def moe_statistics_pass(model: HybridModel, microbatches: Iterable[Microbatch]) -> tuple[MoEGlobalStats, list[torch.Tensor]]:
    """No-grad forward over every microbatch of a step, in order: the step-global MoE
    statistics (loads and row weights summed over all microbatches) and each microbatch's
    float64 [L, E] expert loads. Routing ignores any global statistics a context already
    carries (they change only the aux value), so the loads are the training pass's loads.
    Reusable by any executor whose microbatches have `ids_T` and `ctx`. A microbatch's
    optional `after_forward(out, loss)` hook (a window producer stashing what its consumers
    read) is called with loss=None: this pass has no loss and no backward."""
    loads = []
    total_weight = 0.0
    for mb in microbatches:
        out = model(mb.ids_T, mb.ctx)
        if mb.after_forward is not None:
            mb.after_forward(out, None)
        loads.append(out.expert_load.detach().to(torch.float64).cpu())
        total_weight += float(mb.ctx.row_weight.detach().to(torch.float64).sum())
    if not loads:
        raise ValueError("the MoE statistics pass needs at least one microbatch")
    return MoEGlobalStats.from_loads(torch.stack(loads).sum(0), total_weight, model.config.top_k), loads


class ExpandedTrainer:
    """The baseline: trajectories packed into microbatches, each mixing only within itself.

    Subclasses change only `_microbatches` (the layout); the step loop, the loss and its
    denominators, the aux-loss rule and the optimizer are shared, so a difference between
    modes can only come from the layout.
    """

    def __init__(
        self,
        model: HybridModel,
        optimizer: OptimizerConfig | None = None,
        loss: PolicyLossConfig | None = None,
        *,
        kernels: KernelConfig | None = None,
    ):
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

    def _check_tokens(self, trajectories: Sequence[Trajectory]) -> None:
        vocab = self.model.config.vocab_size
        for t in trajectories:
            if t.tokens.size and int(t.tokens.max()) >= vocab:
                raise ValueError(
                    f"trajectory {t.id!r}: token id {int(t.tokens.max())} is outside the "
                    f"vocabulary of {self.model.config.name} (size {vocab})"
                )

    # whether a step's microbatches can be built before it runs (no microbatch depends on
    # an earlier one's results; sharing-window consumers do, see PlanTrainer)
    preparable = True

    def prepare(self, trajectories: Sequence[Trajectory], microbatch_tokens: int,
                partition: Sequence[Sequence[int]] | None = None) -> PreparedStep:
        """Build the step's partition and microbatch layouts now (see `PreparedStep`)."""
        if not self.preparable:
            raise NotImplementedError(f"{type(self).__name__} builds microbatches from earlier ones' results; "
                                      "it cannot prepare a step ahead")
        if not trajectories:
            raise ValueError("a step needs at least one trajectory")
        start = time.perf_counter()
        bins = self._bins(trajectories, microbatch_tokens, partition)
        mbs = list(self._microbatches(trajectories, bins))
        return PreparedStep(trajectories, microbatch_tokens, bins, mbs, time.perf_counter() - start)

    def _bins(self, trajectories: Sequence[Trajectory], microbatch_tokens: int,
              partition: Sequence[Sequence[int]] | None) -> list[list[int]]:
        bins = [list(b) for b in partition] if partition is not None else self.partition(trajectories, microbatch_tokens)
        covered = sorted(j for b in bins for j in b)
        if covered != list(range(len(trajectories))):
            raise ValueError("the microbatch partition must hold every trajectory exactly once")
        return bins

    def forward_backward(self, trajectories: Sequence[Trajectory], microbatch_tokens: int,
                         partition: Sequence[Sequence[int]] | None = None,
                         prepared: PreparedStep | None = None) -> StepResult:
        """Accumulate the step's gradient into .grad (not zeroed first); no optimizer step.
        grad_norm is the norm of .grad afterwards. `partition` fixes which trajectories
        share a microbatch (default: the layout's own packing under the budget);
        `prepared` (from `prepare` on the same trajectories) supplies them ready-built."""
        return self._run(trajectories, microbatch_tokens, backward=True, partition=partition, prepared=prepared)

    @torch.no_grad()
    def evaluate(self, trajectories: Sequence[Trajectory], microbatch_tokens: int,
                 partition: Sequence[Sequence[int]] | None = None) -> StepResult:
        """Forward only: log-probs, entropy, losses and expert loads; grad_norm is 0."""
        return self._run(trajectories, microbatch_tokens, backward=False, partition=partition)

    def recompute_old_logprobs(self, trajectories: Sequence[Trajectory], microbatch_tokens: int) -> list[Trajectory]:
        """The trajectories with old_logprobs replaced by the current policy's (on-policy
        PPO, as verl's actor recomputes old_log_prob before the update)."""
        result = self.evaluate(trajectories, microbatch_tokens)
        return [
            replace(t, old_logprobs=np.nan_to_num(lp, nan=0.0))
            for t, lp in zip(trajectories, result.logprobs, strict=True)
        ]

    def partition(self, trajectories: Sequence[Trajectory], microbatch_tokens: int) -> list[list[int]]:
        """Which trajectories share a microbatch: first-fit-decreasing on their lengths
        (`harts.plan.partition.packed_partition`)."""
        return packed_partition(trajectories, microbatch_tokens)

    def _microbatches(self, trajectories: Sequence[Trajectory], partition: Sequence[Sequence[int]]):
        model = self.model
        device = model.lm_head_weight.device
        dtype = model.lm_head_weight.dtype
        for members in partition:
            members = list(members)
            sizes = [len(trajectories[j]) for j in members]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            ids_T = to_device(np.concatenate([trajectories[j].tokens for j in members]), device)
            ctx = PackedContext(torch.from_numpy(offsets), chunk_size=model.config.chunk_size, kernels=self.kernels,
                                kernel_record=self.kernel_record).to(device)
            table = trajectory_targets(trajectories, members, offsets[:-1].tolist()).to(device, dtype)
            yield Microbatch(members, ids_T, ctx, table, int(offsets[-1]))

    def _run(self, trajectories: Sequence[Trajectory], microbatch_tokens: int, backward: bool,
             partition: Sequence[Sequence[int]] | None = None, prepared: PreparedStep | None = None) -> StepResult:
        if not trajectories:
            raise ValueError("a step needs at least one trajectory")
        self._check_tokens(trajectories)
        start = time.perf_counter()
        model = self.model
        lengths = [len(t) for t in trajectories]
        total_tokens = sum(lengths)
        den = step_denominators(trajectories)
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
                return self._microbatches(trajectories, bins)

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
            with mb.saved_tensors() if mb.saved_tensors is not None else nullcontext():
                out = model(mb.ids_T, mb.ctx)
                hidden_TD = out.hidden_TD if mb.hidden_of is None else mb.hidden_of(out.hidden_TD)
                pl = policy_loss(hidden_TD, model.lm_head_weight, mb.table, den, self.loss_config)
            if stats is None:
                # the aux loss of a microbatch weighs by its share of the step's (expanded) tokens
                aux = out.aux_loss * (mb.expanded_tokens / total_tokens)
            else:
                # global scope: already this microbatch's exact part of the step's aux loss
                aux = out.aux_loss
            loss = pl.loss + aux
            if mb.after_forward is not None:
                mb.after_forward(out, loss)
            elif backward:
                loss.backward()
            terms = (loss, pl.pg_loss, pl.kl, pl.entropy, aux, pl.clip_frac, pl.ppo_kl)  # LOSS_TERMS' order
            pending.append((torch.stack([v.detach().to(torch.float64).reshape(()) for v in terms]),
                            out.expert_load.detach().to(torch.float64), pl.logprob_N.detach().to(torch.float64),
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

        grad_norm = self._grad_norm() if backward else 0.0
        return StepResult(
            logprobs=np.split(logprob_flat, starts[1:-1]),
            entropy=np.split(entropy_flat, starts[1:-1]),
            losses=sums,
            grad_norm=grad_norm,
            expert_load=expert_load,
            tokens=total_tokens,
            trained_tokens=int(den.total_tokens),
            microbatches=bins,
            seconds=time.perf_counter() - start,
            layout=infos,
            kernels=self.kernels_used(),
        )

    def _grad_norm(self) -> float:
        """L2 norm of the accumulated .grad: one multi-tensor norm kernel rather than one
        launch per parameter (a distributed trainer computes it over the full gradient)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0

    def _statistics_pass(self, microbatches: Iterable[Microbatch]) -> tuple[MoEGlobalStats, list[torch.Tensor]]:
        """The step-global MoE statistics (`moe_statistics_pass`); a distributed trainer
        sums them over its replicas."""
        return moe_statistics_pass(self.model, microbatches)

    def kernels_used(self) -> dict:
        """{"config": the KernelConfig, "ran": {op: [impl]}, "fallbacks": [...]}: for results."""
        return {"config": self.kernels.to_dict(), **self.kernel_record.to_dict()}

    def step(self, trajectories: Sequence[Trajectory], microbatch_tokens: int,
             partition: Sequence[Sequence[int]] | None = None, prepared: PreparedStep | None = None) -> StepResult:
        """One update: zero grads, forward/backward over all microbatches, clip, AdamW step."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        result = self.forward_backward(trajectories, microbatch_tokens, partition, prepared)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.optimizer_config.grad_clip
        if max_norm is not None and params:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        return replace(result, seconds=time.perf_counter() - start)


def run_steps(trainer: ExpandedTrainer, batches: Iterable[Sequence[Trajectory]], microbatch_tokens: int, *,
              prefetch: bool = True) -> Iterator[StepResult]:
    """One update step per batch, yielding each step's result as it finishes.

    With `prefetch` (and a trainer that can `prepare`), batch i+1's data side (partition,
    layouts, index tensors copied to the device asynchronously) is built in a background
    thread while step i runs, so that host work overlaps GPU work as a data loader's does;
    the numbers are those of `trainer.step` on the same batches. Batches are read one ahead,
    so each must be final when the previous step starts (for on-policy PPO, recomputing old
    log-probs from the current model, step one batch at a time instead)."""
    if not (prefetch and trainer.preparable):
        for batch in batches:
            yield trainer.step(batch, microbatch_tokens)
        return
    from concurrent.futures import ThreadPoolExecutor

    it = iter(batches)
    with ThreadPoolExecutor(1, thread_name_prefix="harts-prepare") as pool:
        batch = next(it, None)
        pending = None if batch is None else pool.submit(trainer.prepare, batch, microbatch_tokens)
        while pending is not None:
            prepared = pending.result()
            nxt = next(it, None)
            pending = None if nxt is None else pool.submit(trainer.prepare, nxt, microbatch_tokens)
            yield trainer.step(prepared.trajectories, microbatch_tokens, prepared=prepared)


__all__ = [
    "ExpandedTrainer",
    "Microbatch",
    "OptimizerConfig",
    "PreparedStep",
    "StepResult",
    "moe_statistics_pass",
    "pack_microbatches",
    "run_steps",
    "step_denominators",
    "trajectory_targets",
]
