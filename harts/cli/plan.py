"""`harts plan ...`: plan a training step into microbatches on data-parallel replicas.

    harts plan compare --workload swe-treestep-64 --dp 8 [--json]
    harts plan make --planner l1l2 --workload swe-treestep-64 --dp 8 --out plan.json
    harts plan --planner l1l2 --workload swe-treestep-64 --dp 8 --out plan.json   # same
    harts plan validate --plan plan.json --workload swe-treestep-64 [--json]
    harts plan planners

The step comes from a workload preset (structure only, no token ids) or a rollout JSONL
file (--input). Balances print as percentages in the table and as fractions in JSON.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harts.cli.common import (
    UserError,
    check_output_path,
    format_table,
    print_json,
    say_wrote,
    write_output,
)


def register(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser(
        "plan",
        help="plan a step: microbatches, sharing windows, replicas and slots",
        description="Plan a training step. Without an action, `harts plan --planner NAME "
        "... --out FILE` makes one plan (like `harts plan make`).",
        # no prefix matching: `validate --plan` must not be read as `--planner`
        allow_abbrev=False,
    )
    _add_make_args(pl, required=False)
    pl.set_defaults(func=cmd_make, plan_command=None)
    pl_sub = pl.add_subparsers(dest="plan_command", metavar="ACTION")

    cmp_ = pl_sub.add_parser("compare", help="run every planner on the same step, metrics side by side")
    _add_step_args(cmp_)
    cmp_.add_argument("--planners", default=None, metavar="A,B",
                      help="comma-separated planners to run (default: all)")
    cmp_.add_argument("--json", action="store_true", help="machine-readable output")
    cmp_.set_defaults(func=cmd_compare)

    mk = pl_sub.add_parser("make", help="make one plan and save it as JSON")
    _add_make_args(mk, required=True)
    mk.set_defaults(func=cmd_make)

    va = pl_sub.add_parser("validate", help="check a saved plan against its step; print its metrics")
    va.add_argument("--plan", required=True, help="plan JSON written by `harts plan make`")
    _add_step_args(va, planning=False)
    va.add_argument("--json", action="store_true", help="machine-readable output")
    va.set_defaults(func=cmd_validate)

    ls = pl_sub.add_parser("planners", help="list the registered planners")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_planners)


def _add_step_args(p: argparse.ArgumentParser, planning: bool = True) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="PRESET", help="workload preset (see `harts workload presets`)")
    src.add_argument("--input", metavar="JSONL", help="rollout JSONL file")
    p.add_argument("--seed", type=int, default=None, help="workload seed (with --workload; default: the preset's own)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a workload parameter (with --workload); repeatable")
    if not planning:
        return
    # defaults live in harts.plan.plan (resolved in the handler: registering stays cheap)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel group size over the replicas (divides --dp; default 1): where the "
                        "planners compare finished plans, a group's replicas are priced in lockstep")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages the plan is for (default 1; > 1 asks for at least "
                        "--microbatches-per-stage x pp microbatches per replica)")
    p.add_argument("--microbatches-per-stage", type=int, default=None,
                   help="with --pp > 1: microbatches per stage and replica (default 2)")
    p.add_argument("--microbatch-tokens", type=int, default=None,
                   help="activation budget per microbatch in tokens (default: the preset's own, "
                        "131072 or 32768 for the Flash-sized presets; 131072 for --input)")
    p.add_argument("--producer-retention", type=float, default=None,
                   help="memory a retained producer row costs relative to a computed row "
                        "(default 0.35: full activation recomputation)")
    p.add_argument("--chain-retention", type=_retention_or_off, default=None, metavar="R|off",
                   help="a chain piece (a trajectory longer than the budget, cut inside a node) pays the smaller "
                        "of its producer's charge and R x its context rows; off: the producer charge alone "
                        "(default: PlanConfig's)")
    p.add_argument("--time-limit", type=float, default=2.0,
                   help="ortools-ffd search limit (CP-SAT deterministic time, ~seconds; default 2)")
    p.add_argument("--plan-seed", type=int, default=0, help="seed of search-based planners (default 0)")
    p.add_argument("--search-evaluations", type=int, default=0, metavar="N",
                   help="l1l2: re-form windows by a seeded search of N evaluations (default 0: off)")
    p.add_argument("--window-floors", metavar="MODEL,PROFILE",
                   help="l1l2 (pp 1): price each microbatch at least at its host-bound floor for MODEL on the "
                        "hardware PROFILE (h100, h200 or a profile JSON; harts.sim.executor.window_floors at "
                        "the budget), so windows are chosen only where they pay (default: rows alone)")


def _add_make_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--planner", required=required, metavar="NAME",
                   help="planner name (see `harts plan planners`)")
    _add_step_args(p)
    p.add_argument("--out", required=required, metavar="FILE", help="where to write the plan JSON (its folder must exist)")
    p.add_argument("--json", action="store_true", help="print the plan's metrics as JSON")


def _window_floors(spec: str, tokens: int) -> dict[str, float]:
    """PlanConfig's floors from `--window-floors MODEL,PROFILE`."""
    from harts.config.models import get_model_config
    from harts.sim.executor import plan_floors

    model, sep, profile = spec.partition(",")
    if not sep or not model or not profile:
        raise UserError(f"--window-floors: give MODEL,PROFILE (e.g. tiny-h200,h100), got {spec!r}")
    try:
        return plan_floors(get_model_config(model.strip()), profile.strip(), tokens)
    except (KeyError, ValueError) as err:
        raise UserError(f"--window-floors: {err}") from None


