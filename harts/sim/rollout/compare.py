"""Policies side by side on the same trajectories, over seeds: the numbers the benchmark,
the study and `harts sim rollout --compare` report.

The best step-centric baseline of a seed is the highest throughput of any baseline at any
fixed degree in `baseline_mps` (so no baseline is held to a degree that suits it badly).
Three makespans no policy can beat: `critical_path_bound`, the slowest trajectory alone
on a worker of the highest usable degree (its prefills, its decode at batch 1, its tool
calls, in sequence); `tail_bound`, the k longest trajectories' tokens over the most tokens
per second k sequences can be decoded at on the GPUs (for every k); and `work_bound`, the
GPU-seconds the step's KV reads, weight reads and prefills need at least, over the GPUs.
Best-baseline makespan / the largest of the three caps any policy's speedup (each bound
alone is loose: a schedule meeting one, e.g. the slowest trajectory alone on a worker,
cannot meet another, the work at the cheapest degree, at the same time).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.cost import RolloutCost, make_rollout_cost
from harts.sim.rollout.engine import _valid_degrees, simulate_rollout, usable_degrees
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
    worker_degrees: tuple[int, ...]  # the layout the step starts with
    merges: int = 0  # idle worker pairs merged during the step (dynamic MP)


@dataclass(frozen=True)
class SeedSummary:
    seed: int
    best_baseline: str  # "policy@MPd"
    best_baseline_throughput: float
    best_baseline_makespan_s: float
    bound_makespan_s: float  # the larger of the two below
    speedup: dict[str, float]  # policy -> throughput / best baseline's (Heddle's at baseline_mp)

    @property
    def speedup_cap(self) -> float:
        return self.best_baseline_makespan_s / self.bound_makespan_s if self.bound_makespan_s > 0 else 0.0

    critical_path_s: float = 0.0
    tail_bound_s: float = 0.0
    work_bound_s: float = 0.0


def critical_path_bound(cfg: RolloutWorkload, specs: tuple[TrajectorySpec, ...], cost: RolloutCost) -> float:
    degree = max(usable_degrees(cfg, cost))
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


def max_decode_rate(cfg: RolloutWorkload, cost: RolloutCost, gpus: int, n: int) -> np.ndarray:
    """R[s] for s = 0..n: the most tokens per second that at most s sequences can be
    decoded at, together, on `gpus` GPUs split into workers of usable degrees, each worker
    running a batch up to the batch limit and its KV capacity, priced with no context (a
    real iteration reads its contexts too, so it is never cheaper)."""
    degrees = usable_degrees(cfg, cost)
    # best[g, s]: the largest rate of workers using g GPUs in all and s sequences in all
    best = np.full((gpus + 1, n + 1), -np.inf)
    best[0, 0] = 0.0
    for g in range(1, gpus + 1):
        for d in degrees:
            if d > g:
                continue
            limit = max(1, min(cfg.max_batch, int(cost.kv_capacity(d) // max(cost.state_bytes_per_seq, 1.0))))
            prev = best[g - d]
            for b in range(0, min(limit, n) + 1):
                rate = b / cost.decode_step(b, 0.0, d) if b else 0.0
                cand = np.full(n + 1, -np.inf)
                cand[b:] = prev[: n + 1 - b] + rate
                best[g] = np.maximum(best[g], cand)
    rate = np.maximum.accumulate(best.max(axis=0))  # GPUs may stay idle, sequences unused
    return np.maximum(rate, 0.0)


def tail_bound(cfg: RolloutWorkload, specs: tuple[TrajectorySpec, ...], cost: RolloutCost, gpus: int) -> float:
    """A makespan no policy can beat: for every k, the k longest trajectories' decode tokens
    in all over the most tokens per second k sequences can be decoded at (`max_decode_rate`:
    at any moment at most k of them run, and other sequences in a batch only slow it);
    the largest over k. k = all trajectories is the GPUs' aggregate decode rate; prefill
    and tool calls are left out."""
    toks = np.sort(np.array([s.generated_tokens for s in specs], dtype=float))[::-1]
    n = len(toks)
    rate = max_decode_rate(cfg, cost, gpus, n)
    k = np.arange(1, n + 1)
    return float(np.max(np.cumsum(toks) / rate[k]))


def context_counts(specs: tuple[TrajectorySpec, ...], max_context: int) -> np.ndarray:
    """n[c] for c = 0..max_context: the decoded tokens whose context (the tokens before
    them: prompt, earlier turns, this turn's input and its tokens so far) is c."""
    diff = np.zeros(max_context + 2)
    for s in specs:
        ctx = 0
        for turn in s.turns:
            ctx += turn.input_tokens
            diff[ctx] += 1
            diff[ctx + turn.action_tokens] -= 1
            ctx += turn.action_tokens
    return np.cumsum(diff)[: max_context + 1]


def work_bound(cfg: RolloutWorkload, specs: tuple[TrajectorySpec, ...], cost: RolloutCost, gpus: int) -> float:
    """A makespan no policy can beat: the GPU-seconds the step's work needs at least,
    over the GPUs. A decode iteration on a worker of degree d costs d x its time >= (dense
    weights + the KV its batch reads) / (HBM x eff(d)) + d x (launches + a one-token
    all-reduce) GPU-seconds: a fixed part F(d) plus each token's context KV read once. A
    worker's iterations number at least its tokens / `max_batch` and at least the sum of
    its tokens' KV over its capacity (a batch's KV is resident), hence at least any mix
    lam x the first + (1 - lam) x the second; with that mix the cost splits per token, so
    a token with context KV k costs at least min over usable d of k / (HBM eff(d)) + F(d)
    x (lam / max_batch + (1 - lam) k / capacity(d)), whatever degree it ran on. The bound
    is the largest over lam in {0, 0.1, ..., 1} of the tokens' sum, plus every input token
    prefilled once (its FLOPs at the matmul rate and the smallest degree's efficiency).
    Tool calls, queueing and idle GPUs are left out."""
    degrees = usable_degrees(cfg, cost)
    n_c = context_counts(specs, cfg.max_context)
    kv_c = np.arange(len(n_c)) * cost.kv_bytes_per_token + cost.state_bytes_per_seq
    best_decode = 0.0
    for lam in np.linspace(0.0, 1.0, 11):
        per_token = np.full(len(n_c), np.inf)
        for d in degrees:
            fixed = cost.dense_weight_bytes / (cost.hbm_bytes_per_s * cost.efficiency(d)) + d * (
                cost.launch_overhead() + cost.allreduce(d, 1))
            here = kv_c / (cost.hbm_bytes_per_s * cost.efficiency(d)) + fixed * (
                lam / cfg.max_batch + (1.0 - lam) * kv_c / cost.kv_capacity(d))
            per_token = np.minimum(per_token, here)
        best_decode = max(best_decode, float(n_c @ per_token))
    prefill_flops = 0.0
    for s in specs:
        ctx = 0
        for turn in s.turns:
            n = turn.input_tokens
            prefill_flops += 2.0 * cost.active_params * n + (n * ctx + n * (n + 1) / 2) * cost.mla_prefill_flops_per_pair
            ctx += n + turn.action_tokens
    prefill = prefill_flops / cost.matmul_flops_per_s / cost.efficiency(min(degrees))
    return (best_decode + prefill) / gpus


def makespan_bounds(cfg: RolloutWorkload, specs: tuple[TrajectorySpec, ...], cost: RolloutCost,
                    gpus: int) -> dict[str, float]:
    """The three makespans no schedule of `specs` on `gpus` GPUs can beat, by name."""
    return {"critical_path": critical_path_bound(cfg, specs, cost), "tail_set": tail_bound(cfg, specs, cost, gpus),
            "work": work_bound(cfg, specs, cost, gpus)}


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
                                      r.initial_degrees, r.merges))
        runs += mine
        base = [r for r in mine if r.step_centric]
        best = max(base, key=lambda r: r.throughput_tokens_per_s) if base else None
        b = makespan_bounds(c, specs, cost, gpus)
        crit, tail, work = b["critical_path"], b["tail_set"], b["work"]
        bound = max(b.values())
        speed = {}
        for r in mine:
            if best and (not r.step_centric or r.baseline_mp == cfg.baseline_mp):
                speed[r.policy] = r.throughput_tokens_per_s / best.throughput_tokens_per_s
        summaries.append(SeedSummary(seed, f"{best.policy}@MP{best.baseline_mp}" if best else "-",
                                     best.throughput_tokens_per_s if best else 0.0,
                                     best.makespan_s if best else 0.0, bound, speed, crit, tail, work))
    return runs, summaries



