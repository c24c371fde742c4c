"""Tree-build throughput: expanded tokens per second of `build_forest` on one core.

    python benchmarks/bench_tree_build.py [--tokens 20000000] [--json]

Workloads are SWE-shaped (both sampling schemes) at reduced group counts so the
materialised trajectories fit in memory; timing covers build_forest plus the lazily
derived compact layout (rows, ends, parents, occurrences) and the expanded->compact map.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from harts.tree import build_forest  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402


def run(name: str, target_tokens: int, repeats: int) -> dict:
    # grow the number of groups until the expanded size reaches the target
    groups = 1
    while True:
        wl = generate(preset(name, num_groups=groups, seed=7))
        if wl.expanded_tokens >= target_tokens or groups >= 4096:
            break
        groups = max(groups + 1, int(groups * target_tokens / max(1, wl.expanded_tokens)))
    trajs = wl.trajectories(max_expanded_tokens=10 * target_tokens)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        forest = build_forest(trajs)
        _ = forest.row_end, forest.row_parent, forest.row_occurrence, forest.traj_rows
        best = min(best, time.perf_counter() - t0)
    return {
        "workload": name,
        "groups": groups,
        "trajectories": len(trajs),
        "expanded_tokens": forest.expanded_tokens,
        "compact_tokens": forest.compact_tokens,
        "seconds": best,
        "expanded_tokens_per_second": forest.expanded_tokens / best,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run(n, args.tokens, args.repeats) for n in ("swe-treestep-1", "swe-stepwise-1")]
    if args.json:
        from harts.bench.provenance import provenance  # git revision, command, packages, device
        print(json.dumps({"provenance": provenance(), "rows": rows}, indent=2))
        return
    print(f"{'workload':16} {'trajs':>6} {'expanded':>12} {'compact':>10} {'seconds':>8} {'Mtok/s':>8}")
    for r in rows:
        print(f"{r['workload']:16} {r['trajectories']:6d} {r['expanded_tokens']:12,d} "
              f"{r['compact_tokens']:10,d} {r['seconds']:8.3f} {r['expanded_tokens_per_second'] / 1e6:8.1f}")


if __name__ == "__main__":
    main()
