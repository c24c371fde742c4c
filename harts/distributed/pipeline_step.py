"""The pipeline trainer: a plan's step on one rank's stage under a simulator schedule
(`harts.distributed.pipeline` has the stages, the lowering and the design), its result, and
the executed schedule gathered from every rank."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import OVERLAP_F_B, _PipelineScheduleRuntime

from harts.config.kernels import KernelConfig
from harts.config.models import FFNKind
from harts.config.optimizer import OptimizerConfig
from harts.distributed.mesh import LaunchError
from harts.distributed.parallelize import ParallelModel
from harts.distributed.pipeline import (
    HartsStage,
    PipelineStageModule,
    StageMB,
    StageStep,
    fused_backward,
    lower_schedule,
)
from harts.exec.loss import PolicyLossConfig, policy_loss
from harts.exec.model.moe import MoEGlobalStats
from harts.exec.step import LOSS_TERMS, loss_terms, scale_gradients, step_denominators
from harts.exec.window import PlanTrainer
from harts.plan.plan import Plan
from harts.plan.schedule import PassOp, Schedule, ScheduleName, build_schedule
from harts.plan.step import step_from_plan
from harts.tree import Trajectory, build_forest

__all__ = ["PipelineStepResult", "PipelineTrainer", "ScheduleName", "executed_schedule"]


@dataclass(frozen=True)
class PipelineStepResult:
    """One step on one pipeline rank. `logprobs`/`entropy` (per trajectory of the step,
    NaN where another replica or position holds it) only on the last stage; `losses` are the
    step's sums and `expert_load` its [L, E] routed-token counts (every MoE layer, gathered
    over the stages; over the replicas too where the trainer has a `dp_group`), the same on
    every rank;
    `executed` the passes this stage ran, in order, and `simulated` the simulator's list for
    the same rank."""

    stage: int
    replica: int
    schedule: str
    executed: tuple[PassOp, ...]
    simulated: tuple[PassOp, ...]
    losses: dict[str, float]
    expert_load: np.ndarray
    grad_norm: float
    logprobs: list[np.ndarray] | None = None
    entropy: list[np.ndarray] | None = None
    seconds: float = 0.0
    layout: list[dict] = field(default_factory=list)


def executed_schedule(result: PipelineStepResult, group: dist.ProcessGroup | None = None) -> Schedule:
    """What every rank of `group` (default: the world, every replica's pipeline) ran, as a
    simulator `Schedule`: its text compares line by line with the simulated schedule's
    (`Schedule.to_text`). A collective: every rank of the group calls it."""
    mine = (result.replica, result.stage, result.executed)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    ranks = tuple(sorted(((r, s), tuple(ops)) for r, s, ops in gathered))
    return Schedule(result.schedule, max(s for _, s, _ in gathered) + 1,
                    max(r for r, _, _ in gathered) + 1, ranks)


class PipelineTrainer(PlanTrainer):
    """Runs a `Plan` on one replica's pipeline, one stage per rank of the mesh's "pp"
    group, in the order of the simulator's schedule `schedule` (a `ScheduleName`): a
    tree-mode plan's microbatches and windows, or an expanded plan's packed microbatches
    (and the chains of windows its trajectories longer than the budget run as).

    `pm` is `harts.distributed.parallelize.parallelize`'s result on a mesh with pp > 1: its
    model is this rank's stage, FSDP-sharded over "dp" when dp > 1 (FSDP2 then reduces the
    gradients itself at the runtime's REDUCE_GRAD). It is the step runner over the plan
    layout (every microbatch of the plan built on every rank) whose pass over the
    microbatches, `_run`, is the pipelining runtime's schedule; the runner's `step` zeroes
    the gradients, clips them by the global norm (`_clip_gradients`: the stages' squared
    norms all-reduced over the pipeline group, and over "dp") and steps AdamW on this
    stage's parameters. With dp > 1 (`dp_group`: the ranks of the same stage on the other
    replicas) the step's losses and statistics are summed over the replicas."""

    # `run_steps` steps it one batch at a time (its pass builds the data side itself)
    preparable = False

    def __init__(self, pm: ParallelModel, plan: Plan, schedule: ScheduleName | str, *,
                 optimizer: OptimizerConfig | None = None, loss: PolicyLossConfig | None = None,
                 kernels: KernelConfig | None = None):
        module, mesh = pm.model, pm.mesh
        if not isinstance(module, PipelineStageModule):
            raise ValueError("a pipeline trainer runs a pipeline stage: parallelize on a mesh with pp > 1")
        dp = mesh.parallel.dp
        if plan.dp != dp:
            raise LaunchError(f"the plan was made for dp={plan.dp}; the mesh has dp={dp}")
        self.schedule_name = ScheduleName(schedule)
        self.pm = pm
        self.group = mesh.group("pp")
        self.dp_group = mesh.group("dp") if dp > 1 else None
        self.replica = mesh.replica if dp > 1 else 0
        self.spec = module.spec
        super().__init__(module, plan, optimizer, loss, kernels=kernels)  # type: ignore[arg-type]

    def simulated_schedule(self, trajectories: Sequence[Trajectory]) -> Schedule:
        forest = build_forest(trajectories)
        return build_schedule(self.schedule_name, step_from_plan(self.plan, forest, self.model.config.chunk_size),
                              self.spec.num_stages)

    def _run(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None, backward: bool,
             partition=None, prepared=None) -> PipelineStepResult:  # noqa: ANN001
        """The step runner's pass over the step's microbatches, as the pipelining runtime runs
        the schedule: this stage's gradients of the step accumulated into .grad (not zeroed
        first); the rest of the step (clipping, AdamW) is the runner's."""
        if not backward:
            raise NotImplementedError("a forward-only pipeline step is not implemented")
        if partition is not None or prepared is not None:
            raise ValueError("a pipeline step builds its microbatches from the plan")
        if not trajectories:
            raise ValueError("a step needs at least one trajectory")
        self._check_tokens(trajectories)
        start = time.perf_counter()
        module: PipelineStageModule = self.model  # type: ignore[assignment]
        spec = self.spec
        schedule = self.simulated_schedule(trajectories)
        order, actions = lower_schedule(schedule, self.replica)
        run = self.layout.window_run(trajectories)
        items = {mb_id: (producer, ctx, mb) for mb_id, producer, ctx, mb in run.items}
        producers = set(run.consumers)
        mbs = []
        for i, mb_id in enumerate(order):
            producer, ctx, mb = items[mb_id]
            # an expanded plan's packed microbatch has no tree context: its own (packed) one
            mbs.append(StageMB(i, mb_id, producer, mb_id in producers, mb.ctx if ctx is None else ctx, mb.ids_T,
                               int(mb.ids_T.numel()), mb.table, mb.expanded_tokens))
        padded = max(m.rows for m in mbs)
        step = StageStep(module, mbs, padded)
        den = step_denominators(trajectories)
        lengths = [len(t) for t in trajectories]
        total_tokens = sum(lengths)
        config = module.config
        global_aux = config.aux_scope == "global" and config.num_moe_layers and config.aux_loss_coef
        ref = next(module.parameters())
        device, dtype = ref.device, ref.dtype
        num_moe = config.num_moe_layers
        moe_before = config.ffn_kinds[: spec.layers[0]].count(FFNKind.MOE) if spec.layers else 0

        if global_aux:
            step.stats = self._stage_statistics_pass(step, num_moe, moe_before, device)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        logprob_flat = np.full(total_tokens, np.nan)
        entropy_flat = np.full(total_tokens, np.nan)
        sums = np.zeros(len(LOSS_TERMS))

        def loss_fn(output, target):  # noqa: ANN001
            h_PD, aux = output
            mb = step.mbs[int(target.reshape(-1)[0])]
            pl = policy_loss(h_PD[: mb.rows], module.lm_head.weight, mb.table, den, self.loss_config)
            loss, terms = loss_terms(pl, aux.reshape(()),
                                     None if step.stats is not None else mb.expanded_tokens / total_tokens)
            sums[:] += terms.cpu().numpy()
            at = starts[mb.table.traj.cpu().numpy()] + mb.table.position.cpu().numpy()
            logprob_flat[at] = pl.logprob_N.to(torch.float64).cpu().numpy()
            entropy_flat[at] = pl.entropy_N.to(torch.float64).cpu().numpy()
            return step.inject(mb, loss) if mb.is_producer else loss

        D = config.d_model
        act = torch.empty(padded, D, dtype=dtype, device="meta", requires_grad=True)
        aux_meta = torch.empty(1, dtype=dtype, device="meta", requires_grad=True)
        idx_meta = torch.empty(1, dtype=torch.int64, device="meta")
        stage = HartsStage(module, spec.stage, spec.num_stages, device,
                            input_args=(idx_meta,) if spec.is_first else (act, aux_meta),
                            output_args=(act, aux_meta), group=self.group, step=step)
        runtime = _PipelineScheduleRuntime([stage], n_microbatches=len(mbs), loss_fn=loss_fn, scale_grads=False)
        runtime._prepare_schedule_with_comms({s: list(a) for s, a in actions.items()})
        runtime.register_custom_function(OVERLAP_F_B, fused_backward)
        index = torch.arange(len(mbs), dtype=torch.int64, device=device)
        module._step = step
        try:
            runtime.step(*((index,) if spec.is_first else ()), target=index, return_outputs=False)
        finally:
            module._step = None
        if step.stash:
            raise AssertionError(f"stage {spec.stage}: producers {sorted(step.stash)} kept their state after the step")

        # the step's loss sums and expert loads, gathered over the pipeline
        totals = torch.zeros(len(LOSS_TERMS) + num_moe * config.num_experts, dtype=torch.float64)
        if spec.is_last:
            totals[: len(LOSS_TERMS)] = torch.from_numpy(sums)
        load = totals[len(LOSS_TERMS):].view(num_moe, config.num_experts) if num_moe else None
        for m in mbs:
            part = step.loads.get(m.index)
            if part is not None:
                load[moe_before: moe_before + part.shape[0]] += part.cpu()
        dist.all_reduce(totals, group=self.group)
        if self.dp_group is not None:
            dist.all_reduce(totals, group=self.dp_group)
        losses = dict(zip(LOSS_TERMS, totals[: len(LOSS_TERMS)].tolist(), strict=True))
        expert_load = (totals[len(LOSS_TERMS):].view(num_moe, config.num_experts).numpy().copy() if num_moe
                       else np.zeros((0, config.num_experts)))
        grad_norm = self._global_grad_norm()
        return PipelineStepResult(
            stage=spec.stage, replica=self.replica, schedule=self.schedule_name.value,
            executed=tuple(stage.executed), simulated=schedule.ops(self.replica, spec.stage),
            losses=losses, expert_load=expert_load, grad_norm=grad_norm,
            logprobs=np.split(logprob_flat, starts[1:-1]) if spec.is_last else None,
            entropy=np.split(entropy_flat, starts[1:-1]) if spec.is_last else None,
            seconds=time.perf_counter() - start,
            layout=[{"mb": m.mb, "rows": m.rows, "role": "producer" if m.is_producer else
                     ("consumer" if m.producer is not None else "standalone")} for m in mbs],
        )

    @torch.no_grad()
    def _stage_statistics_pass(self, step: StageStep, num_moe: int, moe_before: int, device) -> MoEGlobalStats:  # noqa: ANN001
        """The step-global routing statistics (`moe_statistics_pass` over a pipeline): every
        microbatch's no-grad forward in forward order, the residual stream passed stage to
        stage, each stage's expert loads summed into its layers' rows of [L, E], then summed
        over the pipeline group. Producers record their stash here too (their consumers read
        it in this pass), and drop it after the forward of the last microbatch reading it."""
        module = step.module
        spec = module.spec
        config = module.config
        group_ranks = dist.get_process_group_ranks(self.group)
        prev = group_ranks[spec.stage - 1] if not spec.is_first else None
        nxt = group_ranks[spec.stage + 1] if not spec.is_last else None
        load = torch.zeros(num_moe, config.num_experts, dtype=torch.float64)
        total_weight = 0.0
        dtype = next(module.parameters()).dtype
        buf = torch.zeros(step.padded_rows, config.d_model, dtype=dtype, device=device)
        aux = torch.zeros(1, dtype=dtype, device=device)
        last_reader: dict[int, int] = {}
        for m in step.mbs:  # a chain's pieces read every producer up the chain
            p = m.producer
            while p is not None:
                last_reader[p] = m.index
                p = step.by_id[p].producer
        module._step = step
        try:
            for m in step.mbs:
                step.current = m
                if prev is not None:
                    dist.recv(buf, src=prev, group=self.group)
                    dist.recv(aux, src=prev, group=self.group)
                out, a = module(*(() if spec.is_first else (buf, aux)))
                if nxt is not None:
                    dist.send(out.contiguous(), dst=nxt, group=self.group)
                    dist.send(a.contiguous(), dst=nxt, group=self.group)
                part = step.loads.pop(m.index, None)
                if part is not None:
                    load[moe_before: moe_before + part.shape[0]] += part.cpu()
                total_weight += float(m.ctx.row_weight.detach().to(torch.float64).sum())
                for p, last in list(last_reader.items()):
                    if last == m.index:
                        step.release(step.by_id[p])
                        del last_reader[p]
        finally:
            module._step = None
        dist.all_reduce(load, group=self.group)
        if self.dp_group is not None:
            # the other replicas' microbatches: their loads and row weights
            weight = torch.tensor([total_weight], dtype=torch.float64)
            dist.all_reduce(load, group=self.dp_group)
            dist.all_reduce(weight, group=self.dp_group)
            total_weight = float(weight[0])
        return MoEGlobalStats.from_loads(load, total_weight, config.top_k)

    def _global_grad_norm(self) -> float:
        """sqrt of the sum of squared gradients over the pipeline's stages; an FSDP-sharded
        stage's shards (DTensors) are summed over the "dp" group first."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
        whole = [g for g in grads if not isinstance(g, DTensor)]
        sq = torch.zeros(1, dtype=torch.float64)
        if sharded:
            sq += float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(sharded)))) ** 2
            if self.dp_group is not None:
                dist.all_reduce(sq, group=self.dp_group)
        if whole:
            sq += float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(whole)))) ** 2
        dist.all_reduce(sq, group=self.group)
        return float(sq.sqrt())

    def _clip_gradients(self, grad_norm: float) -> None:
        """By the global gradient norm (torch's clip_grad_norm_ rule), on this stage's parameters."""
        scale_gradients(self.model, self.optimizer_config.grad_clip, grad_norm)
