"""`harts rl run`: the online RL loop on a toy environment (sample, allocate, score, train)."""

from __future__ import annotations

import argparse
import sys

from harts.cli.common import UserError, format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rl", help="online RL: rollout trees from the policy, trained on as trees")
    rl_sub = p.add_subparsers(dest="rl_command", metavar="COMMAND", required=True)
    r = rl_sub.add_parser("run", help="run the loop sample -> allocate -> score -> plan -> train for N steps")
    r.add_argument("--env", default="switchboard", metavar="NAME", help="toy environment (default switchboard)")
    r.add_argument("--steps", type=int, default=30, help="update steps (default 30)")
    r.add_argument("--mode", choices=["tree", "expanded"], default="tree",
                   help="tree: each prompt's rollouts trained as one rollout tree; expanded: the baseline")
    r.add_argument("--advantage", choices=["grpo", "rtmc"], default="grpo",
                   help="grpo: group-normalised episode advantage; rtmc: per-step Monte Carlo advantages")
    r.add_argument("--allocation", choices=["uniform", "trace"], default="uniform",
                   help="how continuations from intermediate turn boundaries are spread over prefixes")
    r.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    r.add_argument("--seed", type=int, default=0, help="model init, prompts and sampling seed")
    r.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    r.add_argument("--roots", type=int, default=4, help="root episodes per prompt (default 4)")
    r.add_argument("--expansions", type=int, default=4,
                   help="continuations per prompt from intermediate prefixes (default 4)")
    r.add_argument("--lr", type=float, default=3e-3)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--lockstep", action="store_true",
                   help="each step also run the other mode's update from the same weights and optimizer state "
                        "on the same batch, and report how far the two updates differ (the run keeps its own)")
    r.add_argument("--tracking-uri", default=None,
                   help="mlflow tracking URI (default: $MLFLOW_TRACKING_URI, else ./harts-runs/mlflow.db)")
    r.add_argument("--no-track", action="store_true", help="do not log the run to mlflow")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=cmd_rl_run)

    c = rl_sub.add_parser("compare", help="allocations on the same policy: the share of prompts with mixed rewards "
                                           "each leaves, sampled from the same weights every step")
    c.add_argument("--env", default="switchboard-outcome", metavar="NAME",
                   help="toy environment (default switchboard-outcome)")
    c.add_argument("--steps", type=int, default=8, help="steps per seed (default 8)")
    c.add_argument("--seeds", type=int, default=4, help="seeds 0 .. N-1 (default 4)")
    c.add_argument("--train-on", choices=["uniform", "trace"], default="uniform",
                   help="whose rollouts the policy is updated on (default uniform)")
    c.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    c.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    c.add_argument("--roots", type=int, default=4, help="root episodes per prompt (default 4)")
    c.add_argument("--expansions", type=int, default=4, help="continuations per prompt (default 4)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(func=cmd_rl_compare)


def cmd_rl_run(args: argparse.Namespace) -> int:
    from harts.rl.env import EnvError
    from harts.rl.loop import LoopError, RLConfig, reward_change, run
    from harts.rl.sample import SamplingError

    try:
        config = RLConfig(env=args.env, steps=args.steps, mode=args.mode, advantage=args.advantage,
                          allocation=args.allocation, dtype=args.dtype, seed=args.seed, prompts=args.prompts,
                          roots=args.roots, expansions=args.expansions, lr=args.lr,
                          temperature=args.temperature, top_p=args.top_p, lockstep=args.lockstep).validate()
    except (LoopError, EnvError) as err:
        raise UserError(str(err)) from None

    def show(rec) -> None:
        print(f"[rl] step {rec.step}/{config.steps}  reward {rec.reward_mean:.3f}  loss {rec.loss:+.4f}  "
              f"gap {rec.logprob_gap:.1e}  compression {rec.compression:.2f}x  mixed {rec.mixed_share:.2f}  "
              f"{rec.sample_seconds + rec.train_seconds:.1f} s"
              + (f"  {rec.lockstep['mode']} update differs by {rec.lockstep['update_rel_l2_diff']:.1e}"
                 if rec.lockstep else ""), file=sys.stderr, flush=True)

    try:
        result = run(config, on_step=show)
    except (LoopError, SamplingError, EnvError) as err:
        raise UserError(str(err)) from None
    run_id = None
    if not args.no_track:
        from harts.rl.loop import log_run

        run_id = log_run(result, args.tracking_uri)
    steps = [s.to_dict() for s in result.steps]
    if args.json:
        print_json({"env": config.env, "model": result.model, "mode": config.mode, "advantage": config.advantage,
                    "allocation": config.allocation, "dtype": config.dtype, "seed": config.seed,
                    "lockstep": config.lockstep,
                    "random_reward": result.random_reward, "reward_change": reward_change(result.steps),
                    "seconds": result.seconds, "run_id": run_id, "steps": steps})
    else:
        print(format_table(["step", "reward", "loss", "logprob_gap", "compression", "mixed", "rollouts"],
                           [(s["step"], s["reward_mean"], s["loss"], s["logprob_gap"], s["compression"],
                             s["mixed_share"], s["rollouts"]) for s in steps]))
        if config.lockstep:
            worst = max(result.steps, key=lambda s: s.lockstep["update_rel_l2_diff"])
            print(f"lockstep: the {worst.lockstep['mode']} update from the same state differs from this run's by "
                  f"at most {worst.lockstep['update_rel_l2_diff']:.1e} of its L2 norm (step {worst.step}; gradients "
                  f"by {max(s.lockstep['grad_max_rel_diff'] for s in result.steps):.1e} of the largest)")
        print(f"reward: first-5 -> last-5 mean {reward_change(result.steps):+.3f} "
              f"(random policy {result.random_reward:.3f}); {result.seconds:.0f} s"
              + (f"; logged as run {run_id}" if run_id else ""))
    return 0


def cmd_rl_compare(args: argparse.Namespace) -> int:
    from harts.rl.env import EnvError
    from harts.rl.loop import ALLOCATIONS, LoopError, RLConfig, compare_allocations
    from harts.rl.sample import SamplingError

    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    rows, totals = [], dict.fromkeys(ALLOCATIONS, 0)
    try:
        for seed in range(args.seeds):
            config = RLConfig(env=args.env, steps=args.steps, dtype=args.dtype, seed=seed, prompts=args.prompts,
                              roots=args.roots, expansions=args.expansions).validate()
            got = compare_allocations(config, ALLOCATIONS, train_on=args.train_on)
            mixed = {name: round(sum(v) * config.prompts) for name, v in got.shares.items()}
            for name, k in mixed.items():
                totals[name] += k
            rows.append({"seed": seed, "mixed_prompts": mixed, "shares": got.shares})
            print(f"[rl compare] seed {seed}: " + ", ".join(f"{n} {k}" for n, k in mixed.items())
                  + f" of {config.steps * config.prompts} prompts mixed", file=sys.stderr, flush=True)
    except (LoopError, SamplingError, EnvError) as err:
        raise UserError(str(err)) from None
    prompts = args.seeds * args.steps * args.prompts
    if args.json:
        print_json({"env": args.env, "steps": args.steps, "seeds": args.seeds, "train_on": args.train_on,
                    "dtype": args.dtype, "budget_per_step": args.prompts * (args.roots + args.expansions),
                    "prompts": prompts, "mixed_prompts": totals,
                    "mixed_share": {n: k / prompts for n, k in totals.items()}, "per_seed": rows})
    else:
        print(format_table(["seed", *ALLOCATIONS], [(r["seed"], *(r["mixed_prompts"][n] for n in ALLOCATIONS))
                                                   for r in rows]))
        print("mixed prompts of " + f"{prompts}: " + ", ".join(f"{n} {k} ({k / prompts:.3f})" for n, k in totals.items())
              + f"; every allocation sampled from the same weights each step, trained on {args.train_on}'s rollouts")
    return 0
