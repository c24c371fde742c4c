"""Two small packing helpers of the cell solver: a min-token knapsack that picks the subset
of items whose cost is nearest an aim (`subset_near`), and load-evening moves and swaps
between bins (`balance_bins`)."""

from __future__ import annotations

import numpy as np

from harts.plan.planners.l1l2.cell import Item


def balance_bins(bins: list[list[int]], cost: list[float], tokens: list[int], room: int) -> None:
    """Even out bin loads (least sum of squares) by moving or swapping single items
    between two bins while tokens allow; the best improving step each round."""
    load = [sum(cost[i] for i in b) for b in bins]
    tok = [sum(tokens[i] for i in b) for b in bins]
    n = len(bins)
    for _ in range(4 * len(cost)):
        best, best_gain = None, 1e-9
        for h in range(n):
            for j in range(n):
                if j == h or load[h] <= load[j]:
                    continue
                gap = load[h] - load[j]
                for a in bins[h]:
                    for b in [None, *bins[j]]:
                        d = cost[a] - (cost[b] if b is not None else 0.0)
                        if not 0 < d < gap or (len(bins[h]) == 1 and b is None):
                            continue
                        dt = tokens[a] - (tokens[b] if b is not None else 0)
                        if tok[j] + dt > room or tok[h] - dt > room:
                            continue
                        # change of load[h]^2 + load[j]^2 when d moves from h to j
                        gain = 2.0 * d * (gap - d)
                        if gain > best_gain:
                            best, best_gain = (h, j, a, b, d, dt), gain
        if best is None:
            return
        h, j, a, b, d, dt = best
        bins[h].remove(a)
        bins[j].append(a)
        if b is not None:
            bins[j].remove(b)
            bins[h].append(b)
        load[h] -= d
        load[j] += d
        tok[h] -= dt
        tok[j] += dt


def subset_near(items: list[Item], aim: float, unit: float, cover: bool, room: float) -> list[Item]:
    """A non-empty subset of `items` with at most `room` tokens whose cost is closest to
    `aim`: the least cost >= aim when `cover` (if any), else the nearest either side.
    A min-token knapsack over costs rounded to `unit`: dp[s] = the fewest tokens of a
    subset with rounded cost s, one numpy pass per item, kept for backtracking."""
    if not items:
        return []
    w = [max(1, round(it.cost / unit)) for it in items]
    target = max(0, round(aim / unit))
    limit = max(target + max(w) + 1, 1)
    big = np.iinfo(np.int64).max // 4
    dp = np.full(limit + 1, big, dtype=np.int64)
    dp[0] = 0
    hist = [dp]
    for wi, it in zip(w, items, strict=True):
        new = dp.copy()
        if wi <= limit:
            np.minimum(new[wi:], dp[: limit + 1 - wi] + it.tokens, out=new[wi:])
        dp = new
        hist.append(dp)
    ok = dp <= room
    ok[0] = False
    sums = np.flatnonzero(ok)
    if not sums.size:
        return []
    above = sums[sums >= target]
    if cover and above.size:
        best = int(above[0])
    else:
        best = int(sums[np.argmin(np.abs(sums - target))])
    out = []
    s = best
    for i in range(len(items), 0, -1):
        if s and hist[i][s] != hist[i - 1][s]:
            out.append(items[i - 1])
            s -= w[i - 1]
    return out[::-1]
