"""`harts verify`: tree vs expanded on the same inputs, with the no-replay ablation."""

from __future__ import annotations

import argparse

from harts.cli.common import UserError, format_table, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a tree step against the trajectory-expanded reference")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input", metavar="FILE.jsonl", help="rollout JSONL file")
    src.add_argument("--workload", metavar="PRESET", help="generated workload preset (default tiny-treestep)")
    p.add_argument("--model", default="tiny-cpu", help="model config (CPU-sized)")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--seed", type=int, default=0, help="model init (and workload) seed")
    p.add_argument("--microbatch-tokens", type=int, default=1 << 20,
                   help="token budget per microbatch")
    p.add_argument("--planner", default=None, metavar="NAME",
                   help="execute this step planner's plan (trees split across microbatches, sharing "
                   "windows); default: whole trees per microbatch")
    p.add_argument("--old-logprobs", choices=["recompute", "input"], default="recompute",
                   help="recompute: on-policy ratios of 1 (every target carries gradient)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)


def load_trajectories(args: argparse.Namespace, default: str = "tiny-treestep") -> list:
    if args.input:
        from harts.tree.io import RolloutFormatError, load_jsonl

        try:
            return load_jsonl(args.input)
        except RolloutFormatError as err:
            raise UserError(str(err)) from None
    from harts.tree.workload import generate_trajectories

    try:
        return generate_trajectories(args.workload or default, seed=args.seed)
    except (KeyError, ValueError) as err:
        raise UserError(str(err).strip("'\"")) from None


def check_vocab(trajectories: list, model: str) -> None:
    from harts.config.models import ConfigError, get_model_config

    try:
        cfg = get_model_config(model)
    except ConfigError as err:
        raise UserError(str(err)) from None
    for t in trajectories:
        top = int(t.tokens.max())
        if top >= cfg.vocab_size:
            raise UserError(f"trajectory {t.id!r}: token id {top} is outside the vocabulary of "
                            f"{cfg.name} (size {cfg.vocab_size})")


def cmd_verify(args: argparse.Namespace) -> int:
    trajectories = load_trajectories(args)
    check_vocab(trajectories, args.model)
    if args.microbatch_tokens < 1:
        raise UserError("--microbatch-tokens must be >= 1")
    import torch

    from harts.verify.equivalence import verify_step

    dtype = {"float64": torch.float64, "float32": torch.float32}[args.dtype]
    if args.planner is not None:
        from harts.plan.planners import known_planners

        if args.planner not in known_planners():
            raise UserError(f"unknown planner {args.planner!r}; known: {', '.join(known_planners())}")
    try:
        report = verify_step(trajectories, model=args.model, dtype=dtype, seed=args.seed,
                             microbatch_tokens=args.microbatch_tokens, planner=args.planner,
                             recompute_old_logprobs=args.old_logprobs == "recompute")
    except ValueError as err:
        # planners refuse budgets that a trajectory does not fit, with advice
        raise UserError(str(err)) from None
    if args.json:
        print_json(report)
        return 0
    print(f"{report['num_trajectories']} trajectories, {report['num_targets']} targets, "
          f"{report['expanded_tokens']} expanded -> {report['compact_tokens']} compact tokens, "
          f"{report['microbatches']} microbatch(es), {report['sharing_windows']} sharing window(s), "
          f"{report['dtype']}" + (f", planner {report['planner']}" if report["planner"] else ""))
    nr = report["no_replay"]
    rows = [
        ("KDA rounds (most in a microbatch)", report["rounds"], nr["rounds"]),
        ("replay tokens", report["replay_tokens"], nr["replay_tokens"]),
    ]
    for key in ("max_rel_logprob_err", "rms_rel_logprob_err", "max_rel_entropy_err", "max_rel_grad_err",
                "rms_rel_grad_err", "max_rel_expert_load_err"):
        rows.append((key.replace("_", " "), report[key], nr[key]))
    rows.append(("loss abs err", report["loss_abs_err"]["loss"], nr["loss_abs_err"]["loss"]))
    kda = report["kda_layer"]
    if kda:
        rows.append(("KDA layer bit-identical", str(kda["replay"]["bit_identical"]), str(kda["node"]["bit_identical"])))
        rows.append(("KDA layer max abs err", kda["replay"]["max_abs_err"], kda["node"]["max_abs_err"]))
    print(format_table(["vs expanded", "tree (replay)", "no replay"], rows))
    return 0
