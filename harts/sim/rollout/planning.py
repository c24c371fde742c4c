"""Heddle's planners: the remaining-length predictor, the drain-time estimate of a
worker, presorted dynamic-programming placement and the simulated-annealing layout of
model-parallel degrees.

Worker estimate (`worker_estimate`): a trajectory with L decode tokens left and `tool`
seconds of tool calls decodes a fraction L t(1) / (L t(1) + tool) of its life, so about B
= the sum of those fractions share an iteration; the worker finishes after max(L_1 t(B) +
tool_1, sum L t(B) / B), t(b) the decode iteration at batch b.

Placement: trajectories sorted by predicted length (longest first) are cut into
contiguous runs, one per worker, workers ordered fastest (highest degree) first; the
dynamic programme picks the cuts minimising the largest drain estimate (cut positions
on at most 512 quantiles of the order, cost grids from prefix sums: O(workers x 512^2)
whatever the number of trajectories).
"""

from __future__ import annotations

import math

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.cost import RolloutCost
from harts.sim.rollout.types import TrajectorySpec


def prior_action_mean(cfg: RolloutWorkload) -> float:
    return cfg.action_median * math.exp((cfg.action_sigma ** 2 + cfg.action_traj_sigma ** 2
                                         + cfg.action_group_sigma ** 2) / 2)


def prior_tool_mean(cfg: RolloutWorkload) -> float:
    return cfg.tool_latency_median_s * math.exp(cfg.tool_latency_sigma ** 2 / 2)


def predict_remaining(spec: TrajectorySpec, turns_done: int, generated: int, action_prior: float,
                      budget_tokens: float = math.inf, max_turns: float = math.inf, elapsed: int = 0,
                      prior_weight: float = 0.0) -> tuple[float, float]:
    """(predicted remaining decode tokens, predicted remaining turns) of an unfinished
    trajectory after `turns_done` whole turns that generated `generated` tokens, with
    `elapsed` tokens of the running turn decoded so far (it counts among the remaining
    turns): the run-length hint, never below a quarter of the turns done (a trajectory
    that outlived its hint is expected to go on) nor below one, times a per-turn length:
    the mean action length seen so far (`action_prior`, the prior mean or the prompt
    group's observed mean, before the first turn; with `prior_weight` w > 0 the own mean
    is shrunk towards it as if w more turns of that length had been seen). A running turn
    that has outlived that length is expected to run as long again (long-tailed lengths:
    the longer a turn has run, the longer it is expected to go on), and the later turns at
    least as long as it. At most `budget_tokens` (what the context cap leaves: no
    trajectory decodes past it, so a prediction beyond it is known wrong) and at most
    `max_turns` - `turns_done` turns (the tool-call budget). It never reads the true turn
    or token counts."""
    turns = max(min(max(spec.hint_turns - turns_done, 0.25 * turns_done), max_turns - turns_done), 1.0)
    if prior_weight > 0:
        per_turn = (generated + prior_weight * action_prior) / (turns_done + prior_weight)
    else:
        per_turn = generated / turns_done if turns_done else action_prior
    if elapsed > 0:
        x = max(per_turn - elapsed, float(elapsed)) + (turns - 1.0) * max(per_turn, float(elapsed))
    else:
        x = turns * per_turn
    return max(min(x, budget_tokens), 1.0), turns


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


def aggregate_estimate(sum_x: float, sum_a: float, top_x: float, top_tool: float, table: np.ndarray) -> float:
    """`worker_estimate` from its sufficient statistics: the sum of remaining tokens, the
    sum of decode fractions a, and the longest trajectory's tokens and tool seconds (what
    the simulator keeps per worker so that migration and stealing decisions cost O(1))."""
    if top_x <= 0 and sum_x <= 0:
        return 0.0
    B = max(sum_a, 1.0)
    i = min(int(B), len(table) - 2)
    tB = table[i] + (min(B, len(table) - 1) - i) * (table[i + 1] - table[i])
    return max(top_x * tB + top_tool, sum_x * tB / B)


