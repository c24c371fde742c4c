"""The `executor` cost model: a step priced the way HARTS's executor runs it on one GPU.

What the roofline model misses, measured on H100 and H200 (docs/LOG.md, 2026-12-05): the
executor is host-bound at small microbatches. Each microbatch runs the whole model three
times (the forward under activation checkpointing, the recomputation, the backward; four
with the global aux scope's MoE-statistics no-grad forward), some 4,000-5,500 kernel
launches on tiny-h200, each costing the host ~40 us; when a microbatch's kernels are
shorter than that, the device idles. An action (a microbatch's forward or backward) has
device seconds and host seconds; the host issues a GPU's actions in order without waiting
for the device, so it runs ahead through device-bound actions and an action ends at

    max(its start + device seconds, the host's issue clock after its host seconds)

(`engine.Action.host`; on one GPU the step is the recurrence of `step_seconds_1gpu`). A
step of host-bound and device-bound actions costs less than the sum of each action's
max(device, host), which the model charged until 2026-12-05.

- device: the roofline price of the counted ops (`ops.py`, launch term left out) x
  `device_scale` (measured kernel time over roofline time on large microbatches; tree
  attention, causal attention and KDA further x `attention_tree_scale`,
  `attention_causal_scale`, `kda_scale`, fitted to the kernel time of each category) x
  `1 + half_efficiency_rows / rows` (small GEMMs and kernels run below their large-size
  efficiency), plus the window terms: a consumer gathers and accumulates its producer's
  stash (`consumer_device_s_per_producer_row` x the producer's rows its consumers read, in a
  chain of windows too: `bind`), a producer's saved tensors
  go to host memory and back (`offload_bytes_per_producer_row` / `offload_bytes_per_s` each
  way, on a copy stream beside the forward's and the backward's kernels: the longer of the
  two counts), and a long chain's outer stashes in host memory are read in at the same
  rate (`MicrobatchWork.host_context_rows`: once in a forward, three times in a backward);
- host: launches of the microbatch x `host_s_per_launch`, with the launches counted as
  `launches_per_microbatch` + `launches_per_extra_kda_round` per KDA round past the first
  + `launches_per_consumer` for a consumer (stash assembly, state handoff)
  + `launches_per_sequence` per sequence of its KDA rounds (the expanded baseline's attention
  runs once per trajectory, the tree's per query segment), counted on a
  model of `reference_layers` layers and scaled by the stage's layers; the forward
  action carries `forward_host_share` of them, the backward the rest. The forward action
  runs `forward_passes` full-model forwards: one, two where the model's global aux scope
  adds the statistics forward (`statistics_forwards`).
The step adds the optimizer (roofline), `launches_per_step` x `host_s_per_launch` and
`step_fixed_s`. Collectives and sends keep their roofline prices (what one GPU cannot
measure stays an assumption of the profile).

Every rate lives in the hardware profile's `executor` section with its source ("measured"
with the result file, "fitted" with the files it was fitted to, or "assumption").
`step_seconds_1gpu` is the same model in closed form for one GPU, over the passes in the
order the executor runs them (`executor_passes`; the fits use it; a test checks it against
the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from harts.config.costs import CostModelName
from harts.config.models import ModelConfig
from harts.config.parallel import ParallelConfig
from harts.plan.work import MicrobatchWork, StepWork
from harts.sim.costs import ActionCost, CostModel, RooflinePricer, register_cost_model
from harts.sim.executor_rates import ExecutorRates
from harts.sim.hardware import HardwareProfile
from harts.sim.ops import OpKind, Phase

__all__ = [
    "CATEGORIES",
    "ExecutorCostModel",
    "ExecutorRates",
    "MicrobatchFeatures",
    "microbatch_features",
    "FLOOR_FIELDS",
    "plan_floors",
    "executor_passes",
    "step_seconds_1gpu",
    "window_floors",
]

_COMM = {OpKind.ALL_TO_ALL, OpKind.P2P, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER}
CATEGORIES = ("attention", "kda", "token-wise", "collectives", "window", "optimizer")


def _category(kind: OpKind) -> str:
    if kind in (OpKind.ATTENTION_CAUSAL, OpKind.ATTENTION_TREE):
        return "attention"
    if kind == OpKind.KDA_CHUNK:
        return "kda"
    if kind in _COMM:
        return "collectives"
    return "optimizer" if kind == OpKind.OPTIMIZER else "token-wise"


@dataclass(frozen=True)
class MicrobatchFeatures:
    """What the executor model needs of one microbatch: roofline device seconds of one
    forward and of the backward (recomputation included), rows, KDA rounds, role."""

    fwd_s: float
    bwd_s: float
    comm_fwd_s: float  # collectives inside the passes (EP all-to-all), at their roofline price
    comm_bwd_s: float
    rows: int
    kda_rounds: int
    consumer: bool
    producer_rows: int  # a consumer: its producer's rows that consumers read; else 0
    producer: bool
    layer_ratio: float = 1.0  # the stage's layers over the profile's reference_layers
    forward_passes: float = 1.0  # full-model forwards in the forward action (`statistics_forwards`)
    sequences: int = 0  # sequences of the microbatch's KDA rounds, summed over rounds
    # the roofline seconds of fwd_s and bwd_s that are tree attention, causal attention and
    # KDA (`SCALED_KINDS`), each priced at its category scale
    fwd_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)
    bwd_parts: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # a reader's keys and values of outer stashes held in host memory, bytes read per pass
    host_read_bytes: float = 0.0


# the op kinds with a scale of their own (ExecutorRates.attention_tree_scale, ...), in
# MicrobatchFeatures.fwd_parts order
SCALED_KINDS = (OpKind.ATTENTION_TREE, OpKind.ATTENTION_CAUSAL, OpKind.KDA_CHUNK)


def _scales(rates: ExecutorRates) -> tuple[float, float, float]:
    return rates.attention_tree_scale, rates.attention_causal_scale, rates.kda_scale


def scaled_seconds(rates: ExecutorRates, total: float, parts: Sequence[float]) -> float:
    """Roofline seconds `total` with its `parts` (SCALED_KINDS) at their category scales."""
    return total + sum((k - 1.0) * x for k, x in zip(_scales(rates), parts, strict=True))


def kind_scale(rates: ExecutorRates, kind: OpKind) -> float:
    """An op kind's scale over device_scale (1 for the token-wise ops)."""
    return _scales(rates)[SCALED_KINDS.index(kind)] if kind in SCALED_KINDS else 1.0


