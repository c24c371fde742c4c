"""Pipeline parallelism on `torch.distributed.pipelining`: a plan's step run as the simulator
schedules it.

Shapes: T rows a microbatch computes, P rows every microbatch is padded to on the wire
(the step's largest T), D model dim.

Stages. `apply_pp(model, pp, num_stages)` keeps on this rank the blocks of its stage, the
split the simulator prices (`harts.sim.parallel.stage_layers`: contiguous, as even as
possible; the embedding on the first stage, the final norm and the LM head on the last)
and drops the rest from the model. Each stage is one `PipelineStage` over a
`PipelineStageModule`; between stages travel the residual stream (padded to P rows, so that
every microbatch of the step has the static shape the stage's receive buffers are built
for; a pad row is a zero that nothing reads, so the values and gradients are exact) and
the running MoE auxiliary loss.

Microbatches are the plan's (`harts.exec.window.PlanTrainer` builds their data side:
layouts, KDA schedules, targets, every rank all of them): the mixing context of microbatch m
is the same object on every stage, and its layers are split over the stages, so a sharing
window splits too. A producer's forward on stage s records the `Stash` of the layers of s;
its consumers on s read that stash (local: a window never crosses ranks, only stages); the
producer's backward on s feeds its stage output gradient (received from s + 1) and the
gradients its consumers left on the stash's leaves through its graph in one pass. The
runtime's backward of a stage starts from its outputs alone, so the leaves' gradients
enter through `_InjectStashGrads`, an identity on the producer's stage output (the loss on
the last stage) whose backward returns them for the kept tensors; it reads them when the
backward runs, after the window's last consumer, as the schedule orders.

Schedules. The simulator's `Schedule` (`harts.sim.schedule`) gives each (replica, stage)
rank its passes; `lower_schedule` turns them into the runtime's compute actions
(`_Action`): F m -> FORWARD, B m -> FULL_BACKWARD, the fused consumer + producer backward
B c+B p (consumer-1f1b) -> one OVERLAP_F_B container (the runtime's only compound action)
whose sub-actions are the two full backwards, run back to back with no communication
between them by a custom function (`register_custom_function`, `_fused_backward`). A
producer's backward is the runtime's FULL_BACKWARD of its microbatch (the injection above
makes it the whole producer backward); the retained producer state (its stash, the
consumers' bindings to it) is released by the stage right after that backward.
`_PipelineScheduleRuntime._prepare_schedule_with_comms` adds the sends and receives; the
runtime executes the list; each stage records the passes it ran (`executed`), which
`PipelineStepResult` holds beside the simulated list for the same rank.

Loss. Denominators are the step's (`step_denominators` over every trajectory of the step,
all replicas), as in the single-process trainers, so the summed microbatch gradients are the
full-batch gradient; the runtime does not rescale (`scale_grads=False`). The MoE auxiliary
loss is per microbatch (`aux_scope="microbatch"`, each scaled by its share of the step's
tokens) or global (`aux_scope="global"`): then a no-grad pass over every microbatch, stage
after stage in forward order, sums the expert loads of each stage's layers and the pipeline
group all-reduces them into the step-global statistics before the training pass. That pass
sends the residual stream with `torch.distributed` send/recv rather than through the
runtime: a forward-only run of the same stage would switch the runtime's mode and rebuild
its receive buffers twice a step, and the pass has no loss and no schedule to follow.

Data parallel (`dp_group`, `pipeline_trainer` on a ("dp", "pp") mesh): each replica runs
its own microbatches on its own pipeline; losses, expert loads and MoE statistics are
summed over the replicas. Each stage is sharded over the replicas by FSDP2 (`fully_shard`
per block, then the stage's root, not resharded after each forward): the runtime's
UNSHARD action all-gathers the stage once per step, its backwards accumulate unsharded
gradients without syncing, REDUCE_GRAD reduce-scatters them once (summed: divide factor
1), RESHARD frees the gathered weights; AdamW then steps the shards. So every replica
issues the same collectives whatever its number of microbatches. `fsdp=False` keeps each
stage whole on every replica and all-reduces its gradients once per step instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    FULL_BACKWARD,
    OVERLAP_F_B,
    _Action,
    _ComputationType,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _wait_batch_p2p,
)
from torch.utils.checkpoint import checkpoint

from harts.config.kernels import KernelConfig
from harts.config.models import FFNKind, ModelConfig
from harts.config.optimizer import OptimizerConfig
from harts.exec.loss import PolicyLossConfig, policy_loss
from harts.exec.model.model import HybridModel
from harts.exec.model.moe import MoEGlobalStats, set_moe_global
from harts.exec.trainer import LOSS_TERMS, step_denominators
from harts.exec.tree import Stash
from harts.exec.window import PlanTrainer
from harts.plan.plan import Plan, PlanMode
from harts.plan.schedule import PassOp, Schedule, ScheduleName, build_schedule
from harts.plan.stages import stage_layers
from harts.plan.step import step_from_plan
from harts.tree import Trajectory, build_forest

__all__ = [
    "PipelineStageModule",
    "PipelineStepResult",
    "PipelineTrainer",
    "ScheduleName",
    "StageSpec",
    "apply_pp",
    "executed_schedule",
    "lower_schedule",
    "pipeline_trainer",
    "pp_group_of",
    "stage_spec",
]


# ---- stages -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, the model layers it runs and its ends."""

    stage: int
    num_stages: int
    layers: tuple[int, ...]
    has_embedding: bool
    has_lm_head: bool

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def pp_group_of(pp: dist.ProcessGroup | object) -> dist.ProcessGroup:
    """The pipeline process group: given, or a device mesh's "pp" dimension (its only
    dimension when it has no such name)."""
    if isinstance(pp, dist.ProcessGroup):
        return pp
    names = getattr(pp, "mesh_dim_names", None)
    if names is not None and "pp" in names:
        return pp.get_group("pp")  # type: ignore[attr-defined]
    if hasattr(pp, "get_group") and getattr(pp, "ndim", 1) == 1:
        return pp.get_group()  # type: ignore[attr-defined]
    raise ValueError("apply_pp needs a process group or a device mesh with a 'pp' dimension")


