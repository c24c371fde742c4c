"""The distributed step: each DP replica runs its microbatches of the plan, in lockstep.

`DistPlanTrainer` is the step runner (`harts.exec.step.StepRunner`) over a `ReplicaLayout`,
the plan layout restricted to this rank's replica (`Microbatch.replica` = the rank's "dp"
coordinate): the same step loop, loss, window machinery (producer stash, consumers,
producer backward after the last consumer) and optimizer. What the distribution adds sits
around that loop, in the runner's hooks, or between microbatches, in the layout, never
inside the loop:

- Denominators. Every rank holds the step's trajectories (the plan refers to the whole
  forest), so `step_denominators` are the step's on every rank without a collective.
- MoE global statistics. The no-grad statistics pass sums this replica's loads and row
  weights; one all-reduce over "dp" makes them the step's (the `_statistics_pass` hook).
- Collectives during microbatches. FSDP2 is driven so that it has none: every unit is
  all-gathered once when the step starts and keeps its gradients unreduced. Expert
  parallel has one all-to-all pair per MoE layer in every forward and backward, so the
  replicas of an EP group must run the same sequence of forwards and backwards: the
  group's *joint events* (`harts.plan.lockstep`, merged from the replicas' window runs).
  A replica without a microbatch in an event runs a *shadow*: a forward (and backward)
  over zero rows that takes part in the all-to-alls and computes the other replicas' rows
  on its experts; `ReplicaLayout` runs the shadows between the microbatches it yields, its
  window run pausing between a chain's producer backwards (one per event). Without EP the
  group is the replica alone and no shadow runs.
- Gradients are reduced once per step: after the last microbatch every rank runs one
  zero-row forward/backward with FSDP's gradient sync on, which reduce-scatters
  (sums) every unit's accumulated gradient, then reshards. A parameter this replica's
  microbatches did not reach (all of them on a replica the plan gives no microbatch, the
  LM head and the routed experts on one that only ran shadows) gets a zero gradient
  first, so every replica reduce-scatters the same parameters (torch's
  `set_reduce_scatter_unused_params` semantics, which torch 2.11 lacks). The runner's
  `_begin_pass` / `_finish_pass` hooks do this gathering and reducing.
- Results (log-probs, losses, expert loads, layouts) are gathered over "dp", so each rank's
  `StepResult` is the step's; `grad_norm` is the norm of the full gradient, and clipping
  uses it (the `_clip_gradients` hook).

`launch` starts `nprocs` worker processes on one host (torch.multiprocessing, gloo on CPU
or NCCL on CUDA, a free TCP port), joins them under a timeout and kills them on failure.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harts.config.kernels import KernelConfig
from harts.config.optimizer import OptimizerConfig
from harts.distributed.mesh import DistMesh, LaunchError, backend_for
from harts.distributed.parallelize import ParallelModel
from harts.distributed.teardown import exit_without_finalization
from harts.exec.layouts.plan import PAUSE, PlanLayout
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.moe import MoEGlobalStats
from harts.exec.step import Microbatch, StepResult, moe_statistics_pass, scale_gradients
from harts.exec.window import PlanTrainer
from harts.plan.lockstep import JointEvent
from harts.plan.lockstep import joint_events as plan_joint_events
from harts.plan.plan import Plan

__all__ = ["DistPlanTrainer", "JointEvent", "NullContext", "ReplicaLayout", "distributed_trainer", "free_port",
           "full_gradients", "joint_events", "launch", "zero_missing_grads"]


class NullContext:
    """A MixingContext over zero rows: what a shadow forward runs on."""

    num_rows = 0
    allows_token_dropping = True

    def __init__(self, device: torch.device, num_moe_layers: int, num_experts: int):
        self.row_weight = torch.zeros(0, dtype=torch.float64, device=device)
        self.position_ids = torch.zeros(0, dtype=torch.int64, device=device)
        # global statistics of zeros: the aux term is 0 without dividing by a zero weight
        self.moe_global_f = [torch.zeros(num_experts, dtype=torch.float64, device=device)
                             for _ in range(num_moe_layers)]
        self.moe_total_weight = 1.0

    def attention(self, layer, q_THD, k_THD, v_THE, scale):
        return v_THE

    def short_conv(self, layer, name, x_TD, weight_DW, bias_D):
        return x_TD

    def kda(self, layer, q_THK, k_THK, v_THV, g_THK, beta_TH, scale):
        return v_THV

    def kda_mixing(self, layer, q_TD, k_TD, v_TD, convs, gate_TR, gate, beta_TH, scale):
        H = beta_TH.shape[1]
        return v_TD.view(0, H, v_TD.shape[1] // H)


def joint_events(plan: Plan, replicas: Sequence[int]) -> list[JointEvent]:
    """The lockstep of `replicas` (an EP group) for `plan` (`harts.plan.lockstep`)."""
    return plan_joint_events(plan.microbatches, replicas)


_END = object()


class _ReplicaRun:
    """This replica's microbatches (from the plan layout's window run or packed layout) as
    the step runner iterates them, with the EP group's shadows run between them."""

    def __init__(self, layout: ReplicaLayout, source: Callable[[], Any], ids: list[int]):
        self.layout = layout
        self.source = source  # a fresh iterator of this replica's Microbatch objects
        self.ids = ids  # their plan ids, in that order

    def __iter__(self):
        lay = self.layout
        me = lay.replica
        source = iter(self.source())
        pending: list[Microbatch] = []
        taken = 0
        grad = torch.is_grad_enabled()
        open_shadows: dict[int, Any] = {}
        for ev in lay.events:
            mine = ev.members.get(me)
            if ev.kind == "B":
                if mine is None:
                    if ev.key in open_shadows:
                        lay.shadow_backward(open_shadows.pop(ev.key))
                else:
                    # resuming the window run runs the producer's backward (its last consumer
                    # is done); it pauses before the next of a cascade, or goes on to the
                    # next microbatch
                    nxt = next(source, _END)
                    if nxt is not _END and nxt is not PAUSE:
                        pending.append(nxt)
            elif mine is not None:
                if mine != self.ids[taken]:
                    raise RuntimeError(f"replica {me}: event order runs microbatch {mine}, the window run "
                                       f"yields {self.ids[taken]}")
                taken += 1
                yield pending.pop(0) if pending else next(source)
            else:
                out = lay.shadow_forward()
                if grad and ev.kind == "FB":
                    lay.shadow_backward(out)
                elif grad:
                    open_shadows[ev.key] = out
        if next(source, _END) is not _END or pending:
            raise RuntimeError(f"replica {me}: microbatches left after the step's events")


