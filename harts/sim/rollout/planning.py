"""Heddle's planners: the remaining-length predictor, the drain-time estimate of a
worker, presorted dynamic-programming placement and the simulated-annealing layout of
model-parallel degrees.

Worker estimate (`worker_estimate`): a trajectory with L decode tokens left and `tool`
seconds of tool calls decodes a fraction L t(1) / (L t(1) + tool) of its life, so about B
= the sum of those fractions share an iteration; the worker finishes after max(L_1 t(B) +
tool_1, sum L t(B) / B), t(b) the decode iteration at batch b.

Placement: trajectories sorted by predicted length (longest first) are cut into
contiguous runs, one per worker, workers ordered fastest (highest degree) first; the
dynamic programme picks the cuts minimising the largest drain estimate (O(workers x n^2),
vectorised).
"""

from __future__ import annotations

import math

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.cost import RolloutCost
from harts.sim.rollout.types import TrajectorySpec


def prior_action_mean(cfg: RolloutWorkload) -> float:
    return cfg.action_median * math.exp((cfg.action_sigma ** 2 + cfg.action_traj_sigma ** 2) / 2)


def prior_tool_mean(cfg: RolloutWorkload) -> float:
    return cfg.tool_latency_median_s * math.exp(cfg.tool_latency_sigma ** 2 / 2)


def predict_remaining(spec: TrajectorySpec, turns_done: int, generated: int, action_prior: float) -> tuple[float, float]:
    """(predicted remaining decode tokens, predicted remaining turns) of an unfinished
    trajectory after `turns_done` whole turns that generated `generated` tokens: the
    run-length hint, never below a quarter of the turns done (a trajectory that outlived
    its hint is expected to go on) nor below one, times the mean action length seen so far
    (the prior mean before the first turn). It never reads the true turn or token counts."""
    turns = max(spec.hint_turns - turns_done, 0.25 * turns_done, 1.0)
    per_turn = generated / turns_done if turns_done else action_prior
    return turns * per_turn, turns


