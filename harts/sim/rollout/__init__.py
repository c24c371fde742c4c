"""Discrete-event simulator of the rollout phase of agentic RL (no torch): trajectories
of turns and tool calls on inference workers with a model-parallel degree, priced by a
roofline (`cost`), scheduled by step-centric baselines or Heddle's trajectory-centric
mechanisms (`policies`), and the end-to-end step (rollout then training, `end_to_end`).
Entry point: `simulate_rollout`."""

from harts.sim.rollout.cost import RolloutCost, make_rollout_cost
from harts.sim.rollout.engine import make_workers, simulate_rollout
from harts.sim.rollout.policies import (
    BASELINES,
    POLICIES,
    RolloutPolicy,
    RolloutPolicyName,
    Router,
    get_policy,
    known_policies,
)
from harts.sim.rollout.types import (
    RolloutResult,
    Segment,
    SegmentKind,
    TrajectorySpec,
    TrajectoryTimeline,
    TurnSpec,
    Worker,
)
from harts.sim.rollout.workload import generate_trajectories

__all__ = [
    "BASELINES", "POLICIES", "RolloutCost", "RolloutPolicy", "RolloutPolicyName", "RolloutResult", "Router",
    "Segment", "SegmentKind", "TrajectorySpec", "TrajectoryTimeline", "TurnSpec", "Worker",
    "generate_trajectories", "get_policy", "known_policies", "make_rollout_cost", "make_workers",
    "simulate_rollout",
]