class ReplicaLayout(PlanLayout):
    """The plan layout of one DP replica: its microbatches in its plan order, interleaved
    with its EP group's shadows (module docstring); its partition holds only its own
    trajectories (the plan's validation checks the whole step's cover)."""

    covers_step = False
    pause_cascades = True

    def __init__(self, plan: Plan, mesh: DistMesh):
        super().__init__(plan)
        self.mesh = mesh
        self.replica = me = mesh.replica
        self.execution_order = [m.id for m in sorted((m for m in plan.microbatches if m.replica == me),
                                                     key=lambda m: m.order)]
        ep = mesh.parallel.ep
        first = me - me % ep
        self.events = joint_events(plan, range(first, first + ep))

    def bind(self, model, kernels, kernel_record) -> ReplicaLayout:  # noqa: ANN001
        super().bind(model, kernels, kernel_record)
        cfg = model.config
        self._null = NullContext(self.mesh.device, cfg.num_moe_layers, cfg.num_experts)
        return self

    def microbatches(self, trajectories, partition):  # noqa: ANN001
        return _ReplicaRun(self, lambda: PlanLayout.microbatches(self, trajectories, partition),
                           list(self.execution_order))

    def prepare(self, trajectories, partition):  # noqa: ANN001
        built = PlanLayout.prepare(self, trajectories, partition)
        return _ReplicaRun(self, lambda: iter(built), list(self.execution_order))

    def shadow_forward(self):
        """A forward over zero rows: this replica's part of its group's collectives."""
        ids = torch.zeros(0, dtype=torch.int64, device=self.mesh.device)
        return self.model(ids, self._null)

    @staticmethod
    def shadow_backward(out) -> None:  # noqa: ANN001
        (out.hidden_TD.sum() + out.aux_loss).backward()


