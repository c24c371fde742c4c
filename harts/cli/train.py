"""`harts train`: policy-update steps on rollouts, trajectory-expanded or over rollout trees."""

from __future__ import annotations

import argparse
import itertools

from harts.cli import train_checkpoint
from harts.cli.common import (
    Interrupted,
    UserError,
    caused_by_interrupt,
    print_json,
    rollout_error,
    say_wrote,
)
from harts.cli.model_source import add_model_args, model_config, train_model

# Refuse to build models this large on a CPU: the Table 1 configs are for GPUs (and the
# simulator), and allocating them here would only exhaust memory.
_CPU_MAX_PARAMS = 200_000_000


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run RL policy-update steps (PPO/GRPO loss) on rollouts")
    p.add_argument("--mode", choices=["expanded", "tree"], default="expanded",
                   help="expanded: the trajectory-by-trajectory baseline; tree: rollout-tree execution, the "
                   "same numbers with every shared token computed once (--parallel needs tree)")
    add_model_args(p, "tiny-cpu")
    p.add_argument("--save", metavar="DIR", default=None,
                   help="with --model-path: write the trained weights there as a Hugging Face checkpoint "
                   "(the source's config.json, tensor names and dtypes)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="PRESET", default=None,
                     help="generated workload preset (default tiny-treestep)")
    src.add_argument("--input", metavar="FILE.jsonl", default=None, help="rollout JSONL file")
    p.add_argument("--steps", type=int, default=3, help="update steps (default 3)")
    p.add_argument("--microbatch-tokens", type=int, default=4096, help="token budget per microbatch")
    p.add_argument("--aux-scope", choices=["microbatch", "global"], default="microbatch",
                   help="the MoE aux loss's routing statistics (ModelConfig.aux_scope): microbatch: each "
                   "microbatch's own, scaled by its token share (depends on the split: pipeline stages and "
                   "planners split differently); global: the step's, from one extra no-grad pass (the same "
                   "aux loss for any split)")
    p.add_argument("--planner", default=None, metavar="NAME",
                   help="tree mode: execute this step planner's plan (e.g. l1l2: trees larger than the "
                   "budget split into producer/consumer sharing windows); default: whole trees per microbatch, "
                   "with --parallel l1l2")
    p.add_argument("--seed", type=int, default=0, help="model init and workload seed")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (<= 0: off)")
    p.add_argument("--agg-mode", default="token-mean",
                   choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"],
                   help="how the policy loss averages over tokens and sequences")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the rollouts' ref log-probs")
    p.add_argument("--old-logprobs", choices=["recompute", "input"], default="recompute",
                   help="recompute: current policy's log-probs before the step (on-policy, "
                   "as verl's actor); input: the rollouts' old_logprobs (each step's data side is then "
                   "prepared one step ahead, in a background thread)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default=None,
                   help="default float32; with --model-path the checkpoint's")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--recompute", action="store_true", help="activation recomputation per layer")
    p.add_argument("--parallel", default=None, metavar="SPEC",
                   help="distributed: dp=N,pp=N,ep=N,tp=N (under torchrun --nproc-per-node N; needs --mode tree); "
                   "default: one process")
    p.add_argument("--plan", default=None, metavar="FILE.json", help="with --parallel: run this saved plan (default: plan with --planner)")
    p.add_argument("--schedule", default="consumer-1f1b", choices=["non-overlap", "overlap-bwd-first", "consumer-1f1b"],
                   help="with --parallel pp>1: the pipeline schedule (the simulator's, lowered to the pipelining runtime)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    train_checkpoint.add_flags(p)
    p.set_defaults(func=cmd_train)


def _load_trajectories(args: argparse.Namespace, vocab_size: int) -> list:
    if args.input is not None:
        from harts.tree.io import RolloutFormatError, load_jsonl

        try:
            return load_jsonl(args.input, vocab_size=vocab_size)
        except RolloutFormatError as err:
            raise rollout_error(err) from None
    from harts.tree.workload import generate_trajectories

    name = args.workload or "tiny-treestep"
    try:
        return generate_trajectories(name, seed=args.seed)
    except (KeyError, ValueError) as err:
        raise UserError(str(err).strip("'\"")) from None


def cmd_train(args: argparse.Namespace) -> int:
    if args.parallel is not None:
        from harts.cli.train_dist import cmd_train_distributed

        return cmd_train_distributed(args, _load_trajectories)
    if args.plan is not None:
        raise UserError("--plan needs --parallel")
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if args.microbatch_tokens < 1:
        raise UserError(f"--microbatch-tokens must be >= 1, got {args.microbatch_tokens}")
    train_checkpoint.check_flags(args)

    from harts.config.models import ConfigError
    from harts.config.param_counts import parameter_counts

    if args.save is not None:
        if not args.model_path:
            raise UserError("--save writes a Hugging Face checkpoint: it needs --model-path", field="--save")
        _check_save_dir(args.save)
    config = model_config(args)
    trajectories = _load_trajectories(args, config.vocab_size)
    if not trajectories:
        raise UserError("no trajectories to train on")
    from harts.cli.verify import check_vocab

    check_vocab(trajectories, config)  # generated workloads (a file is checked as it loads)
    if args.kl_coef > 0 and any(t.ref_logprobs is None for t in trajectories):
        raise UserError("--kl-coef > 0 needs ref_logprobs in every trajectory")

    import torch

    from harts.config.optimizer import OptimizerConfig
    from harts.exec.loss import PolicyLossConfig
    from harts.exec.trainer import ExpandedTrainer, run_steps
    from harts.exec.tree_trainer import TreeTrainer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    total = parameter_counts(config).total
    if torch.device(device).type == "cpu" and total > _CPU_MAX_PARAMS:
        raise UserError(f"{config.name} has {total / 1e9:.1f}B parameters: too large to train on a CPU")
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    model, loaded = train_model(args, config, dtype, device)
    if args.mode == "tree":
        try:
            config.check_tree_mode()
        except ConfigError as err:
            raise UserError(str(err)) from None
    trainer_cls = TreeTrainer if args.mode == "tree" else ExpandedTrainer
    extra: tuple = ()
    if args.planner is not None:
        if args.mode != "tree":
            raise UserError("--planner needs --mode tree")
        from harts.config.plan import PlanConfig
        from harts.exec.window import PlanTrainer
        from harts.plan.planners import known_planners, make_plan
        from harts.tree import build_forest

        if args.planner not in known_planners():
            raise UserError(f"unknown planner {args.planner!r}; known: {', '.join(known_planners())}")
        try:
            plan = make_plan(build_forest(trajectories), args.planner,
                             PlanConfig(microbatch_tokens=args.microbatch_tokens, chunk_size=config.chunk_size))
        except ValueError as err:
            raise UserError(str(err)) from None
        trainer_cls, extra = PlanTrainer, (plan,)
    trainer = trainer_cls(
        model, *extra,
        OptimizerConfig(lr=args.lr, grad_clip=args.grad_clip if args.grad_clip > 0 else None),
        PolicyLossConfig(agg_mode=args.agg_mode, kl_coef=args.kl_coef),
    )

    checkpoints = train_checkpoint.RunCheckpoints(args, trainer.model, trainer.optimizer)
    records: list[dict] = []
    if args.old_logprobs == "recompute":  # each step's batch depends on the model the last step left
        def results():
            for _ in range(checkpoints.start, args.steps):
                yield trainer.step(trainer.recompute_old_logprobs(trajectories, args.microbatch_tokens),
                                   args.microbatch_tokens)
        stream = results()
    else:  # the same batch every step: its data side is prepared one step ahead
        stream = run_steps(trainer, itertools.repeat(trajectories, args.steps - checkpoints.start),
                           args.microbatch_tokens)
    try:
        for step, result in enumerate(stream, start=checkpoints.start + 1):
            rec = {
                "step": step,
                **{k: v for k, v in result.losses.items()},
                "grad_norm": result.grad_norm,
                "tokens": result.tokens,
                "trained_tokens": result.trained_tokens,
                "microbatches": len(result.microbatches),
                "executed_rows": result.executed_rows,
                "seconds": result.seconds,
                "tokens_per_s": result.tokens_per_second,
            }
            records.append(rec)
            if not args.json and step == checkpoints.start + 1:
                print(f"{config.name} ({args.mode}): {len(trajectories)} trajectories, {result.tokens} tokens "
                      f"-> {result.executed_rows} executed rows, {len(result.microbatches)} microbatches "
                      f"of <= {args.microbatch_tokens} tokens, {device}")
            if not args.json:  # each step once, as it finishes
                print(f"step {step}  loss {rec['loss']:.6f}  pg {rec['pg_loss']:.6f}  kl {rec['kl']:.3e}  "
                      f"aux {rec['aux_loss']:.3e}  grad_norm {rec['grad_norm']:.4f}  entropy {rec['entropy']:.4f}  "
                      f"clip_frac {rec['clip_frac']:.4f}  {rec['tokens_per_s']:,.0f} tok/s", flush=True)
            saved = checkpoints.after_step(step)
            if saved is not None and not args.json:
                print(f"checkpoint {saved}", flush=True)
    except (KeyboardInterrupt, UserError) as err:
        if isinstance(err, UserError) and not caused_by_interrupt(err):
            raise
        done = records[-1]["step"] if records else checkpoints.start
        if args.json:  # the finished steps' records, still valid JSON
            print_json({"model": config.name, "mode": args.mode, "steps": records, "interrupted": True})
        latest = checkpoints.latest()
        where = f"checkpoint at {latest}" if latest is not None else "no checkpoint"
        raise Interrupted(f"interrupted after step {done}; {where}") from None
    if loaded is not None and args.save is not None:
        from harts.models import CheckpointError, save

        try:
            save(loaded, args.save)
        except CheckpointError as err:
            raise UserError(str(err), field="--save") from None
    if args.json:
        print_json({"model": config.name, "mode": args.mode, "steps": records})
    if loaded is not None and args.save is not None:
        say_wrote(args.save, args.json, "Hugging Face checkpoint")
    return 0


def _check_save_dir(path: str) -> None:
    """--save's target, checked before any work: its folder exists, and it is new, empty or
    a checkpoint directory (what `harts.models.save` replaces)."""
    from pathlib import Path

    target = Path(path)
    if not target.parent.is_dir():
        raise UserError(f"--save {path}: folder {target.parent} does not exist (create it first)", field="--save")
    if target.exists() and not target.is_dir():
        raise UserError(f"--save {path}: exists and is not a directory", field="--save")
    if target.is_dir() and any(target.iterdir()) and not (target / "config.json").is_file():
        raise UserError(f"--save {path}: a non-empty directory that is not a checkpoint; not replacing it",
                        field="--save")
