"""`harts sim rollout ...`: simulate a step's rollout phase (agentic trajectories with tool
calls on inference workers) under a scheduling policy, optionally followed by its
training phase.

    harts sim rollout --policy heddle --workload agentic-longtail --gpus 32 --json
    harts sim rollout --compare --workload agentic-longtail --gpus 32 --gantt rollout.png
    harts sim rollout --policy cache-aware --end-to-end
    harts sim rollout --compare --workload agentic-reasoning --model qwen3-32b --baseline-mp 8
    harts sim rollout --compare --workload agentic-reasoning-dense --reference   # + known-lengths row

`add_rollout_parser(sim_subparsers)` adds the `rollout` action to `harts sim`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harts.cli.common import (
    UserError,
    atomic_output,
    check_output_path,
    format_table,
    print_json,
    say_wrote,
)


def add_rollout_parser(sim_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from harts.config.rollout import RolloutPreset
    from harts.sim.rollout.policies import RolloutPolicyName

    p = sim_subparsers.add_parser("rollout", help="simulate a step's rollout phase under a scheduling policy "
                                  "(step-centric baselines, Heddle and its ablations)")
    p.add_argument("--policy", default="heddle", help=f"rollout policy ({', '.join(n.value for n in RolloutPolicyName)})")
    p.add_argument("--workload", default="agentic-longtail",
                   help=f"rollout workload preset ({', '.join(n.value for n in RolloutPreset)})")
    p.add_argument("--gpus", type=int, default=32, help="GPUs of the inference cluster")
    p.add_argument("--seed", type=int, help="workload seed (default: the preset's)")
    p.add_argument("--model", help="served model: a harts model name or a dense one "
                   "(qwen3-32b, qwen3-8b); default: the preset's")
    p.add_argument("--baseline-mp", type=int, help="the baselines' fixed model-parallel degree "
                   "(default: the preset's)")
    p.add_argument("--compare", action="store_true", help="every policy on the same trajectories")
    p.add_argument("--end-to-end", action="store_true",
                   help="also simulate the step's training phase (harts sim) and show where the time goes")
    p.add_argument("--gantt", help="write a Gantt chart (PNG); with --compare one per policy, "
                   "named <stem>-<policy>.png")
    p.add_argument("--reference", action="store_true",
                   help="also the known-lengths reference schedule (an ORACLE that reads the true lengths, "
                   "searched over tail-pool layouts; not a policy)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_rollout)
    return p


def _config(args: argparse.Namespace) -> Any:
    from harts.config.rollout import rollout_preset

    if args.gpus < 1:
        raise UserError("--gpus must be >= 1")
    try:
        cfg = rollout_preset(args.workload)
    except KeyError as err:
        raise UserError(str(err.args[0])) from None
    import dataclasses

    from harts.config.models import known_models
    from harts.sim.rollout.cost import DENSE_SERVED_MODELS

    changes: dict[str, Any] = {}
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.model is not None:
        known = [*known_models(), *DENSE_SERVED_MODELS]
        if args.model not in known:
            raise UserError(f"unknown --model {args.model!r}; known: {', '.join(known)}")
        changes["model"] = args.model
        if args.model in DENSE_SERVED_MODELS and 1 not in cfg.mp_degrees:
            changes["mp_degrees"] = (1, *cfg.mp_degrees)  # a dense model fits one GPU
    if args.baseline_mp is not None:
        changes["baseline_mp"] = args.baseline_mp
    try:
        return dataclasses.replace(cfg, **changes) if changes else cfg
    except ValueError as err:
        raise UserError(str(err)) from None


def _gantt_path(args: argparse.Namespace, policy: str, many: bool) -> Path:
    p = check_output_path(args.gantt, "--gantt")
    return p.with_name(f"{p.stem}-{policy}{p.suffix or '.png'}") if many else p


def cmd_rollout(args: argparse.Namespace) -> int:
    from harts.sim.rollout import (
        generate_trajectories,
        get_policy,
        known_policies,
        simulate_rollout,
    )

    cfg = _config(args)
    names = known_policies() if args.compare else [args.policy]
    try:
        for n in names:
            get_policy(n)
    except KeyError as err:
        raise UserError(str(err.args[0])) from None
    if args.gantt:
        for n in names:
            _gantt_path(args, n, args.compare)
    specs = generate_trajectories(cfg)
    from harts.sim.rollout.compare import makespan_bounds
    from harts.sim.rollout.cost import make_rollout_cost

    bounds = makespan_bounds(cfg, specs, make_rollout_cost(cfg), args.gpus)
    rows = []
    for n in names:
        try:
            if args.end_to_end:
                from harts.sim.rollout.end_to_end import simulate_step_end_to_end

                b = simulate_step_end_to_end(cfg, n, args.gpus, specs=specs)
                res, row = b.rollout, {**res_json(b.rollout), **b.to_json()}
            else:
                res = simulate_rollout(cfg, n, args.gpus, specs=specs)
                row = res_json(res)
        except ValueError as err:
            raise UserError(str(err)) from None
        if args.gantt:
            from harts.sim.rollout.gantt import plot_rollout_gantt

            target = _gantt_path(args, n, args.compare)
            with atomic_output(target, "--gantt") as tmp:
                plot_rollout_gantt(res, tmp)
            row["gantt"] = str(target)
            say_wrote(target, args.json)
        rows.append(row | {"makespan_bounds_s": bounds})
    if args.reference:
        from harts.sim.rollout.compare import known_lengths_schedule

        ref, info = known_lengths_schedule(cfg, specs, make_rollout_cost(cfg), args.gpus)
        rows.append(res_json(ref) | {"policy": "known-lengths (ORACLE)", "reference_schedule": info,
                                     "makespan_bounds_s": bounds})
    best = max((r["throughput_tokens_per_s"] for r in rows if r["step_centric"]), default=0.0)
    for r in rows:
        r["speedup_vs_best_baseline"] = r["throughput_tokens_per_s"] / best if best > 0 else None
    if args.json:
        print_json(rows if args.compare or args.reference else rows[0])
        return 0
    print(f"rollout: {cfg.num_trajectories} trajectories ({args.workload}, seed {cfg.seed}), model {cfg.model}, "
          f"{args.gpus} x {cfg.hardware}")
    head = ["policy", "tok/s", "makespan s", "p50 finish s", "GPU util", "migrations", "recomputed tok", "MP layout"]
    if len(rows) > 1:
        head.insert(2, "vs best baseline")
    if args.end_to_end:
        head += ["training s", "step s", "rollout share"]
    cells = []
    for r in rows:
        c = [r["policy"], f"{r['throughput_tokens_per_s']:,.0f}", f"{r['makespan_s']:.1f}", f"{r['p50_finish_s']:.1f}",
             f"{r['gpu_utilization']:.1%}", str(r["migrations"]), f"{r['recomputed_tokens']:,}",
             _layout(r["worker_degrees"]) + (f" (+{r['merges']} merges)" if r.get("merges") else "")]
        if len(rows) > 1:
            sp = r["speedup_vs_best_baseline"]
            c.insert(2, "-" if sp is None else f"{sp:.2f}x")
        if args.end_to_end:
            c += [f"{r['training_s']:.1f}", f"{r['step_s']:.1f}", f"{r['rollout_fraction']:.0%}"]
        cells.append(c)
    print(format_table(head, cells))
    floor = max(bounds.values())
    base = min((r["makespan_s"] for r in rows if r["step_centric"]), default=0.0)
    print(f"\nno policy finishes before {floor:.1f} s on these trajectories (critical path {bounds['critical_path']:.1f}, "
          f"tail set {bounds['tail_set']:.1f}, work {bounds['work']:.1f} s)"
          + (f": at most {base / floor:.2f}x the best baseline" if len(rows) > 1 and base > 0 and floor > 0
             else ""))
    return 0


def res_json(res: Any) -> dict[str, Any]:
    from harts.sim.rollout import get_policy

    return {**res.to_json(), "step_centric": get_policy(res.policy).step_centric}


def _layout(degrees: list[int]) -> str:
    from collections import Counter

    return " + ".join(f"{n}xMP{d}" for d, n in sorted(Counter(degrees).items(), reverse=True))
