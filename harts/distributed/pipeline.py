"""Pipeline parallelism on `torch.distributed.pipelining`: a plan's step run as the simulator
schedules it.

Shapes: T rows a microbatch computes, P rows every microbatch is padded to on the wire
(the step's largest T), D model dim.

Stages. `apply_pp(model, pp, num_stages)` keeps on this rank the blocks of its stage, the
split the simulator prices (`harts.plan.stages.stage_layers`: contiguous, as even as
possible; the embedding on the first stage, the final norm and the LM head on the last)
and drops the rest from the model. Each stage is one `PipelineStage` over a
`PipelineStageModule`; between stages travel the residual stream (padded to P rows, so that
every microbatch of the step has the static shape the stage's receive buffers are built
for; a pad row is a zero that nothing reads, so the values and gradients are exact) and
the running MoE auxiliary loss.

Microbatches are the plan's (`harts.exec.layouts.plan.PlanLayout` builds their data side:
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

Schedules. The simulator's `Schedule` (`harts.plan.schedule`) gives each (replica, stage)
rank its passes; `lower_schedule` turns them into the runtime's compute actions
(`_Action`): F m -> FORWARD, B m -> FULL_BACKWARD, the fused consumer + producer backward
B c+B p (consumer-1f1b) -> one OVERLAP_F_B container (the runtime's only compound action)
whose sub-actions are the two full backwards, run back to back with no communication
between them by a custom function (`register_custom_function`, `fused_backward`). A
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

Data parallel (a mesh with dp > 1): each replica runs its own microbatches on its own
pipeline; losses, expert loads and MoE statistics are summed over the replicas. Each stage
is sharded over the replicas by FSDP2 (`harts.distributed.parallelize.apply_fsdp`, the
settings a whole model gets: `fully_shard` per block, then the stage's root, not resharded
after each forward): the runtime's UNSHARD action all-gathers the stage once per step, its
backwards accumulate unsharded gradients without syncing, REDUCE_GRAD reduce-scatters them
once (summed: divide factor 1), RESHARD frees the gathered weights; AdamW then steps the
shards. So every replica issues the same collectives whatever its number of microbatches.

Modules: this one holds the stages, the schedule lowering and a stage's step machinery;
`harts.distributed.pipeline_step` the trainer (`PipelineTrainer`, `PipelineStepResult`,
`executed_schedule`). `harts.distributed.parallelize.parallelize` splits a model into this
rank's stage (pp > 1) and `harts.distributed.runner.distributed_trainer` builds its trainer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

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

from harts.config.models import ModelConfig
from harts.exec.model.model import HybridModel, run_blocks
from harts.exec.model.moe import MoEGlobalStats, set_moe_global
from harts.exec.stash import Stash, chain_view
from harts.plan.schedule import PassOp, Schedule
from harts.plan.stages import stage_layers

__all__ = [
    "HartsStage",
    "PipelineStageModule",
    "StageMB",
    "StageSpec",
    "StageStep",
    "apply_pp",
    "forward_order",
    "fused_backward",
    "lower_schedule",
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
    """The pipeline process group: given, a run's `harts.distributed.mesh.DistMesh` (its "pp"
    group), or a device mesh's "pp" dimension (its only dimension when it has no such name)."""
    if isinstance(pp, dist.ProcessGroup):
        return pp
    if hasattr(pp, "submesh") and hasattr(pp, "parallel"):  # a DistMesh
        return pp.group("pp")  # type: ignore[attr-defined]
    names = getattr(pp, "mesh_dim_names", None)
    if names is not None and "pp" in names:
        return pp.get_group("pp")  # type: ignore[attr-defined]
    if hasattr(pp, "get_group") and getattr(pp, "ndim", 1) == 1:
        return pp.get_group()  # type: ignore[attr-defined]
    raise ValueError("apply_pp needs a process group, a DistMesh or a device mesh with a 'pp' dimension")


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
        self._step: StageStep | None = None

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
        x_TD, aux, loads = run_blocks(self.layers.values(), x_TD, ctx, aux, self.recompute)
        step.loads[mb.index] = torch.stack(loads).detach().to(torch.float64) if loads else None
        if self.norm is not None:
            x_TD = self.norm(x_TD, ctx)
        pad = x_TD.new_zeros(step.padded_rows - x_TD.shape[0], x_TD.shape[1])
        out_PD = torch.cat([x_TD, pad]) if pad.shape[0] else x_TD.clone()
        return step.after_forward(mb, out_PD), aux


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
    return [t for t in ts if t.requires_grad]


