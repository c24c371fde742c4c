"""Simulator measurements: the Table-6 schedule ablation, l1l2-vs-expanded speedups for
every SWE preset, and how fast the simulator itself runs.

    python benchmarks/bench_sim.py [--quick] [--json OUT.json]

Everything is the roofline cost model on the h200 profile (harts/sim/hardware/h200.json)
with activation recomputation, the default parallel layouts of harts.sim.parallel, and
each preset's own microbatch budget unless one is named. Every plan is made for the pipeline
it is simulated on (`PlanConfig.pp` = the layout's PP). Table 6 is simulated twice: with
the k-th passes of an EP group run together (`ep_lockstep`, the simulator's default) and
with free-running replicas, the EP all-to-all priced inside each pass. Markdown tables go
to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from harts.config.models import get_model_config  # noqa: E402
from harts.config.plan import PlanConfig  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.plan.schedule import build_schedule  # noqa: E402
from harts.plan.step import step_from_plan  # noqa: E402
from harts.sim.costs import make_cost_model  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.sim.parallel import default_parallel  # noqa: E402
from harts.sim.simulate import simulate_step  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402

SCHEDULES = ("non-overlap", "overlap-bwd-first", "consumer-1f1b")
PAPER_T6 = {"non-overlap": 167.7, "overlap-bwd-first": 190.4, "consumer-1f1b": 208.5}
HW = load_hardware("h200")


def run(workload: str, model_name: str, gpus: int, planner: str, schedule: str, budget: int | None,
        ep_lockstep: bool = True) -> dict:
    model = get_model_config(model_name)
    par = default_parallel(model, gpus)
    cfg = preset(workload)
    forest = generate(cfg).forest()
    # plan for the pipeline that is simulated, at the named budget or the preset's own
    kw = {"dp": par.dp, "pp": par.pp, "microbatch_tokens": budget or cfg.microbatch_tokens}
    plan = make_plan(forest, planner, PlanConfig(**kw))
    step = step_from_plan(plan, forest, model.chunk_size)
    cost = make_cost_model("roofline", model, par, HW)
    t0 = time.perf_counter()
    res = simulate_step(step, build_schedule(schedule, step, par.pp), cost, ep_lockstep=ep_lockstep)
    sim_s = time.perf_counter() - t0
    return {
        "workload": workload, "model": model_name, "gpus": gpus, "parallel": par.describe(),
        "planner": planner, "schedule": schedule, "budget": plan.microbatch_tokens,
        "microbatches": plan.num_microbatches, "producers": len(step.producers),
        "compression": plan.expanded_tokens / plan.executed_tokens,
        "throughput": res.throughput, "step_seconds": res.step_seconds,
        "bubble_fraction": res.bubble_fraction, "peak_gb": res.peak_memory_bytes / 1e9,
        "fits_memory": res.fits_memory, "actions": len(res.program.actions), "sim_seconds": sim_s,
        "ep_lockstep_asked": ep_lockstep, "ep_lockstep": res.ep_lockstep,
    }


def table6(budgets: list[int | None]) -> list[dict]:
    rows = []
    for b in budgets:
        # the k-th passes of an EP group run together (the default), then free-running
        # replicas with the all-to-all as bandwidth inside each pass (--no-ep-lockstep)
        for lock in (True, False):
            for s in SCHEDULES:
                rows.append(run("swe-treestep-8", "tiny", 8, "l1l2", s, b, ep_lockstep=lock))
    print("### Table 6: PP schedules, Tiny / 8 GPUs / swe-treestep-8 / l1l2\n")
    print("| budget | EP lockstep | schedule | mbs (producers) | k tok/s | vs non-overlap | paper k tok/s | "
          "paper vs non-overlap | bubble | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(x for x in rows if x["budget"] == r["budget"]
                    and x["ep_lockstep_asked"] == r["ep_lockstep_asked"] and x["schedule"] == "non-overlap")
        lock = ("yes" if r["ep_lockstep"] else "asked, fell back") if r["ep_lockstep_asked"] else "no (free-running)"
        print(f"| {r['budget']} | {lock} | {r['schedule']} | "
              f"{r['microbatches']} ({r['producers']}) | "
              f"{r['throughput'] / 1e3:.1f} | {r['throughput'] / base['throughput']:.3f} | "
              f"{PAPER_T6[r['schedule']]} | {PAPER_T6[r['schedule']] / PAPER_T6['non-overlap']:.3f} | "
              f"{100 * r['bubble_fraction']:.1f}% | {r['peak_gb']:.1f} |")
    print()
    return rows


def speedups(configs: list[tuple[str, str, int]], budget: int | None = None) -> list[dict]:
    rows = []
    for wl, model, gpus in configs:
        try:
            base = run(wl, model, gpus, "expanded-ffd", "consumer-1f1b", budget)
            tree = run(wl, model, gpus, "l1l2", "consumer-1f1b", budget)
        except ValueError as err:
            print(f"- {wl} / {model} / budget {budget}: not plannable ({err})")
            continue
        rows.append({"base": base, "tree": tree, "speedup": tree["throughput"] / base["throughput"]})
    what = "each preset's own budget" if budget is None else f"budget {budget} tokens"
    print(f"\n### l1l2 over expanded-ffd (consumer-1f1b, {what})\n")
    print("| preset | model | layout | expanded k tok/s | l1l2 k tok/s | l1l2 compression | speedup | paper | fits HBM |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, t = r["base"], r["tree"]
        print(f"| {b['workload']} | {b['model']} | {b['parallel']} | {b['throughput'] / 1e3:,.1f} | "
              f"{t['throughput'] / 1e3:,.1f} | {t['compression']:.2f}x | {r['speedup']:.2f}x | 4.77-10.45x | "
              f"{'yes' if b['fits_memory'] and t['fits_memory'] else 'no'} |")
    print()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8 and 16 GPUs only")
    ap.add_argument("--json", help="write all rows as JSON")
    args = ap.parse_args()
    t0 = time.perf_counter()
    t6 = table6([None, 65536, 49152])
    sizes = (8, 16) if args.quick else (8, 16, 32, 64)
    configs = [(f"swe-{s}-{n}", "tiny", n) for s in ("stepwise", "treestep") for n in sizes]
    if not args.quick:
        configs += [(f"swe-{s}-{n}", "flash", n) for s in ("stepwise", "treestep") for n in (32, 64)]
    sp = speedups(configs)
    sp_small = speedups([c for c in configs if c[1] == "tiny"], budget=65536)
    sp_all = sp + sp_small
    all_rows = t6 + [r["base"] for r in sp_all] + [r["tree"] for r in sp_all]
    slowest = max(all_rows, key=lambda r: r["sim_seconds"])
    print(f"simulator: slowest step {slowest['workload']} / {slowest['planner']} / {slowest['model']}: "
          f"{slowest['actions']:,} actions in {slowest['sim_seconds']:.2f} s "
          f"({slowest['actions'] / slowest['sim_seconds']:,.0f} actions/s); whole benchmark "
          f"{time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as fh:
            from harts.bench.provenance import provenance  # git revision, command, packages, device
            json.dump({"provenance": provenance(), "table6": t6, "speedups": sp, "speedups_65536": sp_small}, fh, indent=1)


if __name__ == "__main__":
    main()
