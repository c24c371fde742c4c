"""Window plans' peak memory against the expanded step's at the same budget, over the shape
families (simulated, no GPU).

    python benchmarks/sim_window_peaks.py [--hardware h100] [--families grpo,...]
        [--seeds 1,2,3] [--budgets 8192,16384,32768] [--json OUT.json]

For every `harts.tree.shapes` instance (family/seed@budget) the `expanded-ffd` plan and the
`l1l2` window plan at the budget, and the unsplit tree, are simulated on one GPU of
`--hardware`'s profile (executor cost model): peak memory (`SimResult.peak_memory_bytes`,
which is within a few percent of measured peaks, docs/BENCHMARKS.md "The simulator's memory
against measured peaks") and step time. Beside them, in token units, the expanded plan's
largest microbatch (its peak's rows: `expanded-ffd` packs whole trajectories, so where two
do not fit one microbatch it holds one, below the budget) and the window plan's largest
`memory_tokens` (rows plus `producer_retention` x the rows its producer keeps for it,
what l1l2 fills to the budget). Last, the l1l2 plan made at the expanded plan's largest
microbatch as its budget ("capped"): what a window plan held to the expanded step's memory
would cost. Prints per instance and a per family and budget summary (how many window plans
peak above the expanded step, mean and max ratio); `--json` writes every row with
provenance.
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
from harts.plan.memory import memory_tokens  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.plan.step import step_from_plan  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.sim.simulate import simulate  # noqa: E402

GIB = 2**30


def priced(plan, forest, model, hw) -> dict:
    """Simulated step seconds and peak bytes of `plan` on one GPU."""
    res = simulate(step_from_plan(plan, forest, model.chunk_size), "non-overlap", model, ParallelConfig(), hw,
                   cost_model="executor")
    return {"microbatches": len(plan.microbatches), "step_s": res.step_seconds, "peak_bytes": res.peak_memory_bytes}


def row(instance: str, family: str, budget: int, forest, model, hw) -> dict:
    chunk = model.chunk_size
    expanded = make_plan(forest, "expanded-ffd", PlanConfig(microbatch_tokens=budget, chunk_size=chunk))
    windows = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=chunk))
    largest = max(m.executed_tokens for m in expanded.microbatches)
    capped = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=largest, chunk_size=chunk))
    out = {"instance": instance, "family": family, "budget": budget, "rows": int(forest.compact_tokens),
           "expanded_largest_tokens": largest, "windows_largest_memory_tokens": max(memory_tokens(windows)),
           "tree": priced(unsplit_plan(forest, chunk), forest, model, hw),
           "expanded": priced(expanded, forest, model, hw), "windows": priced(windows, forest, model, hw),
           "capped": priced(capped, forest, model, hw)}
    for k in ("windows", "capped"):
        out[k]["peak_over_expanded"] = out[k]["peak_bytes"] / out["expanded"]["peak_bytes"]
        out[k]["step_over_unsplit"] = out[k]["step_s"] / out["tree"]["step_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    family_args(ap, seeds="1,2,3")
    args = ap.parse_args(argv)
    model, hw = get_model_config(args.model), load_hardware(args.hardware)
    rows = []
    for inst, fam, budget, forest in instances(args, model):
        r = row(inst, fam, budget, forest, model, hw)
        rows.append(r)
        w, c = r["windows"], r["capped"]
        print(f"{inst:22s} expanded largest {r['expanded_largest_tokens']:6d}  windows memory {r['windows_largest_memory_tokens']:8.0f}"
              f"  peak / expanded {w['peak_over_expanded']:.3f} (step / unsplit {w['step_over_unsplit']:.3f})"
              f"  capped {c['peak_over_expanded']:.3f} ({c['step_over_unsplit']:.3f}, {c['microbatches']} mbs)", flush=True)
    print("\nper family and budget: window plans peaking above expanded; mean (max) peak / expanded; "
          "the same capped, and its mean (max) step / unsplit")
    summary = {}
    for fam in args.families.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            sel = [r for r in rows if r["family"] == fam and r["budget"] == budget]
            if not sel:
                continue

            def stat(kind: str, key: str, sel: list = sel) -> tuple[float, float]:
                xs = [r[kind][key] for r in sel]
                return sum(xs) / len(xs), max(xs)

            cell = {"instances": len(sel), "above": sum(r["windows"]["peak_over_expanded"] > 1 for r in sel),
                    "peak": stat("windows", "peak_over_expanded"), "step": stat("windows", "step_over_unsplit"),
                    "capped_peak": stat("capped", "peak_over_expanded"),
                    "capped_step": stat("capped", "step_over_unsplit")}
            summary[f"{fam}@{budget}"] = cell
            print(f"{fam + '@' + str(budget):18s} above {cell['above']}/{cell['instances']}  "
                  + "  ".join(f"{k} {m:.3f} ({x:.3f})" for k, (m, x) in
                              ((k, cell[k]) for k in ("peak", "step", "capped_peak", "capped_step"))))
    if args.json:
        write_result(args.json, hardware=args.hardware, model=args.model, summary=summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