def _stash_grads(stash: Stash, kept: list[Tensor]) -> list[Tensor | None]:
    outs, grads = stash.producer_backward_pairs()
    by_id = {id(o): g for o, g in zip(outs, grads, strict=True)}
    return [by_id.get(id(t)) for t in kept]


@dataclass
class StageMB:
    index: int  # runtime index (forward order)
    mb: int  # plan id
    producer: int | None
    is_producer: bool
    ctx: object
    ids_T: Tensor
    rows: int
    table: object
    expanded_tokens: int


class StageStep:
    """One step's microbatches on one stage and the window state between them."""

    def __init__(self, module: PipelineStageModule, mbs: list[StageMB], padded_rows: int):
        self.module = module
        self.mbs = mbs
        self.by_id = {m.mb: m for m in mbs}
        self.padded_rows = padded_rows
        self.current: StageMB = mbs[0]
        self.stash: dict[int, Stash] = {}  # producer id -> its recorded stash, until its backward
        self.readers: dict[int, list] = {}  # producer id -> contexts bound to it
        self.loads: dict[int, Tensor | None] = {}
        self.stats: MoEGlobalStats | None = None

    def before_forward(self, mb: StageMB) -> None:
        if self.stats is not None:
            set_moe_global(mb.ctx, self.stats)
        if mb.producer is not None:
            stash = self.stash.get(mb.producer)
            if stash is None:
                raise ValueError(f"consumer {mb.mb} runs before its producer {mb.producer} on stage "
                                 f"{self.module.spec.stage}")
            chain = [mb.producer]  # every producer up the chain, nearest first (harts.exec.stash.ChainStash)
            while self.by_id[chain[-1]].producer is not None:
                chain.append(self.by_id[chain[-1]].producer)
            mb.ctx.bind(chain_view([self.stash[p].leaves() for p in chain]))
            self.readers.setdefault(mb.producer, []).append(mb.ctx)
        if mb.is_producer:
            mb.ctx.start_recording()

    def after_forward(self, mb: StageMB, out_PD: Tensor) -> Tensor:
        if not mb.is_producer:
            return out_PD
        stash = mb.ctx.record
        stash.keep(stash.needs)
        self.stash[mb.mb] = stash
        if self.module.spec.is_last or not torch.is_grad_enabled():
            return out_PD  # the last stage injects into the loss
        return self.inject(mb, out_PD)

    def inject(self, mb: StageMB, out: Tensor) -> Tensor:
        stash = self.stash[mb.mb]
        kept = _stash_tensors(stash)
        return _InjectStashGrads.apply(lambda: _stash_grads(stash, kept), out, *kept)

    def release(self, mb: StageMB) -> None:
        """After a producer's backward: what its window held goes."""
        if not mb.is_producer:
            return
        for c in self.readers.pop(mb.mb, []):
            c.stash = None
        self.stash.pop(mb.mb, None)
        mb.ctx.release_record()


class HartsStage(PipelineStage):
    """A `PipelineStage` that points its module at the microbatch each pass runs, records
    the passes it ran, and frees a producer's window after the producer's backward."""

    def __init__(self, *args, step: StageStep, **kwargs):
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


def fused_backward(action: _Action, pctx: _PipelineContext) -> None:
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
