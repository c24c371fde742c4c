"""Time the KDA call planner on random forests of 10^3 .. 10^6 nodes.

    python benchmarks/bench_kda_planner.py [--sizes 1000 10000 100000 1000000] [--repeats 3]

Two shapes: "bushy" (0-3 children per node, shallow) and "caterpillar" (every spine node
has a side leaf, depth ~ N/2), so the figures show the cost is linear in N whatever the
depth. Segment lengths are uniform in [1, 3B]. The time covers plan_kda_calls end to end
(input checks, DP, sequence assignment, arrays); generating the forest is not timed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from harts.plan.kda_calls import plan_kda_calls


def random_forest(
    rng: np.random.Generator, num_nodes: int, shape: str, chunk_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if shape == "bushy":
        fanouts = rng.choice([0, 0, 1, 2, 2, 3], size=num_nodes).tolist()
        parents: list[int] = []
        slots: list[int] = []
        for fanout in fanouts:
            p = slots.pop() if slots else -1
            v = len(parents)
            parents.append(p)
            if fanout <= num_nodes - len(parents) - len(slots):
                slots.extend([v] * fanout)
        parent = np.asarray(parents, dtype=np.int64)
    elif shape == "caterpillar":
        # Preorder: spine 0, leaf 1 (child of 0), spine 2 (child of 0), leaf 3 (child of 2)...
        v = np.arange(num_nodes)
        parent = np.where(v % 2 == 1, v - 1, v - 2)
        parent[0] = -1
    else:
        raise ValueError(f"unknown shape {shape!r}")
    lengths = rng.integers(1, 3 * chunk_size + 1, size=num_nodes)
    end = lengths.copy()
    par = parent.tolist()
    end_l = end.tolist()
    for i in range(num_nodes):
        if par[i] >= 0:
            end_l[i] += end_l[par[i]]
    end = np.asarray(end_l, dtype=np.int64)
    start = end - lengths
    return parent, start, end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--shapes", nargs="+", default=["bushy", "caterpillar"])
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="report the fastest of this many runs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    print(
        f"{'shape':<12} {'nodes':>9} {'seconds':>9} {'ns/node':>8} {'rounds':>6} "
        f"{'sequences':>9} {'replay':>10}"
    )
    for shape in args.shapes:
        for n in args.sizes:
            rng = np.random.default_rng(args.seed)
            parent, start, end = random_forest(rng, n, shape, args.chunk_size)
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan = plan_kda_calls(parent, start, end, args.chunk_size)
                best = min(best, time.perf_counter() - t0)
            print(
                f"{shape:<12} {n:>9} {best:>9.4f} {best / n * 1e9:>8.0f} {plan.num_rounds:>6} "
                f"{plan.num_sequences:>9} {plan.replay_tokens:>10}"
            )


if __name__ == "__main__":
    main()