class DistPlanTrainer(PlanTrainer):
    """The step runner over this DP replica's `ReplicaLayout` (module docstring): the
    runner's hooks gather FSDP's shards before the pass, sum the statistics over "dp", and
    after the pass reduce the gradients, gather the results and clip by the full
    gradient's norm."""

    def __init__(self, pm: ParallelModel, plan: Plan, optimizer: OptimizerConfig | None = None,
                 loss: PolicyLossConfig | None = None, *, kernels: KernelConfig | None = None):
        mesh = pm.mesh
        if plan.dp != mesh.parallel.dp:
            raise LaunchError(f"the plan was made for dp={plan.dp} replicas; this launch has dp={mesh.parallel.dp}")
        if mesh.parallel.pp > 1:
            raise NotImplementedError("pp > 1 runs on the pipeline trainer (distributed_trainer builds it)")
        super().__init__(pm.model, plan, optimizer, loss, kernels=kernels, layout=ReplicaLayout(plan, mesh))
        self.pm, self.mesh = pm, mesh
        self._dp_group = mesh.group("dp")

    def _statistics_pass(self, microbatches):  # noqa: ANN001
        """This replica's statistics pass, summed over "dp" into the step's."""
        cfg = self.model.config
        loads: list[torch.Tensor] = []
        local = torch.zeros(cfg.num_moe_layers, cfg.num_experts, dtype=torch.float64)
        weight = 0.0
        if self.layout.execution_order:
            stats, loads = moe_statistics_pass(self.model, microbatches)
            local, weight = torch.stack(loads).sum(0), stats.total_weight
        else:
            with torch.no_grad():  # a replica without microbatches only runs the group's shadows
                for _ in microbatches:
                    pass
        both = torch.cat([local.reshape(-1), torch.tensor([weight], dtype=torch.float64)]).to(self.mesh.device)
        dist.all_reduce(both, group=self._dp_group)
        both = both.cpu()
        return MoEGlobalStats.from_loads(both[:-1].view_as(local), float(both[-1]), cfg.top_k), loads

    def _begin_pass(self) -> None:
        self.pm.unshard()

    def _finish_pass(self, result: StepResult, backward: bool) -> StepResult:
        """Every unit's gradients reduce-scattered by one zero-row pass with FSDP's sync on
        (a parameter this replica did not reach given a zero gradient first), the shards
        released, the results gathered over "dp", and the full gradient's norm."""
        if backward:
            self.pm.enable_gradient_sync()
            if self.pm.fsdp_modules:
                zero_missing_grads(self.model)
            self.layout.shadow_backward(self.layout.shadow_forward())  # every unit's one reduce-scatter
        self.pm.reshard()
        result = self._gather(result)
        return replace(result, grad_norm=global_grad_norm(self.pm) if backward else 0.0)

    def _gather(self, result: StepResult) -> StepResult:
        parts: list[Any] = [None] * dist.get_world_size(self._dp_group)
        mine = (result.logprobs, result.entropy, result.losses, result.expert_load, result.layout,
                result.microbatches)
        dist.all_gather_object(parts, mine, group=self._dp_group)
        logprobs = merge_per_trajectory([p[0] for p in parts])
        entropy = merge_per_trajectory([p[1] for p in parts])
        losses = {k: sum(p[2][k] for p in parts) for k in result.losses}
        loads = [p[3] for p in parts if p[3] is not None]
        return replace(result, logprobs=logprobs, entropy=entropy, losses=losses,
                       expert_load=sum(loads[1:], loads[0]) if loads else None,
                       layout=[x for p in parts for x in p[4]], microbatches=[x for p in parts for x in p[5]])

    def _clip_gradients(self, grad_norm: float) -> None:
        """By the full gradient's norm (torch's clip_grad_norm_ rule), on the local shards."""
        scale_gradients(self.model, self.optimizer_config.grad_clip, grad_norm)


