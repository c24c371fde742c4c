"""Policies side by side on the same trajectories, over seeds: the numbers the benchmark,
the study and `harts sim rollout --compare` report.

The best step-centric baseline of a seed is the highest throughput of any baseline at any
fixed degree in `baseline_mps` (so no baseline is held to a degree that suits it badly).
`critical_path_bound` is the makespan no policy can beat: the slowest trajectory alone
on a worker of the highest usable degree (its prefills, its decode at batch 1, its tool
calls, in sequence); best-baseline makespan / bound caps any policy's speedup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.cost import RolloutCost, make_rollout_cost
from harts.sim.rollout.engine import _valid_degrees, simulate_rollout
from harts.sim.rollout.policies import get_policy, known_policies
from harts.sim.rollout.types import TrajectorySpec
from harts.sim.rollout.workload import generate_trajectories


@dataclass(frozen=True)
class PolicyRun:
    seed: int
    policy: str
    baseline_mp: int
    step_centric: bool
    throughput_tokens_per_s: float
    makespan_s: float
    gpu_utilization: float
    migrations: int
    recomputed_tokens: int
    worker_degrees: tuple[int, ...]


@dataclass(frozen=True)
class SeedSummary:
    seed: int
    best_baseline: str  # "policy@MPd"
    best_baseline_throughput: float
    best_baseline_makespan_s: float
    bound_makespan_s: float
    speedup: dict[str, float]  # policy -> throughput / best baseline's (Heddle's at baseline_mp)

    @property
    def speedup_cap(self) -> float:
        return self.best_baseline_makespan_s / self.bound_makespan_s if self.bound_makespan_s > 0 else 0.0


def critical_path_bound(cfg: RolloutWorkload, specs: tuple[TrajectorySpec, ...], cost: RolloutCost) -> float:
    degree = max(_valid_degrees(cfg, cost, sorted(set(cfg.mp_degrees) | {cfg.baseline_mp})))
    worst = 0.0
    for s in specs:
        t, ctx = 0.0, 0
        for turn in s.turns:
            n = turn.input_tokens
            t += cost.prefill(n, n * ctx + n * (n + 1) / 2, degree)
            ctx += n
            t += turn.action_tokens * cost.decode_step(1, ctx + turn.action_tokens / 2, degree)
            ctx += turn.action_tokens
            t += turn.tool_latency_s
        worst = max(worst, t)
    return worst


def compare(cfg: RolloutWorkload, gpus: int, seeds: tuple[int, ...], policies: tuple[str, ...] | None = None,
            baseline_mps: tuple[int, ...] | None = None, progress: Any = None) -> tuple[list[PolicyRun], list[SeedSummary]]:
    policies = tuple(policies or known_policies())
    cost = make_rollout_cost(cfg)
    mps = tuple(baseline_mps or (cfg.baseline_mp,))
    runs: list[PolicyRun] = []
    summaries: list[SeedSummary] = []
    for seed in seeds:
        c = dataclasses.replace(cfg, seed=seed)
        specs = generate_trajectories(c)
        mine: list[PolicyRun] = []
        for name in policies:
            pol = get_policy(name)
            for mp in (mps if pol.step_centric else (cfg.baseline_mp,)):
                if progress:
                    progress(f"seed {seed}: {name} (MP{mp})")
                cc = dataclasses.replace(c, baseline_mp=mp)
                if gpus % mp or mp not in _valid_degrees(cc, cost, [mp]):
                    continue
                r = simulate_rollout(cc, pol, gpus, specs=specs, cost=cost)
                mine.append(PolicyRun(seed, name, mp, pol.step_centric, r.throughput_tokens_per_s, r.makespan_s,
                                      r.gpu_utilization, r.migrations, r.recomputed_tokens,
                                      tuple(w.degree for w in r.workers)))
        runs += mine
        base = [r for r in mine if r.step_centric]
        best = max(base, key=lambda r: r.throughput_tokens_per_s) if base else None
        bound = critical_path_bound(c, specs, cost)
        speed = {}
        for r in mine:
            if best and (not r.step_centric or r.baseline_mp == cfg.baseline_mp):
                speed[r.policy] = r.throughput_tokens_per_s / best.throughput_tokens_per_s
        summaries.append(SeedSummary(seed, f"{best.policy}@MP{best.baseline_mp}" if best else "-",
                                     best.throughput_tokens_per_s if best else 0.0,
                                     best.makespan_s if best else 0.0, bound, speed))
    return runs, summaries