def stage_spec(config: ModelConfig, num_stages: int, stage: int) -> StageSpec:
    """Stage `stage` of `num_stages` under the simulator's split (`stage_layers`); checked
    before anything is built or communicated."""
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} of {num_stages} pipeline stages")
    if num_stages > config.num_layers:
        raise ValueError(f"pp={num_stages} is larger than the layer count of {config.name} ({config.num_layers})")
    if config.tie_embeddings and num_stages > 1:
        raise ValueError("pipeline parallelism with tied embeddings is not supported (the first and last "
                         "stages would share the embedding)")
    split = stage_layers(config, num_stages)[stage]
    return StageSpec(stage, num_stages, split.layers, split.has_embedding, split.has_lm_head)


class PipelineStageModule(nn.Module):
    """The part of a `HybridModel` one stage runs: the embedding (first stage), its blocks,
    the final norm and LM head (last stage). Its parameters are the model's own (their names
    under `model.named_parameters()` are unchanged). `forward` runs the microbatch the step
    loop has set (`PipelineTrainer`): the first stage takes the microbatch's index tensor,
    the others the previous stage's (padded residual stream, running aux loss).

    Its blocks are registered under their layer index in the whole model (`layers.<i>`), so
    the stage's state-dict names are the `HybridModel`'s: the stages of a pipeline hold
    disjoint names, and a checkpoint the stages write together (`torch.distributed.checkpoint`)
    is the whole model's, loadable under another split or by one process."""

    def __init__(self, model: HybridModel, spec: StageSpec):
        super().__init__()
        self.config = model.config
        self.spec = spec
        self.recompute = model.recompute
        self.embed = model.embed if spec.has_embedding else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        self.norm = model.norm if spec.has_lm_head else None
        self.lm_head = model.lm_head if spec.has_lm_head else None
        self._step: _StageStep | None = None

    def forward(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        step = self._step
        if step is None:
            raise RuntimeError("a pipeline stage runs inside PipelineTrainer's step")
        mb = step.current
        ctx = mb.ctx
        if self.spec.is_first:
            x_TD = self.embed(mb.ids_T)  # type: ignore[misc]
            aux = x_TD.new_zeros(1)
        else:
            x_PD, aux = inputs
            x_TD = x_PD[: mb.rows]
        step.before_forward(mb)
        loads = []
        for block in self.layers.values():
            if self.recompute and torch.is_grad_enabled():
                x_TD, layer_aux, load_E = checkpoint(block, x_TD, ctx, use_reentrant=False)
            else:
                x_TD, layer_aux, load_E = block(x_TD, ctx)
            if layer_aux is not None:
                aux = aux + layer_aux
                loads.append(load_E)
        step.loads[mb.index] = torch.stack(loads).detach().to(torch.float64) if loads else None
        if self.norm is not None:
            x_TD = self.norm(x_TD)
        pad = x_TD.new_zeros(step.padded_rows - x_TD.shape[0], x_TD.shape[1])
        out_PD = torch.cat([x_TD, pad]) if pad.shape[0] else x_TD.clone()
        return step.after_forward(mb, x_TD, out_PD), aux


def apply_pp(model: HybridModel, pp: dist.ProcessGroup | object, num_stages: int | None = None, *,
             stage: int | None = None) -> PipelineStageModule:
    """Split `model` into `num_stages` pipeline stages (default: the group's size) and keep
    this rank's: the returned module holds its parameters and the model keeps nothing else
    (other blocks become `nn.Identity`, the embedding leaves every stage but the first, the
    final norm and LM head every stage but the last). `stage` defaults to the rank in the
    pipeline group. Tied embeddings would put one parameter on the first and the last stage
    and are refused."""
    group = pp_group_of(pp)
    size = dist.get_world_size(group)
    num_stages = size if num_stages is None else num_stages
    if num_stages != size:
        raise ValueError(f"{num_stages} pipeline stages on a pipeline group of {size} ranks "
                         "(one stage per rank)")
    config = model.config
    spec = stage_spec(config, num_stages, dist.get_rank(group) if stage is None else stage)
    module = PipelineStageModule(model, spec)
    for i in range(config.num_layers):
        if i not in spec.layers:
            model.layers[i] = nn.Identity()
    if not spec.has_embedding:
        model.embed = None
    if not spec.has_lm_head:
        model.norm = None
        model.lm_head = None
    return module


# ---- schedules --------------------------------------------------------------------------


def forward_order(schedule: Schedule, replica: int) -> list[int]:
    """The microbatch ids in the order the replica's pipeline runs their forwards (the same
    on every stage: the builders differ per stage only in how far forwards run ahead)."""
    orders = {tuple(op.mbs[0] for op in schedule.ops(replica, s) if op.kind == "F")
              for s in range(schedule.num_stages)}
    if len(orders) != 1:
        raise ValueError(f"replica {replica}: the stages run forwards in different orders")
    return list(orders.pop())


def lower_schedule(schedule: Schedule, replica: int) -> tuple[list[int], dict[int, list[_Action]]]:
    """The runtime's compute actions for every stage of one replica's pipeline (key: the
    rank in the pipeline group, = stage) and the plan's microbatch id of each runtime index
    (index i = the i-th forward, so the runtime's losses, kept in forward order, line up)."""
    order = forward_order(schedule, replica)
    index = {m: i for i, m in enumerate(order)}
    actions: dict[int, list[_Action]] = {}
    for s in range(schedule.num_stages):
        out = []
        for op in schedule.ops(replica, s):
            if op.kind == "F":
                out.append(_Action(s, _ComputationType.FORWARD, index[op.mbs[0]]))
            elif not op.fused:
                out.append(_Action(s, FULL_BACKWARD, index[op.mbs[0]]))
            else:
                subs = tuple(_Action(s, FULL_BACKWARD, index[m]) for m in op.mbs)
                out.append(_Action(-1, OVERLAP_F_B, None, subs))
        actions[s] = out
    return order, actions


# ---- one step on one stage --------------------------------------------------------------


class _InjectStashGrads(torch.autograd.Function):
    """Identity on a producer's stage output (or loss) whose backward also hands the kept
    stash tensors the gradients its consumers accumulated on their leaves."""

    @staticmethod
    def forward(ctx, grads_of, out, *kept):  # noqa: ANN001
        ctx.grads_of = grads_of
        return out.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        return (None, grad, *ctx.grads_of())


def _stash_tensors(stash: Stash) -> list[Tensor]:
    ts = [t for group in stash.inputs.values() for t in group]
    ts += [t for t in stash.kda_states.values() if t is not None]
    if stash.hidden is not None:
        ts.append(stash.hidden)
    return [t for t in ts if t.requires_grad]


def _stash_grads(stash: Stash, kept: list[Tensor]) -> list[Tensor | None]:
    outs, grads = stash.producer_backward_pairs()
    by_id = {id(o): g for o, g in zip(outs, grads, strict=True)}
    return [by_id.get(id(t)) for t in kept]


@dataclass
class _StageMB:
    index: int  # runtime index (forward order)
    mb: int  # plan id
    producer: int | None
    is_producer: bool
    ctx: object
    ids_T: Tensor
    rows: int
    table: object
    expanded_tokens: int
    hidden_of: object


class _StageStep:
    """One step's microbatches on one stage and the window state between them."""

    def __init__(self, module: PipelineStageModule, mbs: list[_StageMB], padded_rows: int):
        self.module = module
        self.mbs = mbs
        self.by_id = {m.mb: m for m in mbs}
        self.padded_rows = padded_rows
        self.current: _StageMB = mbs[0]
        self.stash: dict[int, Stash] = {}  # producer id -> its recorded stash, until its backward
        self.readers: dict[int, list] = {}  # producer id -> contexts bound to it
        self.loads: dict[int, Tensor | None] = {}
        self.stats: MoEGlobalStats | None = None

    def before_forward(self, mb: _StageMB) -> None:
        if self.stats is not None:
            set_moe_global(mb.ctx, self.stats)
        if mb.producer is not None:
            stash = self.stash.get(mb.producer)
            if stash is None:
                raise ValueError(f"consumer {mb.mb} runs before its producer {mb.producer} on stage "
                                 f"{self.module.spec.stage}")
            mb.ctx.bind(stash.leaves())
            self.readers.setdefault(mb.producer, []).append(mb.ctx)
        if mb.is_producer:
            mb.ctx.start_recording()

    def after_forward(self, mb: _StageMB, x_TD: Tensor, out_PD: Tensor) -> Tensor:
        if not mb.is_producer:
            return out_PD
        stash = mb.ctx.record
        # on a stage without the head, the stage output stands in for the hidden rows (no
        # consumer reads them there, so their leaf never gets a gradient)
        stash.keep(stash.needs, x_TD)
        self.stash[mb.mb] = stash
        if self.module.spec.is_last or not torch.is_grad_enabled():
            return out_PD  # the last stage injects into the loss
        return self.inject(mb, out_PD)

    def inject(self, mb: _StageMB, out: Tensor) -> Tensor:
        stash = self.stash[mb.mb]
        kept = _stash_tensors(stash)
        return _InjectStashGrads.apply(lambda: _stash_grads(stash, kept), out, *kept)

    def release(self, mb: _StageMB) -> None:
        """After a producer's backward: what its window held goes."""
        if not mb.is_producer:
            return
        for c in self.readers.pop(mb.mb, []):
            c.stash = None
        self.stash.pop(mb.mb, None)
        mb.ctx.release_record()


class _HartsStage(PipelineStage):
    """A `PipelineStage` that points its module at the microbatch each pass runs, records
    the passes it ran, and frees a producer's window after the producer's backward."""

    def __init__(self, *args, step: _StageStep, **kwargs):
        super().__init__(*args, **kwargs)
        self.step = step
        self.executed: list[PassOp] = []
        self._fused: list[int] | None = None

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):  # noqa: ANN001
        self.step.current = self.step.mbs[fwd_chunk_id]
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.executed.append(PassOp("F", (self.step.current.mb,)))
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):  # noqa: ANN001
        mb = self.step.mbs[bwd_chunk_id]
        self.step.current = mb
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                   last_backward=last_backward)
        self.step.release(mb)
        if self._fused is not None:
            self._fused.append(mb.mb)
        else:
            self.executed.append(PassOp("B", (mb.mb,)))

    @contextlib.contextmanager
    def fused_pass(self):
        self._fused = []
        try:
            yield
        finally:
            mbs, self._fused = self._fused, None
        self.executed.append(PassOp("B", tuple(mbs)))