def statistics_forwards(model: ModelConfig) -> int:
    """Full-model forwards in a microbatch's forward action: the checkpointed forward, plus
    the no-grad statistics forward of the global aux scope where it runs (a MoE model with
    an aux loss; harts.exec.step)."""
    return 1 + int(model.aux_scope == "global" and model.num_moe_layers > 0 and model.aux_loss_coef != 0)


def launches(rates: ExecutorRates, f: MicrobatchFeatures) -> float:
    """Kernel launches of one microbatch: counted on the reference model, scaled by layers
    (every layer launches its kernels once per pass; the loss head's share is small)."""
    return f.layer_ratio * (rates.launches_per_microbatch
                            + rates.launches_per_extra_kda_round * max(0, f.kda_rounds - 1)
                            + (rates.launches_per_consumer if f.consumer else 0.0)
                            + rates.launches_per_sequence * f.sequences)


def efficiency_factor(rates: ExecutorRates, rows: int) -> float:
    """Device time over its large-microbatch value at `rows` rows. A pass over no rows (an
    EP peer's shadow: `harts.plan.lockstep`) has only its fixed work (weight reads, the
    all-to-alls), which the factor, fitted on the per-row work of real microbatches, does
    not scale."""
    return 1.0 + rates.half_efficiency_rows / rows if rows > 0 else 1.0