def iteration_table(cost: RolloutCost, degree: int, n: int, max_batch: int, mean_context: float) -> np.ndarray:
    """t(m) for m = 0..n (t(0) = 0): a decode iteration at batch m; beyond what runs at
    once, B = min(batch limit, KV capacity / KV of a mean-context sequence), the worker
    needs m / B iterations of batch B per token of each."""
    fit = int(cost.kv_capacity(degree) // max(cost.kv_bytes(int(mean_context)), 1.0))
    max_batch = max(1, min(max_batch, fit))
    t = np.zeros(n + 1)
    for m in range(1, n + 1):
        b = min(m, max_batch)
        t[m] = cost.decode_step(b, b * mean_context, degree) * (m / b)
    return t


def _t_at(table: np.ndarray, batch: np.ndarray | float) -> np.ndarray:
    """t(batch) for fractional batches >= 1 (linear between the table's points)."""
    b = np.maximum(np.asarray(batch, dtype=float), 1.0)
    return np.interp(b, np.arange(len(table)), table)


def worker_estimate(lengths_desc: np.ndarray, tools_desc: np.ndarray, table: np.ndarray) -> float:
    """Predicted time for a worker to finish trajectories with these remaining decode
    tokens and tool seconds (sorted by tokens, longest first). Each trajectory decodes a
    fraction a = L t(1) / (L t(1) + tool) of its life, so about B = sum a of them share an
    iteration: the worker needs the longest one's L_1 t(B) + tool_1, and at least the
    whole work sum L t(B) / B."""
    if len(lengths_desc) == 0:
        return 0.0
    c = _cost_row(lengths_desc, tools_desc, table)
    return float(c[-1])


def _cost_row(x: np.ndarray, tl: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Estimates of x[:1], x[:2], ... (x sorted longest first): vectorised `worker_estimate`."""
    t1 = table[1] if len(table) > 1 else 0.0
    busy = x * t1
    a = np.where(busy + tl > 0, busy / np.maximum(busy + tl, 1e-12), 0.0)
    B = np.maximum(np.cumsum(a), 1.0)
    tB = _t_at(table, B)
    work = np.cumsum(x) * tB / B
    tail = x[0] * tB + tl[0]
    return np.maximum(tail, work)


def dp_place(lengths: np.ndarray, tools: np.ndarray, degrees: list[int], tables: dict[int, np.ndarray]) -> tuple[list[int], float]:
    """Assign trajectories (indices into `lengths`) to workers (indices into `degrees`):
    presorted dynamic programming over contiguous runs of the longest-first order, workers
    fastest first, minimising the largest `worker_estimate`. Returns (worker of each
    trajectory, estimated makespan). Workers may stay empty."""
    n, W = len(lengths), len(degrees)
    order = np.argsort(-lengths, kind="stable")
    x, tl = lengths[order], tools[order]
    wo = sorted(range(W), key=lambda w: (-degrees[w], w))
    INF = float("inf")
    costs = {}
    for d in {degrees[w] for w in wo}:
        c = np.full((n, n), INF)
        for k in range(n):
            c[k, k:] = _cost_row(x[k:], tl[k:], tables[d])
        costs[d] = c
    # f[j, i]: the smallest largest estimate of the first j workers covering items 0..i-1;
    # g[j, i]: the sum of their estimates, minimised among the choices within 0.1% of f
    # (the largest alone leaves every worker but the bottleneck unbalanced)
    f = np.full((W + 1, n + 1), INF)
    g = np.full((W + 1, n + 1), INF)
    f[0, 0] = g[0, 0] = 0.0
    arg = np.zeros((W + 1, n + 1), dtype=np.int64)
    for j in range(1, W + 1):
        c = costs[degrees[wo[j - 1]]]
        f[j, 0] = g[j, 0] = 0.0
        for i in range(1, n + 1):
            # the j-th worker takes items k..i-1 (k = i: none)
            seg = np.append(c[:i, i - 1], 0.0)
            cand = np.maximum(f[j - 1, : i + 1], seg)
            best = cand.min()
            total = np.where(cand <= best * (1 + 1e-3), g[j - 1, : i + 1] + seg, INF)
            k = int(np.argmin(total))
            f[j, i] = cand[k]
            g[j, i] = total[k]
            arg[j, i] = k
    assign = np.zeros(n, dtype=np.int64)
    i = n
    for j in range(W, 0, -1):
        k = int(arg[j, i])
        assign[order[k:i]] = wo[j - 1]
        i = k
    return [int(a) for a in assign], float(f[W, n])


def greedy_place(n: int, degrees: list[int]) -> list[int]:
    """Least-loaded by count (relative to degree), in trajectory order: no prediction."""
    load = [0] * len(degrees)
    out = []
    for _ in range(n):
        w = min(range(len(degrees)), key=lambda w: (load[w] / degrees[w], w))
        load[w] += 1
        out.append(w)
    return out


def estimate_makespan(assign: list[int], lengths: np.ndarray, tools: np.ndarray, degrees: list[int],
                      tables: dict[int, np.ndarray]) -> float:
    worst = 0.0
    assign_a = np.asarray(assign)
    for w, d in enumerate(degrees):
        idx = np.flatnonzero(assign_a == w)
        if len(idx) == 0:
            continue
        o = idx[np.argsort(-lengths[idx], kind="stable")]
        worst = max(worst, worker_estimate(lengths[o], tools[o], tables[d]))
    return worst


def anneal_layout(gpus: int, start: list[int], allowed: list[int], objective, iterations: int,
                  rng: np.random.Generator) -> list[int]:
    """Simulated annealing over multisets of degrees summing to `gpus`: a move splits a
    worker in two of half the degree or merges two of one degree; Metropolis acceptance
    under a geometric temperature schedule. Returns the best layout seen (degrees,
    descending)."""
    allowed_set = set(allowed)
    cur = sorted(start, reverse=True)
    cache: dict[tuple[int, ...], float] = {}

    def score(lay: list[int]) -> float:
        key = tuple(lay)
        if key not in cache:
            cache[key] = objective(lay)
        return cache[key]

    cur_s = score(cur)
    best, best_s = cur, cur_s
    temp = 0.05 * cur_s if cur_s > 0 else 1.0
    cool = (1e-3) ** (1.0 / max(1, iterations))
    for _ in range(iterations):
        cand = list(cur)
        i = int(rng.integers(len(cand)))
        d = cand[i]
        moves = []
        if d // 2 in allowed_set and d > 1:
            moves.append("split")
        if 2 * d in allowed_set and cand.count(d) >= 2:
            moves.append("merge")
        if not moves:
            continue
        if moves[int(rng.integers(len(moves)))] == "split":
            cand[i : i + 1] = [d // 2, d // 2]
        else:
            cand.remove(d)
            cand.remove(d)
            cand.append(2 * d)
        cand.sort(reverse=True)
        s = score(cand)
        if s <= cur_s or rng.random() < math.exp(-(s - cur_s) / max(temp, 1e-12)):
            cur, cur_s = cand, s
            if s < best_s:
                best, best_s = cand, s
        temp *= cool
    assert sum(best) == gpus
    return best
