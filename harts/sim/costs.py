"""Cost models: the time and memory of every action of a simulated step.

One interface (`CostModel`), two op pricings of the same counted ops (`ops.py`):
- `roofline`: max(FLOPs / matmul rate, bytes / HBM bandwidth) per GEMM, bytes / bandwidth
  per elementwise kernel, the measured effective rate per attention mask kind, the measured
  KDA rate per token-head with a floor of (chunks of the longest sequence) x (chunk step)
  per packed call (the sequential-rounds term), bandwidth + latency per collective, plus a
  launch overhead per kernel. Nothing in it is fitted to the paper's numbers.
- `calibrated`: the same op list priced by coefficients fitted to a measured profile
  (`profile.py`); op kinds the profile does not cover fall back to the roofline price and
  are listed in `fallback_keys`.

A third, `executor` (`executor.py`, registered when `harts.sim` is imported), prices each
action as max(device, host launch time) from the profile's measured executor rates.

Registry: `COST_MODELS`, keyed by `CostModelName` (`harts.config.costs`); unknown or duplicate
names fail loudly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from harts.config.costs import CostModelName
from harts.config.models import ModelConfig
from harts.config.parallel import ParallelConfig
from harts.config.registry import Registry
from harts.plan.stages import stage_layers
from harts.plan.work import MicrobatchWork, StepWork
from harts.sim.hardware import HardwareProfile
from harts.sim.ops import OpCall, OpKind, Phase, StageCounter
from harts.sim.profile import Calibration, op_features, op_key

__all__ = [
    "COST_MODELS",
    "CalibratedPricer",
    "CostModel",
    "CostModelName",
    "OpPricer",
    "RooflinePricer",
    "make_cost_model",
    "register_cost_model",
]


class OpPricer(Protocol):
    def seconds(self, op: OpCall) -> float: ...


class RooflinePricer:
    def __init__(self, hw: HardwareProfile):
        self.hw = hw

    def seconds(self, op: OpCall) -> float:
        hw = self.hw
        launch = op.calls * hw.kernel_launch_s
        k = op.kind
        if k == OpKind.GEMM:
            return max(op.flops / hw.matmul_flops_per_s, op.bytes / hw.hbm_bytes_per_s) + launch
        if k in (OpKind.ELEMENTWISE, OpKind.OPTIMIZER):
            return op.bytes / hw.hbm_bytes_per_s + launch
        if k in (OpKind.ATTENTION_CAUSAL, OpKind.ATTENTION_TREE):
            rate = hw.attention_flops_per_s["causal" if k == OpKind.ATTENTION_CAUSAL else "tree"]
            fwd_flops = op.pair_heads * 2.0 * op.qk_v_dim
            bwd = hw.attention_bwd_over_fwd
            if op.phase == Phase.FWD:
                return fwd_flops / rate + hw.attention_kernels_fwd * hw.kernel_launch_s
            return fwd_flops * bwd / rate + hw.attention_kernels_bwd * hw.kernel_launch_s
        if k == OpKind.KDA_CHUNK:
            kref, vref = hw.kda_ref_head_dims
            total = op.token_heads_kv / (kref * vref) * hw.kda_s_per_token_head
            if op.phase == Phase.FWD:
                work, steps, kernels = total * hw.kda_fwd_fraction, op.chunk_steps, hw.kda_kernels_fwd
            else:
                work, steps, kernels = total * (1 - hw.kda_fwd_fraction), 2 * op.chunk_steps, hw.kda_kernels_bwd
            return op.calls * kernels * hw.kernel_launch_s + max(work, steps * hw.kda_chunk_step_s)
        link = hw.link(op.spans_nodes)
        if k == OpKind.ALL_TO_ALL:
            return op.comm_bytes / link.all_to_all_bytes_per_s + op.calls * link.latency_s
        if k == OpKind.P2P:
            return op.comm_bytes / link.p2p_bytes_per_s + op.calls * link.latency_s
        if k in (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER):
            # comm_bytes already carries the ring factor (g - 1) / g
            return op.comm_bytes / link.bus_bytes_per_s + op.calls * link.latency_s * max(1, op.group - 1)
        raise ValueError(f"roofline: no price for op kind {k}")


class CalibratedPricer:
    """Fitted coefficients where the profile covers the op kind, roofline elsewhere."""

    def __init__(self, calibration: Calibration, fallback: OpPricer):
        self.cal = calibration
        self.fallback = fallback
        self.fallback_keys: set[str] = set()
        self.calibrated_keys: set[str] = set()

    def seconds(self, op: OpCall) -> float:
        key = op_key(op.kind, op.phase, op.spans_nodes)
        scale = self.cal.elementwise_scale if op.kind == OpKind.ELEMENTWISE else 1.0
        fit = self.cal.fits.get(key)
        if fit is None:
            self.fallback_keys.add(key)
            return self.fallback.seconds(op) * scale
        self.calibrated_keys.add(key)
        return fit.predict(op_features(op)) * scale


@dataclass(frozen=True)
class ActionCost:
    seconds: float
    by_kind: tuple[tuple[str, float], ...]  # op kind -> seconds, for reports and trace diffs
    # the host's seconds issuing the action (`engine.Action.host`; then `seconds` is the
    # device's): 0 where the model prices launches inside `seconds` (roofline)
    host: float = 0.0


class CostModel:
    """Prices passes, sends and step-end work of one (model, parallel layout, hardware)."""

    def __init__(self, name: str, model: ModelConfig, parallel: ParallelConfig, hardware: HardwareProfile,
                 pricer: OpPricer, recompute: bool = True):
        self.name = name
        self.recompute = recompute
        self.model = model
        self.parallel = parallel
        self.hardware = hardware
        self.pricer = pricer
        self.stages = tuple(
            StageCounter(model, parallel, lay, hardware.gpus_per_node, recompute) for lay in stage_layers(model, parallel.pp)
        )
        self._pass = lru_cache(maxsize=None)(self._pass_uncached)

    def bind(self, step: StepWork) -> CostModel:
        """Called with the step before it is lowered; a model whose prices depend on the
        step's window structure (`executor`) reads it here."""
        return self

    def _price(self, op_counts: Sequence[tuple[OpCall, int]]) -> ActionCost:
        by: dict[str, float] = {}
        total = 0.0
        for op, count in op_counts:
            t = self.pricer.seconds(op) * count
            total += t
            by[op.kind.value] = by.get(op.kind.value, 0.0) + t
        return ActionCost(total, tuple(sorted(by.items())))

    def _pass_uncached(self, phase: Phase, stage: int, works: tuple[MicrobatchWork, ...]) -> ActionCost:
        return self._price(self.stages[stage].pass_op_counts(phase, works))

    def forward(self, stage: int, works: Sequence[MicrobatchWork]) -> ActionCost:
        return self._pass(Phase.FWD, stage, tuple(works))

    def backward(self, stage: int, works: Sequence[MicrobatchWork]) -> ActionCost:
        """One backward pass over `works` (several = a fused consumer + producer backward)."""
        return self._pass(Phase.BWD, stage, tuple(works))

    def send(self, phase: Phase, stage: int, work: MicrobatchWork) -> float:
        return self.pricer.seconds(self.stages[stage].p2p_op(phase, work))

    def grad_sync(self, stage: int) -> float:
        ops = [op for op in self.stages[stage].step_ops() if op.kind != OpKind.OPTIMIZER]
        return sum(self.pricer.seconds(op) for op in ops)

    def optimizer(self, stage: int) -> float:
        ops = [op for op in self.stages[stage].step_ops() if op.kind == OpKind.OPTIMIZER]
        return sum(self.pricer.seconds(op) for op in ops)

    # memory (bytes) -------------------------------------------------------------------
    def static_bytes(self, stage: int) -> float:
        return self.stages[stage].static_bytes()

    def activation_bytes(self, stage: int, work: MicrobatchWork) -> float:
        return self.stages[stage].activation_bytes_per_token() * work.tokens

    def producer_extra_bytes(self, stage: int, work: MicrobatchWork) -> float:
        return self.stages[stage].producer_extra_bytes_per_token() * work.tokens

    def producer_held_bytes(self, stage: int, work: MicrobatchWork, consumers: int) -> float:
        """What a window producer holds on the device from its forward to its backward.
        Without a pipeline the executor moves a producer's saved tensors to host memory
        while its consumers run (`harts.exec.offload`, its default on a GPU), so the
        producer holds its stash (`StageCounter.stash_bytes`); a pipeline stage keeps its
        activations and gradient accumulators on the device."""
        if self.parallel.pp == 1:
            return self.stages[stage].stash_bytes(work, consumers)
        return self.activation_bytes(stage, work) + self.producer_extra_bytes(stage, work)

    def transient_bytes(self, stage: int, works: Sequence[MicrobatchWork], phase: Phase = Phase.FWD) -> float:
        return self.stages[stage].transient_bytes(works, phase)


