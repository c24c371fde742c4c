"""Do l1l2's windows pay? The simulator's verdict over the shape families (no GPU).

    python benchmarks/bench_window_choice.py [--hardware h100] [--model tiny-h200]
        [--families grpo,bushy,...] [--seeds 3,4,5] [--budgets 8192,16384,32768] [--json OUT.json]

For every `harts.tree.shapes` instance (family/seed@budget) four plans at the budget:
`l1l2` as the library plans it (rows alone), `l1l2` with the microbatch floors of
`harts.sim.executor.window_floors` for the model and hardware at that budget (windows only
where they pay), `l1` (no windows: shared rows recomputed) and `expanded-ffd`; and the
unsplit tree. Each is priced by the simulator's executor model (`--hardware`'s profile,
one GPU). Reported: each plan's simulated step seconds, the best of the split plans, and
the mean and worst ratio of each l1l2 variant to that best ("regret"). The executor model
is the judge here; its own errors against measured steps are in docs/BENCHMARKS.md
("The executor model's category scales").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harts.bench.provenance import provenance  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.config.plan import PlanConfig  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.plan.step import step_from_plan  # noqa: E402
from harts.sim.executor import plan_floors  # noqa: E402
from harts.sim.fit_executor import case_of, predict  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.tree import build_forest, shapes  # noqa: E402

PLANS = ("l1l2", "l1l2-floors", "l1", "expanded-ffd")


def run(model: str, hardware: str, families: list[str], seeds: list[int], budgets: list[int]) -> dict:
    cfg = get_model_config(model)
    hw = load_hardware(hardware)
    rows = []
    for family in families:
        for seed in seeds:
            for budget in budgets:
                forest = build_forest(shapes.draw(family, seed, budget, vocab_size=min(32768, cfg.vocab_size)))
                floors = plan_floors(cfg, hw, budget)
                configs = {
                    "l1l2": ("l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size)),
                    "l1l2-floors": ("l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size,
                                                       **floors)),
                    "l1": ("l1", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size)),
                    "expanded-ffd": ("expanded-ffd", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size)),
                    "unsplit": ("l1l2", PlanConfig(microbatch_tokens=max(131072, forest.compact_tokens),
                                                   chunk_size=cfg.chunk_size)),
                }
                row = {"instance": f"{family}/{seed}@{budget}", "rows": forest.compact_tokens,
                       "floors": list(floors.values()), "plans": {}}
                for name, (planner, pc) in configs.items():
                    plan = make_plan(forest, planner, pc)
                    step = step_from_plan(plan, forest, cfg.chunk_size)
                    row["plans"][name] = {
                        "seconds": predict(hw.executor, case_of(row["instance"], name, step, cfg, hw)),
                        "microbatches": len(plan.microbatches),
                        "windows": sum(1 for m in plan.microbatches if m.producer is not None) > 0,
                    }
                best = min(row["plans"][p]["seconds"] for p in PLANS)
                row["best_split"] = min(PLANS, key=lambda p: row["plans"][p]["seconds"])
                for p in ("l1l2", "l1l2-floors"):
                    row["plans"][p]["regret"] = row["plans"][p]["seconds"] / best - 1
                rows.append(row)
                print(f"{row['instance']:20s} " + " ".join(
                    f"{p} {v['seconds']:.3f}s/{v['microbatches']}{'w' if v['windows'] else ''}"
                    for p, v in row["plans"].items()), flush=True)
    summary = {}
    for p in ("l1l2", "l1l2-floors"):
        reg = [r["plans"][p]["regret"] for r in rows]
        summary[p] = {"mean_regret": sum(reg) / len(reg), "worst_regret": max(reg),
                      "within_2pct": sum(x <= 0.02 for x in reg), "cases": len(reg),
                      "chose_windows": sum(r["plans"][p]["windows"] for r in rows)}
    return {"model": model, "hardware": hardware, "rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--families", default=",".join(shapes.FAMILIES))
    ap.add_argument("--seeds", default="3,4,5")
    ap.add_argument("--budgets", default="8192,16384,32768")
    ap.add_argument("--json", help="write the rows, the summary and provenance here")
    args = ap.parse_args(argv)
    out = run(args.model, args.hardware, args.families.split(","), [int(x) for x in args.seeds.split(",")],
              [int(x) for x in args.budgets.split(",")])
    print()
    print("| l1l2 | cases | chose windows | mean regret | worst regret | within 2% of the best split |")
    print("|---|---:|---:|---:|---:|---:|")
    for p, s in out["summary"].items():
        print(f"| {p} | {s['cases']} | {s['chose_windows']} | {100 * s['mean_regret']:.1f}% | "
              f"{100 * s['worst_regret']:.1f}% | {s['within_2pct']} |")
    if args.json:
        out["provenance"] = provenance([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
