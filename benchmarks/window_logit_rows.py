"""Rows through the LM head of a window plan against the unsplit tree's, over the shape families.

    python benchmarks/window_logit_rows.py [--seeds 1 2 3 4 5] [--budgets 8192 16384 32768] [--json FILE]

For each `harts.tree.shapes` instance and budget, the `l1l2` plan at that budget; per
microbatch the distinct hidden rows whose logits its targets read, summed over the plan:
with each target served where its hidden row is computed (`serving_microbatch`, what the
plan layout runs) and, for comparison, with each target served by its trajectory's own
microbatch (the layout before: a consumer formed the logits of every shared row it read
from its producer again). The unsplit tree forms each row's logits once: its count is the
forest's distinct target rows. Host-only (numpy and the planner); prints one line per
instance and the range per family.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402


def logit_rows(forest, plan) -> dict:
    from harts.exec.layouts.plan import piece_rows, serving_microbatch

    targets = forest.targets()
    mbs = {m.id: m for m in plan.microbatches}
    computed = {m.id: piece_rows(forest, m.pieces) for m in plan.microbatches}
    served = serving_microbatch(targets, plan.microbatches, computed, mbs)
    by_owner = by_server = 0
    for m in plan.microbatches:
        own = np.isin(targets.traj, np.asarray(m.trajectories, np.int64))
        by_owner += np.unique(targets.row[own]).size
        by_server += np.unique(targets.row[served == m.id]).size
    return {"unsplit": int(np.unique(targets.row).size), "served_where_computed": int(by_server),
            "served_by_trajectory": int(by_owner), "microbatches": len(plan.microbatches),
            "consumers": sum(1 for m in plan.microbatches if m.producer is not None)}


def main(argv: list[str]) -> int:
    from harts.bench.provenance import provenance
    from harts.config.models import get_model_config
    from harts.plan.planners import PlanConfig, make_plan
    from harts.tree import build_forest, shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(shapes.FAMILIES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = get_model_config(args.model)
    rows = []
    for family in args.families.split(","):
        for seed in args.seeds:
            for budget in args.budgets:
                forest = build_forest(shapes.draw(family, seed, budget, vocab_size=min(cfg.vocab_size, 32768)))
                plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size))
                r = {"instance": f"{family}/{seed}@{budget}", **logit_rows(forest, plan)}
                rows.append(r)
                print(f"{r['instance']:22s} mbs {r['microbatches']} unsplit {r['unsplit']:6d} "
                      f"by trajectory {r['served_by_trajectory'] / r['unsplit']:.3f}x "
                      f"where computed {r['served_where_computed'] / r['unsplit']:.3f}x", flush=True)
    print()
    for family in args.families.split(","):
        fam = [r for r in rows if r["instance"].startswith(family + "/") and r["consumers"]]
        if fam:
            a = [r["served_by_trajectory"] / r["unsplit"] for r in fam]
            b = [r["served_where_computed"] / r["unsplit"] for r in fam]
            print(f"{family:12s} {len(fam):3d} window plans: by trajectory {min(a):.3f}-{max(a):.3f}x, "
                  f"where computed {min(b):.3f}-{max(b):.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance([sys.argv[0], *argv]), "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
