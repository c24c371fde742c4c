"""How many kernel launches per microbatch would the window plans' targets take? The
executor model's price of l1l2 window plans over the unsplit tree, with the launch counts
scaled down and the host made slower, over the shape families (simulated, no GPU).

    python benchmarks/bench_window_launch_whatif.py [--hardware h100] [--families grpo,...]
        [--seeds 1,2,3] [--budgets 8192,16384,32768] [--launch-scales 1,0.75,0.5,0.25]
        [--host-scales 1,1.3] [--json OUT.json]

For every `harts.tree.shapes` instance (family/seed@budget) the `l1l2` plan at the budget
and the unsplit tree are priced by `--hardware`'s executor model (one GPU) with every
per-microbatch launch count (`launches_per_microbatch`, `_per_extra_kda_round`,
`_per_consumer`, `_per_sequence`) times a launch scale, and `host_s_per_launch` times a
host scale (a slower host: 1.3 is about the second H100 of 2026-12-06, whose window steps
took 1.2-1.3x the first's). A launch scale below 1 stands for work no code does yet (fewer,
fused or graph-captured launches); the model prices launches as host time only, so a
scale moves a step only where its host is the bound. Each launch's own device time (a
small kernel's few microseconds) sits in the model's fitted device terms (the consumers'
per-producer-row seconds among them) and is not scaled: where the device is the bound the
gain of fewer launches is not priced. Prints, per family and budget, the
mean and max simulated window / unsplit at each setting; `--json` writes every row with
provenance. The model's own errors against measured steps are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_window_repack import family_args, instances, unsplit_plan  # noqa: E402

from harts.bench.provenance import write_result  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.config.plan import PlanConfig  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.plan.step import step_from_plan  # noqa: E402
from harts.sim.fit_executor import case_of, predict  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402

LAUNCH_COUNTS = ("launches_per_microbatch", "launches_per_extra_kda_round", "launches_per_consumer",
                 "launches_per_sequence")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    family_args(ap, seeds="1,2,3")
    ap.add_argument("--launch-scales", default="1,0.75,0.5,0.25")
    ap.add_argument("--host-scales", default="1,1.3")
    args = ap.parse_args(argv)
    model, hw = get_model_config(args.model), load_hardware(args.hardware)
    base = hw.executor
    settings = [(ls, hs) for hs in (float(x) for x in args.host_scales.split(","))
                for ls in (float(x) for x in args.launch_scales.split(","))]
    rates = {s: base.with_values(host_s_per_launch=base.host_s_per_launch * s[1],
                                 **{n: getattr(base, n) * s[0] for n in LAUNCH_COUNTS}) for s in settings}
    rows = []
    chunk = model.chunk_size
    for inst, fam, budget, forest in instances(args, model):
        plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=chunk))
        cases = {k: case_of(inst, k, step_from_plan(p, forest, chunk), model, hw)
                 for k, p in (("tree", unsplit_plan(forest, chunk)), ("windows", plan))}
        ratios = {f"{ls:g}x launches, {hs:g}x host": predict(rates[(ls, hs)], cases["windows"])
                  / predict(rates[(ls, hs)], cases["tree"]) for ls, hs in settings}
        rows.append({"instance": inst, "family": fam, "budget": budget, "rows": int(forest.compact_tokens),
                     "microbatches": len(plan.microbatches), "window_over_unsplit": ratios})
        print(f"{inst:22s} mbs {len(plan.microbatches):2d}  " + "  ".join(f"{v:.3f}" for v in ratios.values()),
              flush=True)
    keys = list(rows[0]["window_over_unsplit"]) if rows else []
    print("\nsimulated window / unsplit, mean (max), per family and budget:")
    print(f"{'family@budget':18s} " + " | ".join(keys))
    summary = {}
    for fam in args.families.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            sel = [r for r in rows if r["family"] == fam and r["budget"] == budget]
            cell = {k: (sum(r["window_over_unsplit"][k] for r in sel) / len(sel),
                        max(r["window_over_unsplit"][k] for r in sel)) for k in keys}
            summary[f"{fam}@{budget}"] = cell
            print(f"{fam + '@' + str(budget):18s} " + " | ".join(f"{m:.3f} ({x:.3f})" for m, x in cell.values()))
    if args.json:
        write_result(args.json, hardware=args.hardware, model=args.model, settings=keys, summary=summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
