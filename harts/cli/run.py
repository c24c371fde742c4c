"""`harts run`: the main job on embedded defaults, end to end.

Generates a SWE-shaped workload, builds its rollout trees and reports the statistics;
each later stage (plan, simulate, execute, verify) joins this same command as it lands.
"""

from __future__ import annotations

import argparse
import time

from harts.cli.common import format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="the main job on embedded defaults (workload -> trees -> ...)")
    p.add_argument("--workload", default="tiny-treestep", help="workload preset (default: tiny-treestep)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from harts.cli.tree import workload_config
    from harts.tree import build_forest
    from harts.tree.workload import generate

    summary: dict = {"workload": args.workload, "seed": args.seed}
    t0 = time.perf_counter()
    wl = generate(workload_config(args.workload, args.seed, []))
    trajs = wl.trajectories()
    forest = build_forest(trajs)
    summary["tree"] = forest.stats()
    summary["tree"]["build_seconds"] = time.perf_counter() - t0
    if args.json:
        print_json(summary)
        return 0
    print(f"== workload {args.workload} (seed {args.seed}): {len(trajs)} trajectories ==")
    print(format_table(["statistic", "value"], [(k.replace("_", " "), v) for k, v in summary["tree"].items()]))
    return 0
