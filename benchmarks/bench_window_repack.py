"""Windows repacked into fewer slots (the producer computing items whole): what it changes
in the plans and in the simulator's price, over the shape families (no GPU).

    python benchmarks/bench_window_repack.py [--hardware h100] [--model tiny-h200]
        [--families grpo,bushy,...] [--seeds 1,2,3,4,5] [--budgets 8192,16384,32768] [--json OUT.json]

For every `harts.tree.shapes` instance (family/seed@budget): the `l1l2` plan at the budget as
the library makes it (`repacked`) and with `take_into_producers` left out (`cells`, the
plan the cells give), their microbatch counts against the compact-row bound
ceil(rows / budget), the producers' rows and the rows consumers read of them, and each
plan's simulated step over the unsplit tree's (`--hardware`'s executor model, one GPU; the
model's own errors against measured steps are in docs/BENCHMARKS.md). Prints a table per
family and budget; `--json` writes every row with provenance.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harts.bench.provenance import write_result  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.config.plan import PlanConfig  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.plan.planners.l1l2 import pipeline  # noqa: E402
from harts.plan.step import step_from_plan  # noqa: E402
from harts.sim.fit_executor import UNSPLIT_BUDGET, case_of, predict  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.tree import build_forest, shapes  # noqa: E402


def family_args(ap: argparse.ArgumentParser, seeds: str = "1,2,3,4,5") -> None:
    """The instance-suite arguments: hardware, model, families x budgets x seeds, --json."""
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--families", default=",".join(shapes.FAMILIES))
    ap.add_argument("--seeds", default=seeds)
    ap.add_argument("--budgets", default="8192,16384,32768")
    ap.add_argument("--json", default=None)


def instances(args: argparse.Namespace, model):
    """(name family/seed@budget, family, budget, forest) of every instance, family by
    family, budget by budget, seed by seed."""
    for fam in args.families.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                trajs = shapes.draw(fam, seed, budget, vocab_size=model.vocab_size)
                yield f"{fam}/{seed}@{budget}", fam, budget, build_forest(trajs)


def unsplit_plan(forest, chunk: int):
    """The instance's rows as one microbatch (the unsplit tree the window plans are priced against)."""
    return make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=max(UNSPLIT_BUDGET, forest.compact_tokens),
                                                chunk_size=chunk))


def row(instance: str, model, hw, forest, budget: int) -> dict:
    chunk = model.chunk_size

    def price(plan, kind):
        return predict(hw.executor, case_of(instance, kind, step_from_plan(plan, forest, chunk), model, hw))

    tree = unsplit_plan(forest, chunk)
    config = PlanConfig(microbatch_tokens=budget, chunk_size=chunk)
    repacked = make_plan(forest, "l1l2", config)
    with mock.patch.object(pipeline, "take_into_producers", lambda cells, cfg, solver=None: (cells, 0)):
        cells = make_plan(forest, "l1l2", config)
    tree_s = price(tree, "tree")
    out = {"instance": instance, "rows": int(forest.compact_tokens), "bound": math.ceil(forest.compact_tokens / budget),
           "tree_s": tree_s}
    for name, plan in (("cells", cells), ("repacked", repacked)):
        prods = sorted({m.producer for m in plan.microbatches if m.producer is not None})
        out[name] = {"microbatches": len(plan.microbatches),
                     "producer_rows": [plan.microbatches[p].executed_tokens for p in prods],
                     "read_rows": [plan.read_rows(p) for p in prods],
                     "max_memory_tokens": max(plan.memory_tokens()),
                     "step_s": (s := price(plan, "windows")), "over_unsplit": s / tree_s}
    out["microbatches_saved"] = repacked.info.get("microbatches_saved", 0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    family_args(ap)
    args = ap.parse_args(argv)
    model, hw = get_model_config(args.model), load_hardware(args.hardware)
    rows = []
    for inst, _fam, budget, forest in instances(args, model):
        rows.append(row(inst, model, hw, forest, budget))
        r = rows[-1]
        print(f"{inst:22s} bound {r['bound']:2d}  microbatches {r['cells']['microbatches']:2d} -> "
              f"{r['repacked']['microbatches']:2d}  window/unsplit (sim) {r['cells']['over_unsplit']:.3f} -> "
              f"{r['repacked']['over_unsplit']:.3f}", flush=True)
    over = {k: sum(r[k]["microbatches"] > r["bound"] for r in rows) for k in ("cells", "repacked")}
    print(f"instances over the bound: {over['cells']} -> {over['repacked']} of {len(rows)}")
    if args.json:
        write_result(args.json, hardware=args.hardware, model=args.model, over_bound=over, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
