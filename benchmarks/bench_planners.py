"""Step planners on a paper-sized step: compression, slot balance, slots, planning time.

    python benchmarks/bench_planners.py [--workload swe-treestep-64] [--dp 8] [--rollouts-per-group N]
        [--max-context N --microbatch-tokens N]
        [--dps 2,4,8] [--repeats 3] [--producer-retention R] [--json]

Table 4 of the paper (one step, DP 8): every planner's compression, per-slot balance and
planning seconds. Table 5 (DP 2/4/8): balance P5 and slot counts of l1l2 next to
ortools-ffd. Then the planner targets, each marked met or MISSED with the numbers.
Planning time is the best of --repeats runs (ortools-ffd: one run; its CP-SAT limit
dominates). Plans are validated (outside the timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from harts.config.plan import (
    DEFAULT_PRODUCER_RETENTION,  # noqa: E402
    PlanConfig,  # noqa: E402
)
from harts.plan.metrics import compute_metrics  # noqa: E402
from harts.plan.planners import known_planners, make_plan  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402


def measure(forest, name: str, config: PlanConfig, repeats: int) -> dict:
    best = None
    for _ in range(1 if name == "ortools-ffd" else repeats):
        plan = make_plan(forest, name, config)
        if best is None or plan.plan_seconds < best.plan_seconds:
            best = plan
    m = compute_metrics(best, forest).to_dict()
    m["info"] = best.info
    return m


def md_table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="swe-treestep-64")
    ap.add_argument("--rollouts-per-group", type=int, default=None,
                    help="override the preset's group size (sensitivity to tree size)")
    ap.add_argument("--max-context", type=int, default=None,
                    help="override the preset's context cap (rollouts stop adding turns there)")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--dps", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--microbatch-tokens", type=int, default=None,
                    help="microbatch token budget (default: the preset's own)")
    ap.add_argument("--producer-retention", type=float, default=DEFAULT_PRODUCER_RETENTION)
    ap.add_argument("--time-limit", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    over = {} if args.rollouts_per_group is None else {"rollouts_per_group": args.rollouts_per_group}
    if args.max_context is not None:
        over["max_context"] = args.max_context
    cfg = preset(args.workload, **over)
    forest = generate(cfg).forest()
    if args.microbatch_tokens is None:
        args.microbatch_tokens = cfg.microbatch_tokens
    build = time.perf_counter() - t0

    def config(dp: int) -> PlanConfig:
        return PlanConfig(dp=dp, microbatch_tokens=args.microbatch_tokens,
                          producer_retention=args.producer_retention, time_limit=args.time_limit)

    main_rows = {n: measure(forest, n, config(args.dp), args.repeats) for n in known_planners()}
    dps = [int(x) for x in args.dps.split(",")]
    dp_rows = {
        dp: {n: measure(forest, n, config(dp), args.repeats) for n in ("ortools-ffd", "l1l2")}
        for dp in dps
    }

    l1l2, ort, l1 = main_rows["l1l2"], main_rows["ortools-ffd"], main_rows["l1"]
    targets = [
        ("l1l2 compression >= 1.36x ortools-ffd's",
         l1l2["compression"] / ort["compression"] >= 1.36,
         f"{l1l2['compression']:.3f} / {ort['compression']:.3f} = "
         f"{l1l2['compression'] / ort['compression']:.3f}x"),
        ("l1l2 slot balance >= 97.5%", l1l2["slot_balance"] >= 0.975,
         f"{100 * l1l2['slot_balance']:.2f}%"),
        ("l1l2 planning <= 0.5 s", l1l2["plan_seconds"] <= 0.5, f"{l1l2['plan_seconds']:.3f} s"),
        ("l1 >= 3x faster than ortools-ffd", ort["plan_seconds"] >= 3 * l1["plan_seconds"],
         f"{ort['plan_seconds']:.3f} s / {l1['plan_seconds']:.4f} s = "
         f"{ort['plan_seconds'] / l1['plan_seconds']:.0f}x"),
    ]
    for dp in dps:
        a, b = dp_rows[dp]["l1l2"], dp_rows[dp]["ortools-ffd"]
        targets.append((f"DP{dp}: l1l2 balance P5 >= 93%, slots <= ortools-ffd's",
                        a["balance_p5"] >= 0.93 and a["slots"] <= b["slots"],
                        f"P5 {100 * a['balance_p5']:.2f}% (ortools {100 * b['balance_p5']:.2f}%), "
                        f"slots {a['slots']} vs {b['slots']}"))

    if args.json:
        from harts.bench.provenance import provenance  # git revision, command, packages, device
        json.dump({"provenance": provenance(), "workload": args.workload, "dp": args.dp, "planners": main_rows,
                   "dp_sweep": {str(k): v for k, v in dp_rows.items()},
                   "targets": [{"target": t, "met": bool(ok), "measured": m} for t, ok, m in targets]},
                  sys.stdout, indent=2, default=str)
        print()
        return 0
    stats = forest.stats()
    print(f"workload {args.workload}: {stats['trajectories']} trajectories, "
          f"{stats['expanded_tokens']:,} expanded / {stats['compact_tokens']:,} compact tokens "
          f"(forest compression {stats['compression']:.3f}x), built in {build:.2f} s; "
          f"budget {args.microbatch_tokens} tokens, producer retention {args.producer_retention}, "
          f"ortools time limit {args.time_limit}")
    print()
    print(f"Table 4 analogue (DP {args.dp})")
    print(md_table(
        ["planner", "compression", "slot balance", "balance P5", "step balance", "slots",
         "microbatches", "plan seconds"],
        [[n, f"{r['compression']:.3f}x", f"{100 * r['slot_balance']:.2f}%",
          f"{100 * r['balance_p5']:.2f}%", f"{100 * r['step_balance']:.2f}%", r["slots"],
          r["microbatches"], f"{r['plan_seconds']:.4f}"] for n, r in main_rows.items()],
    ))
    print()
    print("Table 5 analogue (l1l2 / ortools-ffd)")
    print(md_table(
        ["DP", "slots", "balance P5", "slot balance", "step balance", "compression"],
        [[dp, f"{r['l1l2']['slots']} / {r['ortools-ffd']['slots']}",
          f"{100 * r['l1l2']['balance_p5']:.2f}% / {100 * r['ortools-ffd']['balance_p5']:.2f}%",
          f"{100 * r['l1l2']['slot_balance']:.2f}% / {100 * r['ortools-ffd']['slot_balance']:.2f}%",
          f"{100 * r['l1l2']['step_balance']:.2f}% / {100 * r['ortools-ffd']['step_balance']:.2f}%",
          f"{r['l1l2']['compression']:.3f}x / {r['ortools-ffd']['compression']:.3f}x"]
         for dp, r in dp_rows.items()],
    ))
    print()
    print("Targets")
    for t, ok, m in targets:
        print(f"- {'met' if ok else 'MISSED'}: {t}: {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