def decode_fraction(x: float, tool: float, table: np.ndarray) -> float:
    """a = L t(1) / (L t(1) + tool): the share of its life a trajectory spends decoding."""
    busy = x * (table[1] if len(table) > 1 else 0.0)
    return busy / (busy + tool) if busy + tool > 0 else 0.0


def _grid(x: np.ndarray, tl: np.ndarray, pos: np.ndarray, table: np.ndarray) -> np.ndarray:
    """C[p, q] = the estimate of the items pos[p]..pos[q]-1 of the longest-first order
    (p < q), 0 on the diagonal (an empty worker), inf below it; from prefix sums, so a
    grid of P cut positions costs O(P^2) whatever the number of items."""
    t1 = table[1] if len(table) > 1 else 0.0
    busy = x * t1
    a = np.where(busy + tl > 0, busy / np.maximum(busy + tl, 1e-12), 0.0)
    cx = np.concatenate(([0.0], np.cumsum(x)))
    ca = np.concatenate(([0.0], np.cumsum(a)))
    P = len(pos)
    start = np.minimum(pos, len(x) - 1)
    sx = cx[pos][None, :] - cx[pos][:, None]
    B = np.maximum(ca[pos][None, :] - ca[pos][:, None], 1.0)
    tB = _t_at(table, B)
    tail = x[start][:, None] * tB + tl[start][:, None]
    C = np.maximum(tail, sx * tB / B)
    iu = np.triu_indices(P, 1)
    out = np.full((P, P), np.inf)
    out[iu] = C[iu]
    np.fill_diagonal(out, 0.0)
    return out


def dp_place(lengths: np.ndarray, tools: np.ndarray, degrees: list[int], tables: dict[int, np.ndarray],
             max_cuts: int = 512, cache: dict | None = None) -> tuple[list[int], float]:
    """Assign trajectories (indices into `lengths`) to workers (indices into `degrees`):
    presorted dynamic programming over contiguous runs of the longest-first order, workers
    fastest first, minimising the largest `worker_estimate` (ties within 0.1% broken by the
    smallest sum of squared estimates, so workers other than the bottleneck are balanced
    too).
    Runs start at one of at most `max_cuts` + 1 positions of the order (every position
    when n <= max_cuts: then the split is exact; beyond, cuts fall on quantiles).
    `cache` (a dict the caller keeps across calls on the same lengths, e.g. while
    annealing a layout) holds the per-degree cost grids. Returns (worker of each
    trajectory, estimated makespan). Workers may stay empty."""
    n, W = len(lengths), len(degrees)
    order = np.argsort(-lengths, kind="stable")
    x, tl = lengths[order], tools[order]
    pos = np.unique(np.round(np.linspace(0, n, min(n, max_cuts) + 1)).astype(np.int64))
    wo = sorted(range(W), key=lambda w: (-degrees[w], w))
    cache = {} if cache is None else cache
    grids = {}
    for d in {degrees[w] for w in wo}:
        if d not in cache:
            cache[d] = _grid(x, tl, pos, tables[d])
        grids[d] = cache[d]
    P = len(pos)
    INF = float("inf")
    # f[i]: the smallest largest estimate of the workers so far covering items before pos[i];
    # g[i]: the sum of their squared estimates among choices within 0.1% of f (the largest
    # alone leaves every worker but the bottleneck free to be overloaded up to it, and a
    # plain sum favours packing, since big batches are cheaper per token)
    f = np.full(P, INF)
    g = np.full(P, INF)
    f[0] = g[0] = 0.0
    args = []
    for j in range(W):
        C = grids[degrees[wo[j]]]  # C[k, i]: this worker takes pos[k]..pos[i]-1
        cand = np.maximum(f[:, None], C)  # [k, i]
        best = cand.min(axis=0)
        total = np.where(cand <= best[None, :] * (1 + 1e-3), g[:, None] + C * C, INF)
        k = np.argmin(total, axis=0)
        cols = np.arange(P)
        f, g = cand[k, cols], total[k, cols]
        args.append(k)
    assign = np.zeros(n, dtype=np.int64)
    i = P - 1
    for j in range(W - 1, -1, -1):
        k = int(args[j][i])
        assign[order[pos[k]:pos[i]]] = wo[j]
        i = k
    return [int(a) for a in assign], float(f[P - 1])


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
