"""Trees no one-window cell holds, over the shape families (simulated, no GPU).

    python benchmarks/sim_nested_trees.py [--hardware h100] [--families grpo,...]
        [--seeds 1,2,3,4] [--budgets 8192,16384,32768] [--fractions 0.55,0.7,0.8,0.9,1.0]
        [--json OUT.json]

For every `harts.tree.shapes` instance (family/seed@budget), planned at each fraction of
the budget it was drawn at, the `l1l2` plan (`make_plan`) on one GPU of `--hardware`'s
profile (executor cost model). Where it nests trees (`harts.plan.planners.l1l2.nested_trees`:
a tree over the budget whose one-window cell does not solve, run as nested windows),
beside it the planner's own plan of the whole forest (`l1l2.plan_with`, L1's recomputation
where no windowed plan exists: what `l1l2` ran before such trees were nested), the
unsplit tree and the expanded baseline at the same budget, each as step seconds and peak
memory. Prints one line per nested case and a per-family count; `--json` writes every
row with provenance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_window_repack import family_args, instances, unsplit_plan  # noqa: E402

from harts.bench.provenance import write_result  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.config.parallel import ParallelConfig  # noqa: E402
from harts.config.plan import PlanConfig  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.plan.planners.l1l2 import plan_with  # noqa: E402
from harts.plan.step import step_from_plan  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.sim.simulate import simulate  # noqa: E402

GIB = 2**30


def priced(plan, forest, model, hw) -> dict:
    res = simulate(step_from_plan(plan, forest, model.chunk_size), "non-overlap", model, ParallelConfig(), hw,
                   cost_model="executor")
    return {"microbatches": len(plan.microbatches), "executed_tokens": int(plan.executed_tokens),
            "step_s": res.step_seconds, "peak_gib": res.peak_memory_bytes / GIB}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    family_args(ap, seeds="1,2,3,4")
    ap.add_argument("--fractions", default="0.55,0.7,0.8,0.9,1.0")
    args = ap.parse_args(argv)
    model, hw = get_model_config(args.model), load_hardware(args.hardware)
    rows, counts = [], {}
    for inst, fam, drawn, forest in instances(args, model):
        for frac in (float(x) for x in args.fractions.split(",")):
            budget = int(drawn * frac)
            config = PlanConfig(microbatch_tokens=budget, chunk_size=model.chunk_size)
            plan = make_plan(forest, "l1l2", config)
            c = counts.setdefault(fam, {"cases": 0, "nested": 0})
            c["cases"] += 1
            if not plan.info.get("nested_trees"):
                continue
            c["nested"] += 1
            r = {"instance": inst, "family": fam, "budget": budget,
                 "rows": int(forest.compact_tokens), "longest": int(forest.traj_length.max()),
                 "nested": priced(plan, forest, model, hw),
                 "own": priced(plan_with(forest, config), forest, model, hw),
                 "tree": priced(unsplit_plan(forest, model.chunk_size), forest, model, hw),
                 "expanded": priced(make_plan(forest, "expanded-ffd", config), forest, model, hw)}
            t = r["tree"]["step_s"]
            rows.append(r)
            print(f"{r['instance']:22s} @{budget:6d}  nested {r['nested']['step_s'] / t:5.2f}x unsplit"
                  f" ({r['nested']['microbatches']} mbs)  own {r['own']['step_s'] / t:5.2f}x"
                  f" ({r['own']['executed_tokens'] / r['rows']:.2f}x rows)"
                  f"  expanded {r['expanded']['step_s'] / t:5.2f}x"
                  f"  peak nested/expanded {r['nested']['peak_gib'] / r['expanded']['peak_gib']:.3f}", flush=True)
    print("\nper family: cases planned, cases with nested trees")
    for fam, c in counts.items():
        print(f"{fam:12s} {c['cases']:4d} {c['nested']:4d}")
    if args.json:
        write_result(args.json, hardware=args.hardware, model=args.model, counts=counts, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
