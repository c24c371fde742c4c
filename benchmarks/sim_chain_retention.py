"""Chain pieces sized by their context (`PlanConfig.chain_retention`) against the producer
charge alone, simulated (no GPU).

    python benchmarks/sim_chain_retention.py [--hardware h100] [--model tiny-h200]
        [--retentions 0.076] [--families long-agent,long-group] [--seeds 0,...,5]
        [--budgets 8192,16384,32768] [--chains chain64k@16384,single131k@32768,...]
        [--json OUT.json]

For every instance (`family/seed@budget` drawn by `harts.tree.shapes`, and `--chains`:
one trajectory of N x 1,024 tokens at a budget, `chain<N>k@B` or `single<N>k@B`) the plan
`harts train` makes (l1l2 with the profile's microbatch floors, `plan_floors`) and the
expanded-ffd plan are simulated on one GPU of the profile (executor cost model, the outer
stashes' rule at its default) with `chain_retention` None (the producer charge alone) and at
each of `--retentions`: microbatches, step time over the unsplit step of the same rows (one
microbatch, the budget raised to the rows), and the window plan's peak over the expanded
step's under the same retention (the window suite's memory target) and under None, and a
single trajectory's peak over an ordinary step of its budget (four trajectories of B - 768
tokens, expanded). The
simulator's peaks are within 3.7% of the measured window and chain steps
(docs/BENCHMARKS.md, "The simulator's memory against measured peaks").
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_chain_memory import _traj  # noqa: E402  (benchmarks/sim_chain_memory.py)

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


def _sim(plan, forest, model, hw) -> dict:
    step = step_from_plan(plan, forest, model.chunk_size)
    res = simulate(step, "non-overlap", model, ParallelConfig(), hw, cost_model="executor")
    return {"step_s": res.step_seconds, "peak_bytes": res.peak_memory_bytes, "microbatches": plan.num_microbatches}


def instance(name: str, vocab: int):
    """(trajectories, budget) of `family/seed@budget` or `chain<N>k@B` / `single<N>k@B`."""
    if m := re.fullmatch(r"(?:chain|single)(\d+)k@(\d+)", name):
        n = int(m.group(1)) * 1024
        return [_traj("long", np.random.default_rng(n).integers(1, vocab, n))], int(m.group(2))
    family, rest = name.split("/")
    seed, budget = (int(x) for x in rest.split("@"))
    return shapes.draw(family, seed, budget, vocab_size=vocab), budget


def ordinary_peak(budget: int, model, hw) -> float:
    """The simulated peak of an ordinary step at `budget`: four trajectories of budget - 768
    tokens, expanded (benchmarks/sim_chain_memory.py's reference)."""
    trajs = [_traj(f"o{i}", np.random.default_rng(i).integers(1, model.vocab_size, budget - 768)) for i in range(4)]
    forest = build_forest(trajs)
    plan = make_plan(forest, "expanded-ffd", PlanConfig(microbatch_tokens=budget, chunk_size=model.chunk_size))
    return _sim(plan, forest, model, hw)["peak_bytes"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--retentions", default="0.076")
    ap.add_argument("--families", default="long-agent,long-group")
    ap.add_argument("--seeds", default="0,1,2,3,4,5")
    ap.add_argument("--budgets", default="8192,16384,32768")
    ap.add_argument("--chains", default="chain32k@16384,chain64k@16384,chain96k@16384,chain256k@16384,"
                                        "single64k@32768,single131k@32768,single196k@32768,single262k@32768,"
                                        "single512k@32768")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, hw = get_model_config(args.model), load_hardware(args.hardware)
    settings = [None, *(float(r) for r in args.retentions.split(",") if r)]
    names = [f"{f}/{s}@{b}" for f in args.families.split(",") if f for b in args.budgets.split(",")
             for s in args.seeds.split(",")] + [c for c in args.chains.split(",") if c]
    rows = []
    print(f"{'instance':24s} {'rows':>7s}  " + "  ".join(
        f"{'cr ' + str(c):>10s}: mbs  w/unsplit  peak/exp  peak/exp(None)" for c in settings))
    for name in names:
        trajs, budget = instance(name, model.vocab_size)
        forest = build_forest(trajs)
        rows_n = int(forest.compact_tokens)
        unsplit = _sim(make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=max(131072, rows_n),
                                                            chunk_size=model.chunk_size)), forest, model, hw)
        floors = plan_floors(model, hw, budget)
        r = {"instance": name, "budget": budget, "rows": rows_n, "unsplit": unsplit, "by_retention": {}}
        for c in settings:
            cfg = PlanConfig(microbatch_tokens=budget, chunk_size=model.chunk_size, chain_retention=c)
            w = _sim(make_plan(forest, "l1l2", PlanConfig(**{**cfg.__dict__, **floors})), forest, model, hw)
            e = _sim(make_plan(forest, "expanded-ffd", cfg), forest, model, hw)
            r["by_retention"][str(c)] = {"windows": w, "expanded": e, "over_unsplit": w["step_s"] / unsplit["step_s"],
                                         "peak_over_expanded": w["peak_bytes"] / e["peak_bytes"]}
        base_e = r["by_retention"]["None"]["expanded"]["peak_bytes"]
        for v in r["by_retention"].values():
            v["peak_over_expanded_none"] = v["windows"]["peak_bytes"] / base_e
        if "/" not in name:  # one long trajectory: against an ordinary step of the budget
            r["ordinary_peak_bytes"] = ordinary_peak(budget, model, hw)
            for v in r["by_retention"].values():
                v["peak_over_ordinary"] = v["windows"]["peak_bytes"] / r["ordinary_peak_bytes"]
        rows.append(r)
        print(f"{name:24s} {rows_n:7d}  " + "  ".join(
            f"{v['windows']['microbatches']:14d} {v['over_unsplit']:9.3f} {v['peak_over_expanded']:9.3f} "
            f"{v['peak_over_expanded_none']:14.3f}" for v in r["by_retention"].values()), flush=True)
    chains = [r for r in rows if "ordinary_peak_bytes" in r]
    if chains:
        print("\none trajectory, peak / ordinary step of the budget: " + ", ".join(
            f"{r['instance']} " + " -> ".join(f"{v['peak_over_ordinary']:.3f}" for v in r["by_retention"].values())
            for r in chains))
    print("\nmean (max) window step / unsplit, and max peak / expanded (same retention), per group")
    groups: dict = {}
    for r in rows:
        key = r["instance"].split("/")[0] + f"@{r['budget']}" if "/" in r["instance"] else "chains"
        groups.setdefault(key, []).append(r)
    for key, sel in groups.items():
        print(f"{key:20s} " + "  ".join(
            f"cr {c}: {statistics.mean(s['by_retention'][str(c)]['over_unsplit'] for s in sel):.3f} "
            f"({max(s['by_retention'][str(c)]['over_unsplit'] for s in sel):.3f}; "
            f"peak {max(s['by_retention'][str(c)]['peak_over_expanded'] for s in sel):.3f})" for c in settings))
    if args.json:
        write_result(args.json, annotation="simulated window and expanded plans with chain pieces sized by "
                     "their context (chain_retention) against the producer charge alone "
                     "(benchmarks/sim_chain_retention.py)",
                     hardware=args.hardware, model=args.model, retentions=settings, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