def distributed_trainer(pm: ParallelModel, plan: Plan, *, schedule: str = "consumer-1f1b",
                        optimizer: OptimizerConfig | None = None, loss: PolicyLossConfig | None = None,
                        kernels: KernelConfig | None = None) -> PlanTrainer:
    """This rank's trainer of `plan` on `pm` (`harts.distributed.parallelize.parallelize`'s
    result), the one place either distributed trainer is built: with pp > 1 the pipeline's
    (`harts.distributed.pipeline_step.PipelineTrainer`, the simulator's `schedule` lowered to
    the pipelining runtime), else this replica's `DistPlanTrainer`."""
    if pm.mesh.parallel.pp > 1:
        from harts.distributed.pipeline_step import PipelineTrainer

        return PipelineTrainer(pm, plan, schedule, optimizer=optimizer, loss=loss, kernels=kernels)
    return DistPlanTrainer(pm, plan, optimizer, loss, kernels=kernels)


def zero_missing_grads(model: torch.nn.Module) -> None:
    """A zero gradient for every trainable parameter without one: its part of a summed
    reduction when this rank's microbatches did not use it (module docstring)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def merge_per_trajectory(parts: Sequence[Sequence[np.ndarray] | None]) -> list[np.ndarray] | None:
    """Per-trajectory arrays that ranks filled in part (NaN where another rank holds the
    value), merged: each position from the first rank that has it. None parts (a rank
    that holds none, such as a pipeline's earlier stages) are skipped."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = [np.array(a) for a in parts[0]]
    for other in parts[1:]:
        for j in range(len(out)):
            out[j] = np.where(np.isnan(out[j]), other[j], out[j])
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def global_grad_norm(pm: ParallelModel) -> float:
    """L2 norm of the full gradient: DTensor norms over their meshes, local slices summed
    over the ranks holding the other slices; the same value on every rank."""
    total = 0.0
    for name, p in pm.model.named_parameters():
        if p.grad is None:
            continue
        sq = _full(torch.linalg.vector_norm(p.grad.detach().to(torch.float64))) ** 2
        info = pm.shards.get(name)
        if info is not None:
            sq = sq.reshape(1).clone()
            dist.all_reduce(sq, group=pm.mesh.group(info.mesh_dim))
        total += float(sq.sum())
    return math.sqrt(total)


def full_gradients(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient under its single-process name (CPU), on every rank."""
    out: dict[str, torch.Tensor] = {}
    for name, p in pm.model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = _full(g).detach()
        info = pm.shards.get(name)
        if info is not None:
            group = pm.mesh.group(info.mesh_dim)
            parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, g.contiguous(), group=group)
            g, name = torch.cat(parts, dim=info.dim), info.name
        out[name] = g.cpu()
    return out


# ---- launching workers on one host ----------------------------------------------------------


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (bound and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(index: int, fn: Callable, port: int, nprocs: int, device: str, args: tuple) -> None:
    import datetime
    import faulthandler

    faulthandler.enable(all_threads=True)  # a worker killed by a signal prints every thread's stack
    torch.set_num_threads(1)
    kw = {}
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(index % torch.cuda.device_count())
        kw["device_id"] = torch.device("cuda", index % torch.cuda.device_count())
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=index,
                            world_size=nprocs, timeout=datetime.timedelta(seconds=120), **kw)
    try:
        fn(*args)
        dist.barrier()  # no rank tears its group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # a failure above raises to spawn's error file instead


def launch(fn: Callable, args: tuple, nprocs: int, *, device: str = "cpu", timeout: float = 300.0) -> None:
    """Run `fn(*args)` in `nprocs` new processes forming one process group (rank = process
    index); raise if any fails or the whole run exceeds `timeout` seconds, killing the rest."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(fn, free_port(), nprocs, device, args), nprocs=nprocs,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed workers still running after {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(timeout=10)