def known_lengths_schedule(cfg: RolloutWorkload, specs: tuple[TrajectorySpec, ...], cost: RolloutCost, gpus: int,
                           tail_workers: tuple[int, ...] = (1, 2, 3), tail_sizes: tuple[int, ...] = (8, 32, 96),
                           progress: Any = None) -> tuple[Any, dict[str, Any]]:
    """The fastest of a family of schedules that know every trajectory's true length (an
    ORACLE reference, not a policy): `m` workers of the highest usable degree hold the K
    longest trajectories (K = `m` x a size in `tail_sizes`; longest processing time first
    by decode tokens), the other GPUs form workers of one degree that hold the rest
    (likewise), every worker admits the longest remaining first; also one degree
    everywhere with longest-processing-time homes. Each candidate is simulated (same
    engine, same prices); returns (the fastest result, its description)."""
    from harts.sim.rollout.layout import pool_candidates, pool_homes

    toks = np.array([s.generated_tokens for s in specs], dtype=float)
    degrees = usable_degrees(cfg, cost)
    pol = get_policy("oracle-pools")
    cands = []
    for layout, k in pool_candidates(degrees, gpus, len(specs), tail_workers, tail_sizes):
        top = max(layout)
        m = layout.count(top) if k else 0
        rest = [d for d in layout if d != top] if k else layout
        desc = f"{m}xMP{top} + {len(rest)}xMP{rest[0]}" if k else f"{len(layout)}xMP{layout[0]}"
        cands.append((layout, pool_homes(toks, layout, k), {"layout": desc, "tail": k}))
    best, info = None, {}
    for layout, homes, desc in cands:
        if progress:
            progress(f"known-lengths {desc}")
        r = simulate_rollout(cfg, pol, gpus, specs=specs, cost=cost, plan=(layout, homes))
        if best is None or r.makespan_s < best.makespan_s:
            best, info = r, desc
    return best, info
