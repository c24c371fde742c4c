"""What a step plan achieves: compression and load balance across data-parallel replicas.

- **compression** = expanded tokens / executed tokens. Executed tokens count every row
  each microbatch computes: rows recomputed in several microbatches count every time,
  producer rows once (consumers read them, they do not execute them). KDA replay (up to
  B - 1 state-only tokens before a chain that starts off the chunk grid) is *not*
  counted here; it belongs to the KDA call plan of each microbatch
  (`harts.plan.kda_calls`).
- **slot loads**: the load of replica r in slot s is the cost of its microbatch there,
  plus `forward_fraction` of any producer whose forward runs in that slot, plus the rest
  of a producer's cost in the slot of its last consumer (where its backward runs). Empty
  positions load 0.
- **slot balance** = mean over slots of (mean load / max load across replicas);
  **balance P5** = its 5th percentile over slots (linear interpolation);
  **step balance** = mean / max of the per-replica step totals.
Balances are fractions in (0, 1]; 1 is perfect.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from harts.plan.plan import Plan
from harts.tree.forest import RolloutForest


@dataclass(frozen=True)
class PlanMetrics:
    planner: str
    mode: str
    dp: int
    microbatches: int
    slots: int
    expanded_tokens: int
    executed_tokens: int
    compression: float
    slot_balance: float
    balance_p5: float
    step_balance: float
    max_memory_tokens: float
    plan_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def slot_loads(plan: Plan) -> np.ndarray:
    """float64 [slots, dp]: the load each replica runs in each slot (see module doc)."""
    ff = float(plan.cost_model.get("forward_fraction", 1.0 / 3.0))
    loads = np.zeros((plan.num_slots, plan.dp), dtype=np.float64)
    cons = plan.consumers()
    mbs = plan.microbatches
    for mb in mbs:
        if mb.id in cons:
            last = max((mbs[c] for c in cons[mb.id]), key=lambda m: m.order)
            loads[mb.slot, mb.replica] += ff * mb.cost
            loads[last.slot, mb.replica] += (1.0 - ff) * mb.cost
        else:
            loads[mb.slot, mb.replica] += mb.cost
    return loads


def balance(values: np.ndarray) -> float:
    """mean / max of non-negative loads (1.0 when all are zero)."""
    peak = float(np.max(values)) if values.size else 0.0
    return float(np.mean(values)) / peak if peak > 0 else 1.0


def per_slot_balance(plan: Plan) -> np.ndarray:
    loads = slot_loads(plan)
    return np.array([balance(row) for row in loads], dtype=np.float64)


def compute_metrics(plan: Plan, forest: RolloutForest) -> PlanMetrics:
    loads = slot_loads(plan)
    per_slot = np.array([balance(row) for row in loads], dtype=np.float64)
    executed = plan.executed_tokens
    return PlanMetrics(
        planner=plan.planner,
        mode=plan.mode.value,
        dp=plan.dp,
        microbatches=plan.num_microbatches,
        slots=plan.num_slots,
        expanded_tokens=forest.expanded_tokens,
        executed_tokens=executed,
        compression=forest.expanded_tokens / max(1, executed),
        slot_balance=float(per_slot.mean()) if per_slot.size else 1.0,
        balance_p5=float(np.percentile(per_slot, 5)) if per_slot.size else 1.0,
        step_balance=balance(loads.sum(axis=0)),
        max_memory_tokens=max(plan.memory_tokens(), default=0.0),
        plan_seconds=plan.plan_seconds,
    )