def action_seconds(rates: ExecutorRates, phase: Phase, f: MicrobatchFeatures) -> tuple[float, float]:
    """(device, host) seconds of one microbatch's forward or backward action."""
    eff = rates.device_scale * efficiency_factor(rates, f.rows)
    host = launches(rates, f) * rates.host_s_per_launch
    # a producer's saved tensors go to host memory during its forward and come back during
    # its backward, on a copy stream of their own (harts.exec.offload): each way overlaps
    # that action's kernels, so it costs only where it is the longer of the two
    copy = f.rows * rates.offload_bytes_per_producer_row / rates.offload_bytes_per_s if f.producer else 0.0
    # outer stashes of a long chain in host memory (`harts.exec.stash.StashPart`), on the
    # same kind of copy stream: read in for the forward; in the backward read in for the
    # recomputation, and their gradient accumulators in and out again
    read = f.host_read_bytes / rates.offload_bytes_per_s
    copy += read if phase == Phase.FWD else 3.0 * read
    if phase == Phase.FWD:
        device = max(f.forward_passes * scaled_seconds(rates, f.fwd_s, f.fwd_parts) * eff, copy) + f.comm_fwd_s
        return device, host * rates.forward_host_share
    device = max(scaled_seconds(rates, f.bwd_s, f.bwd_parts) * eff, copy) + f.comm_bwd_s
    if f.consumer:
        device += f.producer_rows * rates.consumer_device_s_per_producer_row
    return device, host * (1.0 - rates.forward_host_share)


def step_fixed_seconds(rates: ExecutorRates) -> float:
    return rates.launches_per_step * rates.host_s_per_launch + rates.step_fixed_s


def executor_passes(step: StepWork) -> tuple[tuple[tuple[int, ...], Phase], ...]:
    """One GPU's passes in the order its executor runs them, as (indices into
    `step.microbatches`, phase): the one-stage `consumer-1f1b` schedule the engine runs
    (each forward in plan order; a consumer's backward right after its forward, a
    producer's right after its last consumer's, in the same pass where the schedule fuses
    them). So a chain of windows runs all its forwards and then its backwards, last piece
    first, and the host cannot run ahead of a forward into a backward between them."""
    from harts.plan.schedule import build_schedule

    if step.num_replicas != 1:
        raise ValueError(f"executor_passes prices one GPU: the step has {step.num_replicas} replicas")
    pos = {m.mb: i for i, m in enumerate(step.microbatches)}
    return tuple((tuple(pos[m] for m in op.mbs), Phase.FWD if op.kind == "F" else Phase.BWD)
                 for _, ops in build_schedule("consumer-1f1b", step, 1).ranks for op in ops)


def step_seconds_1gpu(rates: ExecutorRates, feats: Sequence[MicrobatchFeatures], optimizer_s: float,
                      passes: Sequence[tuple[Sequence[int], Phase]] | None = None) -> float:
    """A one-GPU step in closed form: the passes in sequence, each ending at max(the
    device's end of the previous one + its device seconds, the host's issue clock after
    its host seconds). `passes`: (indices into `feats`, phase) in execution order
    (`executor_passes`; a pass of several microbatches is one action, as the engine runs
    it); None: each microbatch's forward and then its backward, in order."""
    if passes is None:
        passes = [((i,), ph) for i in range(len(feats)) for ph in (Phase.FWD, Phase.BWD)]
    issued = done = 0.0  # the host's issue clock, the device's
    for idx, phase in passes:
        device = host = 0.0
        for i in idx:
            d, h = action_seconds(rates, phase, feats[i])
            device, host = device + d, host + h
        issued += host
        done = max(done + device, issued)
    return optimizer_s + step_fixed_seconds(rates) + done