def _forest(args: argparse.Namespace):
    from harts.cli.data import load_forest

    if not args.workload and not args.input:
        raise UserError("give the step: --workload PRESET or --input JSONL")
    return load_forest(args)


def _retention_or_off(text: str):
    if text.lower() == "off":
        return "off"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {text!r}") from None


def _config(args: argparse.Namespace):
    from harts.config.plan import DEFAULT_MICROBATCH_TOKENS, DEFAULT_PRODUCER_RETENTION, PlanConfig

    tokens = args.microbatch_tokens
    if tokens is None:  # the preset's own budget, else the planners' default
        tokens = DEFAULT_MICROBATCH_TOKENS
        if getattr(args, "workload", None) and not getattr(args, "input", None):
            from harts.cli.data import workload_config

            tokens = workload_config(args.workload, args.seed, args.set).microbatch_tokens
    retention = DEFAULT_PRODUCER_RETENTION if args.producer_retention is None else args.producer_retention
    extra = {} if args.microbatches_per_stage is None else {"min_microbatches_per_stage": args.microbatches_per_stage}
    if getattr(args, "chain_retention", None) is not None:
        extra["chain_retention"] = None if args.chain_retention == "off" else args.chain_retention
    if getattr(args, "window_floors", None):
        extra.update(_window_floors(args.window_floors, tokens))
    try:  # PlanConfig checks its fields when built
        return PlanConfig(
            dp=args.dp,
            ep=args.ep,
            pp=args.pp,
            **extra,
            microbatch_tokens=tokens,
            producer_retention=retention,
            seed=args.plan_seed,
            time_limit=args.time_limit,
            search_evaluations=args.search_evaluations,
        )
    except ValueError as err:
        raise UserError(str(err)) from None


def _run(forest, name: str, cfg):
    from harts.plan.planners import make_plan

    try:
        return make_plan(forest, name, cfg)
    except ValueError as err:
        raise UserError(str(err)) from None


def _result(metrics) -> dict[str, Any]:
    m = metrics.to_dict()
    keys = ("planner", "compression", "slot_balance", "balance_p5", "step_balance", "slots",
            "plan_seconds", "mode", "microbatches", "executed_tokens", "expanded_tokens",
            "max_memory_tokens")
    return {k: m[k] for k in keys}


def _table(results: list[dict[str, Any]]) -> str:
    rows = [
        (r["planner"], r["mode"], f"{r['compression']:.3f}x", f"{100 * r['slot_balance']:.2f}%",
         f"{100 * r['balance_p5']:.2f}%", f"{100 * r['step_balance']:.2f}%", r["slots"],
         r["microbatches"], round(r["plan_seconds"], 3))
        for r in results
    ]
    return format_table(
        ["planner", "mode", "compression", "slot balance", "balance P5", "step balance", "slots",
         "microbatches", "seconds"],
        rows,
    )


