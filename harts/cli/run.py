"""`harts run`: the main job on embedded defaults, end to end.

workload -> rollout trees -> minimum-call KDA plan -> step plan (l1l2, trees split into
sharing windows) -> that plan executed for one training step and verified against the
trajectory-expanded reference (float64) -> the planners and a pipeline schedule simulated
on a SWE-shaped 8-GPU step -> everything logged to the embedded mlflow store.
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
    p.add_argument("--planner", default="l1l2", help="step planner to execute (default: l1l2)")
    p.add_argument("--sim-workload", default="swe-treestep-8", help="preset for the simulation stage")
    p.add_argument("--tracking-uri", default=None, help="mlflow store (default: ./harts-runs)")
    p.add_argument("--no-log", action="store_true", help="do not log the run to mlflow")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=cmd_run)


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    from harts.cli.data import check_vocab, workload_config
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

    # a budget every trajectory fits but whole trees do not: the planner must split trees
    budget = max(int(forest.traj_length.max()) + 8, forest.compact_tokens // 3)
    _say(args, f"\n== 3. step plan ({args.planner}, {budget}-token microbatches) executed for one training "
               f"step on {args.model}, verified against the expanded reference ==")
    t1 = time.perf_counter()
    rep = verify_step(trajs, model=args.model, dtype=torch.float64, seed=args.seed,
                      planner=args.planner, microbatch_tokens=budget)
    rep["seconds"] = time.perf_counter() - t1
    summary["verify"] = rep
    one = rep.get("vs_single_microbatch", {})
    rows = [
        ("microbatches / sharing windows", f"{rep['microbatches']} / {rep['sharing_windows']}", ""),
        ("compact / expanded tokens", f"{rep['compact_tokens']} / {rep['expanded_tokens']}", ""),
        ("KDA rounds (most in a microbatch)", rep["rounds"], rep["no_replay"]["rounds"]),
        ("max rel log-prob error", rep["max_rel_logprob_err"], rep["no_replay"]["max_rel_logprob_err"]),
        ("max rel gradient error", rep["max_rel_grad_err"], rep["no_replay"]["max_rel_grad_err"]),
        ("loss abs error", rep["loss_abs_err"]["loss"], rep["no_replay"]["loss_abs_err"]["loss"]),
        ("max rel gradient error vs one microbatch", one.get("max_rel_grad_err", float("nan")), ""),
    ]
    _say(args, format_table(["float64, vs expanded", f"tree ({args.planner})", "no replay"], rows))
    ok = (rep["max_rel_logprob_err"] <= 1e-10 and rep["max_rel_grad_err"] <= 1e-10
          and one.get("max_rel_grad_err", 0.0) <= 1e-10)
    summary["equivalent"] = ok
    _say(args, "equivalent to expanded training within 1e-10: " + ("yes" if ok else "NO"))

    summary["simulation"] = _simulate(args)
    sim = summary["simulation"]
    _say(args, f"\n== 4. simulated update step: {args.sim_workload}, Tiny, 8 H200s "
               f"(DP{sim['dp']} x PP{sim['pp']}), {sim['schedule']} ==")
    _say(args, format_table(
        ["planner", "compression", "step s", "k tok/s", "bubble", "speedup"],
        [(r["planner"], r["compression"], r["step_seconds"], r["throughput"] / 1e3, r["bubble_fraction"],
          r["throughput"] / sim["runs"][0]["throughput"]) for r in sim["runs"]]))

    if not args.no_log:
        from harts.track import log_main_run

        hint = log_main_run(summary, args.tracking_uri)
        summary["tracking"] = hint
        _say(args, f"\nlogged to mlflow; to browse: {hint}")
    if args.json:
        print_json(summary)
    return 0 if ok else 1


def _simulate(args: argparse.Namespace) -> dict:
    from harts.config.models import get_model_config
    from harts.config.parallel import ParallelConfig
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.plan.schedule import build_schedule
    from harts.plan.step import step_from_plan
    from harts.sim.costs import make_cost_model
    from harts.sim.hardware import load_hardware
    from harts.sim.parallel import default_ep, default_parallel
    from harts.sim.simulate import simulate_step
    from harts.tree.workload import generate, preset

    model = get_model_config("tiny")
    base = default_parallel(model, 8)
    parallel = ParallelConfig(dp=base.dp, pp=base.pp, ep=default_ep(model, base.dp))
    cost = make_cost_model("roofline", model, parallel, load_hardware("h200"), recompute=True)
    forest = generate(preset(args.sim_workload)).forest()
    schedule = "consumer-1f1b"
    runs = []
    for planner in ("expanded-ffd", "ortools-ffd", "l1", args.planner):
        config = PlanConfig(dp=parallel.dp, pp=parallel.pp, seed=args.seed, time_limit=1.0)
        plan = make_plan(forest, planner, config)
        step = step_from_plan(plan, forest, model.chunk_size)
        res = simulate_step(step, build_schedule(schedule, step, parallel.pp), cost)
        runs.append({"planner": planner, "compression": plan.expanded_tokens / max(1, plan.executed_tokens),
                     "step_seconds": res.step_seconds, "throughput": res.throughput,
                     "bubble_fraction": res.bubble_fraction, "peak_memory_bytes": res.peak_memory_bytes})
    return {"workload": args.sim_workload, "model": "tiny", "gpus": 8, "dp": parallel.dp, "pp": parallel.pp,
            "schedule": schedule, "runs": runs}