class ExecutorCostModel(CostModel):
    """Roofline op counts, priced per action as device seconds and host issue seconds with
    the profile's executor rates (module docstring)."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: HardwareProfile,
                 recompute: bool = True, rates: ExecutorRates | None = None):
        rates = rates or hardware.executor
        if rates is None:
            raise ValueError(f"hardware profile {hardware.name!r} has no executor rates (an `executor` section); "
                             "use --cost-model roofline or a profile from `harts sim calibrate`")
        # the launch term is the host model's: the device side is priced without it
        pricer = RooflinePricer(replace(hardware, kernel_launch_s=0.0))
        super().__init__("executor", model, parallel, hardware, pricer, recompute)
        self.rates = rates
        self._layers = [lay.num_kda + lay.num_mla + lay.num_gdn + lay.num_gated_attention
                        for lay in (st.layers for st in self.stages)]
        self._rows: dict[int, int] = {}  # rows a consumer pays for, by its producer's id
        self._producers: set[int] = set()

    def bind(self, step: StepWork) -> ExecutorCostModel:
        """Tell the model which microbatches are producers and their sizes (window terms)."""
        # a consumer pays for its own producer's rows only, in a chain of windows too:
        # charging every producer up the chain priced the chains of
        # benchmarks/results/chains/2026-12-05-c6623d0-chains-h100.json 19-29% high, the
        # producer's rows alone 0-2% on the three plain chains (the rate is fitted on
        # one-level windows, where the two are the same)
        # (a producer's rows its consumers read: rows a producer computes for trajectories
        # of its own are no stash to gather)
        self._rows = {w.mb: w.tokens if w.read_rows is None else w.read_rows for w in step.microbatches}
        self._producers = set(step.producers)
        self._pass.cache_clear()
        return self

    def features(self, stage: int, work: MicrobatchWork) -> MicrobatchFeatures:
        def split(phase: Phase) -> tuple[float, float, tuple[float, float, float]]:
            comp = comm = 0.0
            parts = [0.0, 0.0, 0.0]
            for op, count in self.stages[stage].pass_op_counts(phase, (work,)):
                t = self.pricer.seconds(op) * count
                if op.kind in _COMM:
                    comm += t
                else:
                    comp += t
                    if op.kind in SCALED_KINDS:
                        parts[SCALED_KINDS.index(op.kind)] += t
            return comp, comm, (parts[0], parts[1], parts[2])

        fwd, comm_f, parts_f = split(Phase.FWD)
        bwd, comm_b, parts_b = split(Phase.BWD)
        consumer = work.producer is not None
        return MicrobatchFeatures(
            fwd_s=fwd, bwd_s=bwd, comm_fwd_s=comm_f, comm_bwd_s=comm_b, rows=work.tokens,
            kda_rounds=len(work.kda_rounds), consumer=consumer,
            producer_rows=self._rows.get(work.producer, 0) if consumer else 0,
            producer=work.mb in self._producers, layer_ratio=self._layers[stage] / self.rates.reference_layers,
            forward_passes=float(statistics_forwards(self.model)),
            sequences=sum(r.sequences for r in work.kda_rounds), fwd_parts=parts_f, bwd_parts=parts_b,
            # the executor moves outer stashes on one pipeline stage, where producers recompute
            host_read_bytes=(work.host_context_rows * self.stages[stage].attention_kv_bytes_per_row()
                             if self.parallel.pp == 1 and self.recompute else 0.0))

    def device_by_category(self, step: StepWork) -> dict[str, float]:
        """One GPU's simulated device seconds by op category (the categories `harts sim
        validate` measures): attention, kda, token-wise (GEMMs and elementwise), collectives,
        window (stash and offload terms), optimizer."""
        self.bind(step)
        r = self.rates
        out = dict.fromkeys(CATEGORIES, 0.0)
        for w in step.microbatches:
            f = self.features(0, w)
            eff = r.device_scale * efficiency_factor(r, f.rows)
            for phase, times in ((Phase.FWD, f.forward_passes), (Phase.BWD, 1.0)):
                for op, count in self.stages[0].pass_op_counts(phase, (w,)):
                    t = self.pricer.seconds(op) * count
                    cat = _category(op.kind)
                    out[cat] += t if cat == "collectives" else t * times * eff * kind_scale(r, op.kind)
            out["window"] += (action_seconds(r, Phase.FWD, f)[0] - f.comm_fwd_s
                              - f.forward_passes * scaled_seconds(r, f.fwd_s, f.fwd_parts) * eff)
            out["window"] += action_seconds(r, Phase.BWD, f)[0] - scaled_seconds(r, f.bwd_s, f.bwd_parts) * eff - f.comm_bwd_s
        out["optimizer"] = CostModel.optimizer(self, 0)
        return out

    def _pass_uncached(self, phase: Phase, stage: int, works: tuple[MicrobatchWork, ...]) -> ActionCost:
        # the device's seconds and the host's issue seconds (the engine runs the host ahead
        # of the device: `engine.Action.host`); a fused pass (a consumer's backward with its
        # producer's) issues and runs them one after the other on one stream
        device = host = 0.0
        for w in works:
            d, h = action_seconds(self.rates, phase, self.features(stage, w))
            device, host = device + d, host + h
        return ActionCost(device, (("device", device),), host=host)

    def optimizer(self, stage: int) -> float:
        return super().optimizer(stage) + step_fixed_seconds(self.rates)


def microbatch_features(cost: ExecutorCostModel, step: StepWork) -> list[MicrobatchFeatures]:
    cost.bind(step)
    return [cost.features(0, w) for w in step.microbatches]


def _executor(model: ModelConfig, parallel: ParallelConfig, hardware: HardwareProfile,
              recompute: bool = True) -> CostModel:
    return ExecutorCostModel(model, parallel, hardware, recompute)


register_cost_model(CostModelName.EXECUTOR, _executor)


def window_floors(model: ModelConfig, hardware: HardwareProfile, rows: int,
                  rates: ExecutorRates | None = None) -> tuple[float, float, float]:
    """(`PlanConfig.microbatch_floor`, `consumer_floor`, `consumer_row_cost`) for `model`
    on `hardware` at microbatches of `rows` rows, in the default load model's token
    equivalents: the host seconds of a microbatch's launches (and of a consumer's extra
    launches), and a consumer's device seconds per producer row, over the device seconds
    the executor model prices one token equivalent at, on one sequence of `rows` tokens
    run as one microbatch. A microbatch whose load is below the floor costs the floor: its
    kernels are shorter than the host takes to issue them."""
    import numpy as np

    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.plan.step import step_from_plan
    from harts.tree import build_forest
    from harts.tree.trajectory import Trajectory

    r = rates or hardware.executor
    if r is None:
        raise ValueError(f"hardware profile {hardware.name!r} has no executor rates")
    rows = max(int(rows), 2 * model.chunk_size)
    tokens = np.arange(rows, dtype=np.int64) % max(2, model.vocab_size)
    mask = np.ones(rows, bool)
    mask[0] = False
    forest = build_forest([Trajectory.make("floor", "floor", tokens, loss_mask=mask)])
    config = PlanConfig(microbatch_tokens=rows, chunk_size=model.chunk_size)
    step = step_from_plan(make_plan(forest, "l1", config), forest, model.chunk_size)
    cost = ExecutorCostModel(model, ParallelConfig(dp=1, pp=1, ep=1), hardware, rates=r)
    (f,) = microbatch_features(cost, step)
    device = sum(action_seconds(r, ph, f)[0] for ph in (Phase.FWD, Phase.BWD))
    per_token = device / float(config.cost_model.segment_cost(np.array([0]), np.array([rows]))[0])
    host = r.host_s_per_launch * f.layer_ratio
    return (r.launches_per_microbatch * host / per_token, r.launches_per_consumer * host / per_token,
            r.consumer_device_s_per_producer_row / per_token)


FLOOR_FIELDS = ("microbatch_floor", "consumer_floor", "consumer_row_cost")


def plan_floors(model: ModelConfig, hardware: HardwareProfile | str, rows: int) -> dict[str, float]:
    """`window_floors` as `PlanConfig` keyword arguments (`FLOOR_FIELDS`). `hardware` may be
    a profile or its name or path (`load_hardware`); a profile that is unknown or has no
    executor rates raises ValueError with a one-line message."""
    if isinstance(hardware, str):
        from harts.sim.hardware import load_hardware

        try:
            hardware = load_hardware(hardware)
        except (OSError, KeyError, ValueError) as err:
            raise ValueError(err.args[0] if isinstance(err, KeyError) and err.args else str(err)) from None
    if hardware.executor is None:
        raise ValueError(f"hardware profile {hardware.name!r} has no executor rates")
    return dict(zip(FLOOR_FIELDS, window_floors(model, hardware, rows), strict=True))
