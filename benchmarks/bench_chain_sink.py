"""Leaves sunk into later leaves of a chain: the simulator's verdict over the long
families (no GPU).

    python benchmarks/bench_chain_sink.py [--hardware h100] [--model tiny-h200]
        [--families long-agent,long-group] [--seeds 0,1,...] [--budgets 8192,16384,32768] [--json OUT.json]

For every `harts.tree.shapes` instance (family/seed@budget) the l1l2 plan with the
microbatch floors `harts train` plans with (`harts.sim.executor.plan_floors` of the model
and `--hardware`'s profile at the budget), once with `PlanConfig.sink_leaves` (a host-paced
leaf moved into a later leaf, `harts.plan.planners.leaves.sink_leaves`) and once without,
beside the unsplit tree and `expanded-ffd`. Each is simulated on one GPU of the profile
(executor cost model): step seconds and peak memory. Reported per instance where the two
plans differ: microbatches, window step / unsplit step, peak / expanded peak, and the
change; then how many instances changed, were faster or slower. The executor model is
the judge; its errors against measured steps and peaks are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_window_peaks import priced  # noqa: E402  (simulated step seconds and peak of a plan)

from harts.bench.provenance import write_result  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.config.plan import PlanConfig  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.sim.executor import plan_floors  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.tree import build_forest, shapes  # noqa: E402

UNSPLIT_BUDGET = 131072


def row(instance: str, forest, budget: int, model, hw, **fields) -> dict:
    chunk = model.chunk_size
    config = PlanConfig(microbatch_tokens=budget, chunk_size=chunk, **plan_floors(model, hw, budget), **fields)
    unsplit = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=max(UNSPLIT_BUDGET, forest.compact_tokens),
                                                   chunk_size=chunk))
    out = {"instance": instance, "rows": int(forest.compact_tokens),
           "tree": priced(unsplit, forest, model, hw),
           "expanded": priced(make_plan(forest, "expanded-ffd", config), forest, model, hw)}
    for name, cfg in (("kept", dataclasses.replace(config, sink_leaves=False)), ("sunk", config)):
        plan = make_plan(forest, "l1l2", cfg)
        plan.validate(forest)
        r = priced(plan, forest, model, hw)
        r["step_over_unsplit"] = r["step_s"] / out["tree"]["step_s"]
        r["peak_over_expanded"] = r["peak_bytes"] / out["expanded"]["peak_bytes"]
        out[name] = r
    out["change"] = out["sunk"]["step_s"] / out["kept"]["step_s"] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--families", default=",".join(shapes.LONG_FAMILIES))
    ap.add_argument("--seeds", default=",".join(str(s) for s in range(12)))
    ap.add_argument("--budgets", default="8192,16384,32768")
    ap.add_argument("--chain-retention", default=None, metavar="R|off",
                    help="PlanConfig.chain_retention of every plan (default: PlanConfig's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    fields = {} if args.chain_retention is None else {
        "chain_retention": None if args.chain_retention == "off" else float(args.chain_retention)}
    model, hw = get_model_config(args.model), load_hardware(args.hardware)
    rows = []
    for fam in args.families.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                forest = build_forest(shapes.draw(fam, seed, budget, vocab_size=model.vocab_size))
                r = row(f"{fam}/{seed}@{budget}", forest, budget, model, hw, **fields)
                rows.append(r)
                if r["kept"]["microbatches"] != r["sunk"]["microbatches"] or abs(r["change"]) > 1e-9:
                    k, s = r["kept"], r["sunk"]
                    print(f"{r['instance']:22s} kept {k['microbatches']:2d} mbs {k['step_over_unsplit']:.3f}x unsplit "
                          f"peak {k['peak_over_expanded']:.3f}x expanded   sunk {s['microbatches']:2d} mbs "
                          f"{s['step_over_unsplit']:.3f}x  peak {s['peak_over_expanded']:.3f}x   {100 * r['change']:+.1f}%",
                          flush=True)
    changed = [r for r in rows if abs(r["change"]) > 1e-9 or r["kept"]["microbatches"] != r["sunk"]["microbatches"]]
    summary = {"instances": len(rows), "changed": len(changed),
               "faster_1pct": sum(r["change"] < -0.01 for r in changed),
               "slower": sum(r["change"] > 1e-9 for r in changed),
               "largest_gain": min((r["change"] for r in changed), default=0.0),
               "largest_peak_rise": max((r["sunk"]["peak_bytes"] / r["kept"]["peak_bytes"] - 1 for r in changed),
                                        default=0.0)}
    print(json.dumps(summary))
    if args.json:
        write_result(args.json, hardware=args.hardware, model=args.model, summary=summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
