"""Long trajectories' peak memory with and without the outer stashes in host memory
(simulated, no GPU).

    python benchmarks/sim_chain_memory.py [--hardware h100] [--model tiny-h200]
        [--budgets 16384,32768] [--lengths 4,8,16,32] [--shapes single,tree,forks]
        [--seeds 0] [--rules 1] [--json OUT.json]
    python benchmarks/sim_chain_memory.py --families long-agent,long-group [--seeds 0,...,7]
        [--budgets 8192,16384,32768] [--rules 1] [--json OUT.json]

For every shape, budget B and length (in budgets) the l1l2 plan at B is simulated on one GPU
of the profile (executor cost model) three times: with the executor's rule for a chain's
outer stashes at its default (`KernelConfig.chain_stash_device_budgets`: the stashes above a
reader's nearest producer stay on the device while their rows sum to at most that many
budgets, `harts.plan.step.outer_stashes_on_host`), with every stash on the device (the rule
off), and with every outer stash in host memory (0 budgets). Each peak is set against the
expanded step of four ordinary trajectories of B - 768 tokens at B (what a step of ordinary
trajectories at that budget holds), and each step time against the rule off.

`--rules` adds rules of other budget counts. `--families` takes the benchmark suites' long
families (`harts.tree.shapes`, family/seed@budget) instead of the shapes and lengths, with
the microbatch floors `harts train` plans with (`harts.sim.executor.plan_floors`), each peak
set against the expanded step of the same forest at the same budget (the window suite's
memory target).

Shapes: `single`, one trajectory of the length; `tree`, a B/2-token prompt under three
responses of 2-8k tokens and one running on to the length; `forks`, one trajectory of the
length with four branches of 2-8k tokens leaving it past its first 8k. The simulator's peaks
are within 3.7% of the measured window and chain steps up to four budgets long
(docs/BENCHMARKS.md, "The simulator's memory against measured peaks"); past that, and for
the host copies, these are predictions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harts.plan.step as plan_step  # noqa: E402
from harts.bench.provenance import write_result  # noqa: E402
from harts.config.kernels import KernelConfig  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.config.parallel import ParallelConfig  # noqa: E402
from harts.config.plan import PlanConfig  # noqa: E402
from harts.plan.planners import make_plan  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.sim.simulate import simulate  # noqa: E402
from harts.tree import build_forest  # noqa: E402
from harts.tree.trajectory import Trajectory  # noqa: E402

GIB = 2**30
SHAPES = ("single", "tree", "forks")


def _traj(name: str, tokens: np.ndarray) -> Trajectory:
    mask = np.ones(tokens.size, bool)
    mask[0] = False
    return Trajectory.make(name, "g", tokens, loss_mask=mask, advantage=1.0)


def trajectories(shape: str, length: int, budget: int, seed: int, vocab: int) -> list[Trajectory]:
    rng = np.random.default_rng([seed, SHAPES.index(shape), length, budget])

    def tokens(n: int) -> np.ndarray:
        return rng.integers(1, vocab, n)

    if shape == "single":
        return [_traj("long", tokens(length))]
    if shape == "tree":
        prompt = tokens(budget // 2)
        out = [_traj(f"r{i}", np.concatenate([prompt, tokens(int(rng.integers(2048, 8192)))])) for i in range(3)]
        return [*out, _traj("long", np.concatenate([prompt, tokens(length - prompt.size)]))]
    if shape == "forks":
        trunk = tokens(length)
        out = [_traj("long", trunk)]
        for i, at in enumerate(sorted(rng.integers(8192, length - 1024, 4))):
            out.append(_traj(f"b{i}", np.concatenate([trunk[:at], tokens(int(rng.integers(2048, 8192)))])))
        return out
    raise KeyError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")


def simulated(plan, forest, model, hw, device_budgets: float | None) -> dict:
    rule = plan_step.outer_stashes_on_host
    with mock.patch.object(plan_step, "outer_stashes_on_host", lambda p, b=None: rule(p, device_budgets)):
        step = plan_step.step_from_plan(plan, forest, model.chunk_size)
    res = simulate(step, "non-overlap", model, ParallelConfig(), hw, cost_model="executor")
    return {"peak_bytes": res.peak_memory_bytes, "step_s": res.step_seconds,
            "moved_producers": sum(w.stash_on_host for w in step.microbatches)}


def under_rules(label: str, row: dict, plan, forest, model, hw, rules: dict, ratio: str,
                reference_peak: float) -> None:
    """`row[name]` for each rule: the plan simulated under it, its peak over
    `reference_peak` (as `ratio`) and its step over the rule off's; printed after `label`."""
    for name, b in rules.items():
        row[name] = simulated(plan, forest, model, hw, b)
        row[name][ratio] = row[name]["peak_bytes"] / reference_peak
    for name in rules:
        row[name]["step_over_off"] = row[name]["step_s"] / row["off"]["step_s"]
    print(f"{label} ({row['microbatches']:3d} mbs)  "
          + "  ".join(f"{n} {row[n][ratio]:.3f} ({row[n]['step_over_off']:.3f})" for n in rules), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--budgets", default="16384,32768")
    ap.add_argument("--lengths", default="4,8,16,32", help="trajectory lengths, in budgets")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--rules", default="", help="other budget counts to simulate the rule at, comma-separated")
    ap.add_argument("--families", default="", help="long families of harts.tree.shapes instead of the shapes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, hw = get_model_config(args.model), load_hardware(args.hardware)
    default = KernelConfig().chain_stash_device_budgets
    rules = {"default": None, "off": 1e12, "all": 0.0}
    rules.update({f"{float(b):g}": float(b) for b in args.rules.split(",") if b})
    rows = families(args, model, hw, rules) if args.families else shapes_rows(args, model, hw, rules, default)
    if args.json:
        write_result(args.json, annotation="simulated peaks of long trajectories' window plans with the outer "
                     "stashes' rule at its default, off, moving every outer stash, and at --rules "
                     "(benchmarks/sim_chain_memory.py)",
                     hardware=args.hardware, model=args.model, default_device_budgets=default, rows=rows)
    return 0


def families(args, model, hw, rules: dict) -> list[dict]:
    from harts.sim.executor import plan_floors
    from harts.tree import shapes

    rows = []
    print("peak / expanded step of the same forest at the budget; step time / rule off")
    for fam in args.families.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                forest = build_forest(shapes.draw(fam, seed, budget, vocab_size=model.vocab_size))
                config = PlanConfig(microbatch_tokens=budget, chunk_size=model.chunk_size,
                                    **plan_floors(model, hw, budget))
                expanded = simulated(make_plan(forest, "expanded-ffd", config), forest, model, hw, None)
                plan = make_plan(forest, "l1l2", config)
                r = {"instance": f"{fam}/{seed}@{budget}", "family": fam, "budget": budget, "seed": seed,
                     "rows": int(forest.compact_tokens), "microbatches": plan.num_microbatches,
                     "expanded_peak_bytes": expanded["peak_bytes"]}
                under_rules(f"{r['instance']:22s}", r, plan, forest, model, hw, rules, "peak_over_expanded",
                            expanded["peak_bytes"])
                rows.append(r)
    print("\nper family and budget: mean (max) peak / expanded, and max step / rule off, per rule")
    for fam in args.families.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            sel = [r for r in rows if r["family"] == fam and r["budget"] == budget]
            print(f"{fam + '@' + str(budget):18s} " + "  ".join(
                f"{n} {sum(r[n]['peak_over_expanded'] for r in sel) / len(sel):.3f} "
                f"({max(r[n]['peak_over_expanded'] for r in sel):.3f}; {max(r[n]['step_over_off'] for r in sel):.3f})"
                for n in rules))
    return rows


def shapes_rows(args, model, hw, rules: dict, default: float) -> list[dict]:
    rows = []
    print(f"peak / ordinary step at the budget; step time / rule off (rule: outer stashes on the device up to "
          f"{default:g} budgets)")
    for budget in (int(b) for b in args.budgets.split(",")):
        ordinary = [_traj(f"o{i}", np.random.default_rng(i).integers(1, model.vocab_size, budget - 768))
                    for i in range(4)]
        f = build_forest(ordinary)
        base = simulated(make_plan(f, "expanded-ffd", PlanConfig(microbatch_tokens=budget, chunk_size=model.chunk_size)),
                         f, model, hw, None)
        for shape in args.shapes.split(","):
            for k in (int(x) for x in args.lengths.split(",")):
                for seed in (int(s) for s in args.seeds.split(",")):
                    forest = build_forest(trajectories(shape, k * budget, budget, seed, model.vocab_size))
                    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=model.chunk_size))
                    r = {"shape": shape, "budget": budget, "budgets_long": k, "seed": seed,
                         "rows": int(forest.compact_tokens), "microbatches": plan.num_microbatches,
                         "ordinary_peak_bytes": base["peak_bytes"]}
                    under_rules(f"{shape:6s} {k:2d} x {budget:5d}", r, plan, forest, model, hw, rules,
                                "peak_over_ordinary", base["peak_bytes"])
                    rows.append(r)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