def _fused_backward(action: _Action, pctx: _PipelineContext) -> None:
    """OVERLAP_F_B container of full backwards (a consumer's, then its producer's): the
    runtime's full backward of each sub-action, back to back, recorded as one pass."""
    sched = pctx.schedule_ref
    assert isinstance(sched, _PipelineScheduleRuntime)
    stages = {s.stage_index: s for s in sched._stages}
    subs = action.sub_actions or ()
    if not subs or any(a.computation_type != FULL_BACKWARD for a in subs):
        raise ValueError(f"{action}: a fused backward holds full backwards only")
    stage = stages[subs[0].stage_index]
    with stage.fused_pass():
        for a in subs:
            mb = a.microbatch_index
            if not stage.is_last:
                _wait_batch_p2p(sched.bwd_recv_ops.pop((stage.stage_index, mb)))
            loss = sched._maybe_get_loss(stage, mb)
            sched.backward_counter[stage.stage_index] += 1
            last = sched.backward_counter[stage.stage_index] == sched._n_microbatches
            stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)


# ---- the trainer ------------------------------------------------------------------------


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
    """Runs a tree-mode `Plan` on one replica's pipeline, one stage per rank of `group`,
    in the order of the simulator's schedule `schedule` (a `ScheduleName`).

    The data side is `PlanTrainer`'s (every microbatch of the plan built on every rank);
    the step loop is the pipelining runtime's. `step` clips by the global gradient norm (the
    stages' squared norms all-reduced over the pipeline group, and over `dp_group` when
    given) and steps AdamW on this stage's parameters. With `dp_group` (the ranks of the
    same stage on the other replicas) the step's losses and statistics are summed over it,
    and with `reduce_grads` its gradients too, once per step (False where the stage module
    is FSDP-sharded: FSDP2 reduces them itself at the runtime's REDUCE_GRAD)."""

    # `run_steps` steps it one batch at a time (its step builds the data side itself)
    preparable = False

    def __init__(self, module: PipelineStageModule, plan: Plan, schedule: ScheduleName | str, *,
                 group: dist.ProcessGroup | None = None, replica: int = 0,
                 dp_group: dist.ProcessGroup | None = None, reduce_grads: bool = True,
                 optimizer: OptimizerConfig | None = None, loss: PolicyLossConfig | None = None,
                 kernels: KernelConfig | None = None):
        if plan.mode != PlanMode.TREE:
            raise ValueError("pipeline execution runs tree-mode plans")
        if not 0 <= replica < plan.dp:
            raise ValueError(f"replica {replica} is not one of the plan's {plan.dp}")
        self.schedule_name = ScheduleName(schedule)
        self.group = group if group is not None else dist.group.WORLD
        self.dp_group = dp_group
        self.reduce_grads = reduce_grads
        self.replica = replica
        self.spec = module.spec
        super().__init__(module, plan, optimizer, loss, kernels=kernels)  # type: ignore[arg-type]

    def simulated_schedule(self, trajectories: Sequence[Trajectory]) -> Schedule:
        forest = build_forest(trajectories)
        return build_schedule(self.schedule_name, step_from_plan(self.plan, forest, self.model.config.chunk_size),
                              self.spec.num_stages)

    def forward_backward(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None = None,
                         partition=None, prepared=None) -> PipelineStepResult:  # noqa: ANN001
        """Accumulate this stage's gradients of the step into .grad (not zeroed first)."""
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
        run = self._window_run(trajectories)
        items = {mb_id: (producer, ctx, mb) for mb_id, producer, ctx, mb in run.items}
        producers = set(run.consumers)
        mbs = []
        for i, mb_id in enumerate(order):
            producer, ctx, mb = items[mb_id]
            mbs.append(_StageMB(i, mb_id, producer, mb_id in producers, ctx, mb.ids_T, int(mb.ids_T.numel()),
                                mb.table, mb.expanded_tokens, mb.hidden_of))
        padded = max(m.rows for m in mbs)
        step = _StageStep(module, mbs, padded)
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
            step.stats = self._statistics_pass(step, num_moe, moe_before, device)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        logprob_flat = np.full(total_tokens, np.nan)
        entropy_flat = np.full(total_tokens, np.nan)
        sums = np.zeros(len(LOSS_TERMS))

        def loss_fn(output, target):  # noqa: ANN001
            h_PD, aux = output
            mb = step.mbs[int(target.reshape(-1)[0])]
            h_TD = h_PD[: mb.rows]
            hidden = h_TD if mb.hidden_of is None else mb.hidden_of(h_TD)
            pl = policy_loss(hidden, module.lm_head.weight, mb.table, den, self.loss_config)
            aux = aux.reshape(())
            aux = aux if step.stats is not None else aux * (mb.expanded_tokens / total_tokens)
            loss = pl.loss + aux
            terms = (loss, pl.pg_loss, pl.kl, pl.entropy, aux, pl.clip_frac, pl.ppo_kl)
            sums[:] += torch.stack([v.detach().to(torch.float64).reshape(()) for v in terms]).cpu().numpy()
            at = starts[mb.table.traj.cpu().numpy()] + mb.table.position.cpu().numpy()
            logprob_flat[at] = pl.logprob_N.to(torch.float64).cpu().numpy()
            entropy_flat[at] = pl.entropy_N.to(torch.float64).cpu().numpy()
            return step.inject(mb, loss) if mb.is_producer else loss

        D = config.d_model
        act = torch.empty(padded, D, dtype=dtype, device="meta", requires_grad=True)
        aux_meta = torch.empty(1, dtype=dtype, device="meta", requires_grad=True)
        idx_meta = torch.empty(1, dtype=torch.int64, device="meta")
        stage = _HartsStage(module, spec.stage, spec.num_stages, device,
                            input_args=(idx_meta,) if spec.is_first else (act, aux_meta),
                            output_args=(act, aux_meta), group=self.group, step=step)
        runtime = _PipelineScheduleRuntime([stage], n_microbatches=len(mbs), loss_fn=loss_fn, scale_grads=False)
        runtime._prepare_schedule_with_comms({s: list(a) for s, a in actions.items()})
        runtime.register_custom_function(OVERLAP_F_B, _fused_backward)
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
        if self.dp_group is not None and self.reduce_grads:
            self._reduce_grads()
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
    def _statistics_pass(self, step: _StageStep, num_moe: int, moe_before: int, device) -> MoEGlobalStats:  # noqa: ANN001
        """The step-global routing statistics (`moe_statistics_pass` over a pipeline): every
        microbatch's no-grad forward in forward order, the residual stream passed stage to
        stage, each stage's expert loads summed into its layers' rows of [L, E], then summed
        over the pipeline group. Producers record their stash here too (their consumers read
        it in this pass), and drop it after their last consumer's forward."""
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
        for m in step.mbs:
            if m.producer is not None:
                last_reader[m.producer] = m.index
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

    def _reduce_grads(self) -> None:
        """Sum this stage's gradients over the data-parallel replicas (their losses are
        already the step's shares, so the sum is the full-batch gradient)."""
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.dp_group)

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

    def prepare(self, *args, **kwargs):  # noqa: ANN002, ANN003
        raise NotImplementedError("a pipeline step builds its data side itself; it is not prepared ahead")

    def evaluate(self, *args, **kwargs):  # noqa: ANN002, ANN003
        raise NotImplementedError("a forward-only pipeline step is not implemented")

    def step(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None = None,
             partition=None, prepared=None) -> PipelineStepResult:  # noqa: ANN001
        """One update: zero grads, the pipelined forward/backward, clip by the global norm,
        AdamW on this stage's parameters."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        result = self.forward_backward(trajectories, microbatch_tokens, partition, prepared)
        max_norm = self.optimizer_config.grad_clip
        if max_norm is not None:
            coef = min(1.0, max_norm / (result.grad_norm + 1e-6))
            if coef < 1.0:
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step()
        return PipelineStepResult(**{**result.__dict__, "seconds": time.perf_counter() - start})


def pipeline_trainer(model: HybridModel, mesh: object, plan: Plan, schedule: ScheduleName | str, *,
                     fsdp: bool = True, **kwargs) -> PipelineTrainer:
    """This rank's pipeline trainer on a device mesh with a "pp" dimension (and optionally
    "dp"): `apply_pp` over the mesh's pipeline group, the replica its "dp" coordinate.
    With more than one replica the stage is sharded over the "dp" group by FSDP2
    (`fsdp`, the default: each block a unit, then the stage's root; parameters, gradients
    and AdamW state sharded; the runtime's UNSHARD / RESHARD / REDUCE_GRAD actions gather
    them once per step and reduce-scatter the gradients, summed, not averaged), or (`fsdp=False`) kept whole on every
    replica and all-reduced once per step. `kwargs` go to `PipelineTrainer` (optimizer,
    loss, kernels)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names:
        raise ValueError(f"pipeline_trainer needs a mesh with a 'pp' dimension; it has {names}")
    dp = mesh["dp"].size() if "dp" in names else 1  # type: ignore[index]
    if plan.dp != dp:
        raise ValueError(f"the plan was made for dp={plan.dp}; the mesh has dp={dp}")
    group = mesh.get_group("pp")  # type: ignore[attr-defined]
    module = apply_pp(model, group)
    replica, dp_group = 0, None
    reduce_grads = True
    if dp > 1:
        replica = mesh.get_local_rank("dp")  # type: ignore[attr-defined]
        dp_group = mesh.get_group("dp")  # type: ignore[attr-defined]
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            dp_mesh = mesh["dp"]  # type: ignore[index]
            # not resharded after each forward (as torchtitan's pipelines do): the runtime's
            # UNSHARD / RESHARD gather a stage once per step, so every replica issues the same
            # collectives however many microbatches its pipeline runs
            units = [fully_shard(block, mesh=dp_mesh, reshard_after_forward=False) for block in module.layers.values()]
            units.append(fully_shard(module, mesh=dp_mesh, reshard_after_forward=False))
            for u in units:
                u.set_gradient_divide_factor(1.0)  # the loss carries the step's denominators
                # a SUM collective in every dtype (float32 would use PREMUL_SUM, not in gloo)
                u.set_force_sum_reduction_for_comms(True)
            reduce_grads = False
    return PipelineTrainer(module, plan, schedule, group=group, replica=replica, dp_group=dp_group,
                           reduce_grads=reduce_grads, **kwargs)
