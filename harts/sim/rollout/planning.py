"""Heddle's planners: the remaining-length predictor, the drain-time estimate of a
worker, presorted dynamic-programming placement and the simulated-annealing layout of
model-parallel degrees.

Worker estimate (`worker_estimate`): a trajectory with L decode tokens left, `tool`
seconds of tool calls and mean context c over the rest of its life decodes a fraction a
= L t1(c) / (L t1(c) + tool) of its life (t1 its per-token time alone), so about B = sum a
of them share an iteration, over about sum a c tokens of KV; the worker finishes after
max(L_1 t + tool_1, sum L t / B), t the per-token time at that batch and context
(`DecodePrice`). The contexts matter where KV reads dominate a decode iteration (dense
attention): long trajectories are also the ones with long contexts, so a worker holding
several of them is slow for each.

Placement: trajectories sorted by predicted length (longest first) are cut into
contiguous runs, one per worker, workers ordered fastest (highest degree) first; the
dynamic programme picks the cuts minimising the largest drain estimate (cut positions
on at most 512 quantiles of the order, cost grids from prefix sums: O(workers x 512^2)
whatever the number of trajectories).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.cost import RolloutCost
from harts.sim.rollout.types import TrajectorySpec


def expected_context(context: float, next_input: float, remaining: float, max_context: int) -> float:
    """The mean context over a trajectory's predicted remaining decode: what it holds now,
    the input it prefills next and half of the `remaining` tokens it is expected to
    decode, at most the context cap."""
    return float(min(context + next_input + remaining / 2.0, max_context))


def prior_action_mean(cfg: RolloutWorkload) -> float:
    return cfg.action_median * math.exp((cfg.action_sigma ** 2 + cfg.action_traj_sigma ** 2
                                         + cfg.action_group_sigma ** 2) / 2)


def prior_tool_mean(cfg: RolloutWorkload) -> float:
    return cfg.tool_latency_median_s * math.exp((cfg.tool_latency_sigma ** 2 + cfg.tool_task_sigma ** 2) / 2)


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


@dataclass(frozen=True)
class DecodePrice:
    """The per-token decode time a planner expects on a worker of `degree` GPUs: `batch`
    sequences (an expected, fractional count) decoding together with `context` tokens of
    KV in all. The batch that runs at once is capped by the batch limit and by the KV
    capacity at that mean context per sequence; beyond it sequences take turns, so each
    waits batch / that many iterations per token. Context matters: with dense attention a
    sequence's tokens cost its whole context's KV reads, so a long trajectory among other
    long ones decodes several times slower than among short ones."""

    cost: RolloutCost
    degree: int
    max_batch: int

    def per_token(self, batch, context):
        B = np.maximum(np.asarray(batch, dtype=float), 1.0)
        C = np.asarray(context, dtype=float)
        per_seq = self.cost.kv_bytes_per_token * C / B + self.cost.state_bytes_per_seq
        fit = np.clip(np.floor(self.cost.kv_capacity(self.degree) / np.maximum(per_seq, 1.0)), 1.0, self.max_batch)
        b = np.minimum(B, fit)
        return self.cost.decode_steps(b, C * b / B, self.degree) * (B / b)


def decode_fraction(x, tool, context, price: DecodePrice):
    """a = L t1 / (L t1 + tool): the share of its life a trajectory with L decode tokens,
    `tool` seconds of tool calls and mean context `context` left spends decoding (t1 its
    per-token time alone on the worker)."""
    busy = np.asarray(x, dtype=float) * price.per_token(1.0, context)
    tl = np.asarray(tool, dtype=float)
    return np.where(busy + tl > 0, busy / np.maximum(busy + tl, 1e-300), 0.0)


def _estimate(sum_x, sum_a, sum_ac, top_x, top_tool, top_c, price: DecodePrice):
    """max(L_1 t + tool_1, sum L t / B) with B = max(sum a, 1) sequences decoding together
    over sum a c context tokens (at least the longest one's own), t their per-token time."""
    B = np.maximum(sum_a, 1.0)
    t = price.per_token(B, np.maximum(sum_ac, top_c))
    return np.maximum(top_x * t + top_tool, sum_x * t / B)


def worker_estimate(lengths_desc: np.ndarray, tools_desc: np.ndarray, contexts_desc: np.ndarray,
                    price: DecodePrice) -> float:
    """Predicted time for a worker to finish trajectories with these remaining decode
    tokens, tool seconds and mean contexts (sorted by tokens, longest first). Each
    trajectory decodes a fraction a of its life (`decode_fraction`), so about B = sum a of
    them share an iteration, over about sum a c context tokens: the worker needs the
    longest one's L_1 t + tool_1, and at least the whole work sum L t / B, t the per-token
    time at that batch and context."""
    if len(lengths_desc) == 0:
        return 0.0
    return float(_cost_row(lengths_desc, tools_desc, contexts_desc, price)[-1])


def _cost_row(x: np.ndarray, tl: np.ndarray, c: np.ndarray, price: DecodePrice) -> np.ndarray:
    """Estimates of x[:1], x[:2], ... (x sorted longest first): vectorised `worker_estimate`."""
    a = decode_fraction(x, tl, c, price)
    return _estimate(np.cumsum(x), np.cumsum(a), np.cumsum(a * c), x[0], tl[0], c[0], price)


def aggregate_estimate(sum_x: float, sum_a: float, sum_ac: float, top: tuple[float, float, float],
                       price: DecodePrice) -> float:
    """`worker_estimate` from its sufficient statistics: the sums of remaining tokens, of
    decode fractions a and of a x context, and the longest trajectory's (tokens, tool
    seconds, context) (what the simulator keeps per worker so that migration and stealing
    decisions cost O(1))."""
    if top[0] <= 0 and sum_x <= 0:
        return 0.0
    return float(_estimate(sum_x, sum_a, sum_ac, top[0], top[1], top[2], price))


def _grid(x: np.ndarray, tl: np.ndarray, c: np.ndarray, pos: np.ndarray, price: DecodePrice) -> np.ndarray:
    """C[p, q] = the estimate of the items pos[p]..pos[q]-1 of the longest-first order
    (p < q), 0 on the diagonal (an empty worker), inf below it; from prefix sums, so a
    grid of P cut positions costs O(P^2) whatever the number of items."""
    a = decode_fraction(x, tl, c, price)
    cx, ca, cac = (np.concatenate(([0.0], np.cumsum(v))) for v in (x, a, a * c))
    P = len(pos)
    start = np.minimum(pos, len(x) - 1)
    span = [v[pos][None, :] - v[pos][:, None] for v in (cx, ca, cac)]
    C = _estimate(*span, x[start][:, None], tl[start][:, None], c[start][:, None], price)
    iu = np.triu_indices(P, 1)
    out = np.full((P, P), np.inf)
    out[iu] = C[iu]
    np.fill_diagonal(out, 0.0)
    return out


def dp_place(lengths: np.ndarray, tools: np.ndarray, contexts: np.ndarray, degrees: list[int],
             prices: dict[int, DecodePrice], max_cuts: int = 512, cache: dict | None = None) -> tuple[list[int], float]:
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
    x, tl, c = lengths[order], tools[order], contexts[order]
    pos = np.unique(np.round(np.linspace(0, n, min(n, max_cuts) + 1)).astype(np.int64))
    wo = sorted(range(W), key=lambda w: (-degrees[w], w))
    cache = {} if cache is None else cache
    grids = {}
    for d in {degrees[w] for w in wo}:
        if d not in cache:
            cache[d] = _grid(x, tl, c, pos, prices[d])
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


def estimate_makespan(assign: list[int], lengths: np.ndarray, tools: np.ndarray, contexts: np.ndarray,
                      degrees: list[int], prices: dict[int, DecodePrice]) -> float:
    worst = 0.0
    assign_a = np.asarray(assign)
    for w, d in enumerate(degrees):
        idx = np.flatnonzero(assign_a == w)
        if len(idx) == 0:
            continue
        o = idx[np.argsort(-lengths[idx], kind="stable")]
        worst = max(worst, worker_estimate(lengths[o], tools[o], contexts[o], prices[d]))
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
