"""`harts run`: the main job on embedded defaults, end to end.

workload -> rollout trees -> KDA call plan -> one tree training step verified against the
trajectory-expanded reference (float64). Each later stage (step planners, simulation)
joins this same command as it lands.
"""

from __future__ import annotations

import argparse
import time

from harts.cli.common import format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="the main job on embedded defaults (workload -> trees -> verified step)")
    p.add_argument("--workload", default="tiny-treestep", help="workload preset (default: tiny-treestep)")
    p.add_argument("--model", default="tiny-cpu", help="model config (default: tiny-cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=cmd_run)


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    from harts.cli.tree import workload_config
    from harts.cli.verify import check_vocab
    from harts.plan.kda_calls import plan_kda_calls_for
    from harts.tree import build_forest
    from harts.tree.workload import generate

    summary: dict = {"workload": args.workload, "seed": args.seed, "model": args.model}
    t0 = time.perf_counter()
    wl = generate(workload_config(args.workload, args.seed, []))
    trajs = wl.trajectories()
    check_vocab(trajs, args.model)
    forest = build_forest(trajs)
    summary["tree"] = forest.stats()
    summary["tree"]["build_seconds"] = time.perf_counter() - t0
    _say(args, f"== 1. workload {args.workload} (seed {args.seed}) -> rollout trees ==")
    _say(args, format_table(["statistic", "value"], [(k.replace("_", " "), v) for k, v in summary["tree"].items()]))

    from harts.config.models import get_model_config

    chunk = get_model_config(args.model).chunk_size
    kda = plan_kda_calls_for(forest, chunk)
    summary["kda_plan"] = {"chunk_size": chunk, "rounds": kda.num_rounds, "sequences": kda.num_sequences,
                           "replay_tokens": kda.replay_tokens}
    _say(args, f"\n== 2. minimum-call KDA plan (chunk {chunk}) ==")
    _say(args, f"{kda.num_rounds} packed call(s) for {kda.num_sequences} sequences, {kda.replay_tokens} replayed tokens")

    import torch

    from harts.verify.equivalence import verify_step

    _say(args, f"\n== 3. one tree training step on {args.model}, verified against the expanded reference ==")
    t1 = time.perf_counter()
    rep = verify_step(trajs, model=args.model, dtype=torch.float64, seed=args.seed)
    rep["seconds"] = time.perf_counter() - t1
    summary["verify"] = rep
    rows = [
        ("compact / expanded tokens", f"{rep['compact_tokens']} / {rep['expanded_tokens']}", ""),
        ("KDA rounds", rep["rounds"], rep["no_replay"]["rounds"]),
        ("max rel log-prob error", rep["max_rel_logprob_err"], rep["no_replay"]["max_rel_logprob_err"]),
        ("max rel gradient error", rep["max_rel_grad_err"], rep["no_replay"]["max_rel_grad_err"]),
        ("loss abs error", rep["loss_abs_err"]["loss"], rep["no_replay"]["loss_abs_err"]["loss"]),
    ]
    _say(args, format_table(["float64, tree vs expanded", "tree (replay)", "no replay"], rows))
    ok = rep["max_rel_logprob_err"] <= 1e-10 and rep["max_rel_grad_err"] <= 1e-10
    summary["equivalent"] = ok
    _say(args, "equivalent to expanded training within 1e-10: " + ("yes" if ok else "NO"))
    if args.json:
        print_json(summary)
    return 0 if ok else 1