def cmd_compare(args: argparse.Namespace) -> int:
    from harts.plan.metrics import compute_metrics
    from harts.plan.planners import known_planners

    names = known_planners() if not args.planners else [n.strip() for n in args.planners.split(",")]
    for n in names:
        if n not in known_planners():
            raise UserError(f"unknown planner {n!r}; known planners: {', '.join(known_planners())}")
    forest = _forest(args)
    cfg = _config(args)
    results = []
    for n in names:
        if not args.json and sys.stderr.isatty():
            sys.stderr.write(f"planning with {n} ...\r")
        results.append(_result(compute_metrics(_run(forest, n, cfg), forest)))
    if args.json:
        print_json({"results": results})
    else:
        print(_table(results))
    return 0


def cmd_make(args: argparse.Namespace) -> int:
    from harts.plan.metrics import compute_metrics

    if args.plan_command is None and (not args.planner or not args.out):
        raise UserError("`harts plan` needs --planner NAME and --out FILE (or an action: "
                        "compare, make, validate, planners)")
    check_output_path(args.out, "--out")
    forest = _forest(args)
    plan = _run(forest, args.planner, _config(args))
    write_output(args.out, "--out", plan.to_json())
    result = _result(compute_metrics(plan, forest))
    # trees run as window trees: a trajectory over the budget, or (l1l2) a tree no one
    # window holds, nested
    # (dp > 1) a tree over a replica's share, split into trajectory groups over replicas,
    # each group a window tree of its own (harts.plan.planners.tree_split)
    windows, nested = int(plan.info.get("chains", 0)), int(plan.info.get("nested_trees", 0))
    heavy, split = int(plan.info.get("heavy_trees", 0)), [int(k) for k in plan.info.get("split_trees", [])]
    trees = windows - sum(split) + len(split)
    filled = int(plan.info.get("filled_leaves", 0))  # short trees moved into window-tree leaves
    sunk = int(plan.info.get("sunk_leaves", 0))  # microbatches fewer by leaves sunk into later ones
    if args.json:
        print_json({**result, "window_trees": windows, "nested_trees": nested, "filled_leaves": filled,
                    "sunk_leaves": sunk, "split_trees": split, "out": args.out})
    else:
        print(_table([result]))
    detail = f"{plan.num_microbatches} microbatches"
    if trees:
        why = [f"{n} {what}" for n, what in ((trees - nested - heavy, "with a trajectory over the budget"),
                                             (nested, "that no one window holds"),
                                             (heavy, "over a replica's share")) if n]
        detail += f"; nested windows for {trees} tree{'s' if trees > 1 else ''}: " + ", ".join(why)
        if split:
            detail += (f"; {len(split)} tree{'s' if len(split) > 1 else ''} split over replicas into "
                       f"{sum(split)} window trees")
        if filled:
            detail += f"; {filled} microbatch{'es' if filled > 1 else ''} of short trees joined window-tree leaves"
        if sunk:
            detail += f"; {sunk} microbatch{'es' if sunk > 1 else ''} fewer by fork branches sharing a later leaf"
    say_wrote(args.out, args.json, detail)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from harts.plan.metrics import compute_metrics
    from harts.plan.plan import Plan

    try:
        plan = Plan.load(args.plan)
    except OSError as err:
        raise UserError(f"{args.plan}: {err.strerror}") from None
    except ValueError as err:
        raise UserError(f"{args.plan}: {err}") from None
    forest = _forest(args)
    try:
        plan.validate(forest)
    except ValueError as err:
        raise UserError(f"{args.plan}: {err}") from None
    result = _result(compute_metrics(plan, forest))
    if args.json:
        print_json({"valid": True, **result})
    else:
        print(_table([result]))
        print(f"{args.plan}: valid", file=sys.stderr)
    return 0


def cmd_planners(args: argparse.Namespace) -> int:
    from harts.plan.planners import known_planners

    if args.json:
        print_json({"planners": list(known_planners())})
        return 0
    for n in known_planners():
        print(n)
    return 0
