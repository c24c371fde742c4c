"""The planners under data parallelism over the shape families (simulated, no GPU): does
l1l2 keep every replica busy, or does another plan of the same step run faster?

    python benchmarks/sim_dp_planners.py [--hardware h100] [--families grpo,...,long-group]
        [--seeds 101,102] [--dp 1,2,4] [--ep] [--json OUT.json]

Each instance is a `harts.tree.shapes` draw (family/seed) at a budget drawn per instance
from 8k/16k/32k, planned at that budget, at half of it and at a budget drawn from 4k-48k
(so the plans meet trees drawn for other budgets), on dp replicas, by `l1l2`, `l1` and
`expanded-ffd`, each with the window floors `harts sim` uses by default
(`harts.sim.executor.window_floors` for the model on the profile), and by `l1l2` with
`split_trees=False` (every tree on one replica: the planner before trees were split over
replicas). Every plan is simulated on `--hardware`'s executor cost model with dp GPUs
(`--ep`: with expert parallelism over them, ep = dp, the replicas' passes in lockstep as
`harts sim --gpus N` runs them by default).
Prints, per dp, how many cases have l1l2 more than 2% slower than the fastest other
plan, and the worst ratios; `--json` writes every case with provenance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harts.bench.provenance import write_result  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.config.parallel import ParallelConfig  # noqa: E402
from harts.config.plan import PlanConfig  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.plan.step import step_from_plan  # noqa: E402
from harts.sim.executor import plan_floors  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.sim.simulate import simulate  # noqa: E402
from harts.tree import build_forest, shapes  # noqa: E402

PLANS = (("l1l2", "l1l2", True), ("l1", "l1", True), ("expanded-ffd", "expanded-ffd", True),
         ("l1l2-unsplit", "l1l2", False))


def case(forest, budget: int, dp: int, model, hw, ep: bool = False) -> dict:
    out = {}
    floors = plan_floors(model, hw, budget)
    for key, planner, split in PLANS:
        plan = make_plan(forest, planner, PlanConfig(dp=dp, ep=dp if ep else 1, microbatch_tokens=budget,
                                                     chunk_size=model.chunk_size, split_trees=split, **floors))
        res = simulate(step_from_plan(plan, forest, model.chunk_size), "non-overlap", model,
                       ParallelConfig(dp=dp, ep=dp if ep else 1), hw, cost_model="executor")
        out[key] = {"step_s": res.step_seconds, "microbatches": len(plan.microbatches),
                    "executed_tokens": plan.executed_tokens, "split_trees": plan.info.get("split_trees", [])}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--families", default=",".join([*shapes.FAMILIES, *shapes.LONG_FAMILIES]))
    ap.add_argument("--seeds", default="101,102")
    ap.add_argument("--dp", default="1,2,4")
    ap.add_argument("--ep", action="store_true", help="expert parallelism over the replicas (ep = dp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, hw = get_model_config(args.model), load_hardware(args.hardware)
    dps = [int(d) for d in args.dp.split(",")]
    rows = []
    for fam in args.families.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            rng = np.random.default_rng(seed)
            drawn = int(rng.choice([8192, 16384, 32768]))
            forest = build_forest(shapes.draw(fam, seed, drawn, vocab_size=model.vocab_size))
            for budget in sorted({drawn, drawn // 2, int(rng.integers(4096, 49152))}):
                for dp in dps:
                    r = {"instance": f"{fam}/{seed}@{drawn}", "family": fam, "budget": budget, "dp": dp,
                         **case(forest, budget, dp, model, hw, args.ep)}
                    best_other = min(r[k]["step_s"] for k in ("l1", "expanded-ffd"))
                    r["l1l2_over_best_other"] = r["l1l2"]["step_s"] / best_other
                    r["unsplit_over_best_other"] = r["l1l2-unsplit"]["step_s"] / best_other
                    rows.append(r)
                    print(f"{r['instance']:22s} @{budget:6d} dp={dp}  l1l2 {r['l1l2']['step_s']:.3f}s "
                          f"(split {r['l1l2']['split_trees']})  unsplit {r['l1l2-unsplit']['step_s']:.3f}s  "
                          f"l1 {r['l1']['step_s']:.3f}s  ffd {r['expanded-ffd']['step_s']:.3f}s", flush=True)
    summary = {}
    print("\nper dp: cases where l1l2 is > 2% slower than the fastest of l1 and expanded-ffd "
          "(with trees split over replicas / without); worst ratios")
    for dp in dps:
        sel = [r for r in rows if r["dp"] == dp]
        cell = {"cases": len(sel),
                "l1l2_slower": sum(r["l1l2_over_best_other"] > 1.02 for r in sel),
                "unsplit_slower": sum(r["unsplit_over_best_other"] > 1.02 for r in sel),
                "l1l2_worst": max(r["l1l2_over_best_other"] for r in sel),
                "unsplit_worst": max(r["unsplit_over_best_other"] for r in sel),
                "split_faster_than_unsplit": sum(r["l1l2"]["step_s"] < r["l1l2-unsplit"]["step_s"] * 0.98 for r in sel),
                "split_slower_than_unsplit": sum(r["l1l2"]["step_s"] > r["l1l2-unsplit"]["step_s"] * 1.02 for r in sel)}
        summary[f"dp={dp}"] = cell
        print(f"dp={dp}: {cell['cases']} cases; l1l2 slower in {cell['l1l2_slower']} (worst {cell['l1l2_worst']:.3f}x), "
              f"unsplit slower in {cell['unsplit_slower']} (worst {cell['unsplit_worst']:.3f}x); split faster than "
              f"unsplit in {cell['split_faster_than_unsplit']}, slower in {cell['split_slower_than_unsplit']}")
    if args.json:
        write_result(args.json, hardware=args.hardware, model=args.model, ep=args.ep, summary=summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