CostModelFactory = Callable[..., CostModel]
COST_MODELS: Registry[CostModelName, CostModelFactory] = Registry(
    "cost model", CostModelName, KeyError, duplicate_error=ValueError)


def register_cost_model(name: CostModelName, factory: CostModelFactory) -> None:
    COST_MODELS.register(name, factory)


def _roofline(model: ModelConfig, parallel: ParallelConfig, hardware: HardwareProfile,
              recompute: bool = True) -> CostModel:
    return CostModel("roofline", model, parallel, hardware, RooflinePricer(hardware), recompute)


def _calibrated(model: ModelConfig, parallel: ParallelConfig, hardware: HardwareProfile,
                calibration: Calibration | None = None, recompute: bool = True) -> CostModel:
    if calibration is None:
        raise ValueError("the calibrated cost model needs a calibration (fit_profile of a measured profile)")
    return CostModel("calibrated", model, parallel, hardware,
                     CalibratedPricer(calibration, RooflinePricer(hardware)), recompute)


register_cost_model(CostModelName.ROOFLINE, _roofline)
register_cost_model(CostModelName.CALIBRATED, _calibrated)


def make_cost_model(name: str, model: ModelConfig, parallel: ParallelConfig, hardware: HardwareProfile,
                    **kwargs: object) -> CostModel:
    return COST_MODELS.get(name)(model, parallel, hardware, **kwargs)
