"""`harts train --parallel dp=2,ep=2,tp=1 ...`: the distributed training loop, one process
per rank (`torchrun --nproc-per-node N -m harts train --parallel ...`; without torchrun, a
mesh of one rank). Every launch check runs before the mesh's first collective; each
failure is one line and exit code 2."""

from __future__ import annotations

import argparse

from harts.cli.common import UserError, format_table, print_json


def cmd_train_distributed(args: argparse.Namespace, load_trajectories) -> int:
    """`load_trajectories(args, vocab_size)`: train's --workload / --input reader."""
    import torch
    import torch.distributed as dist

    from harts.cli import train_checkpoint
    from harts.cli.model_source import model_config
    from harts.config.models import ConfigError
    from harts.distributed.mesh import LaunchError, backend_for, check_launch, parse_parallel

    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    train_checkpoint.check_flags(args)
    if args.mode != "tree":
        raise UserError("--parallel runs a step plan: add --mode tree")
    if getattr(args, "save", None) is not None:
        raise UserError("--save with --parallel is not supported: write a checkpoint with --checkpoint-dir "
                        "(torch.distributed.checkpoint, loadable into one process)", field="--save")
    try:  # the spec's own degrees, before the process group (its size fills dp later)
        pp = parse_parallel(args.parallel).pp
    except LaunchError as err:
        raise UserError(str(err)) from None
    if args.old_logprobs == "recompute" and pp > 1:
        raise UserError("--parallel with pp > 1 needs --old-logprobs input (the pipeline runs no forward-only "
                        "pass to recompute them)", field="--old-logprobs")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    launched = dist.is_torchelastic_launched()
    if launched and not dist.is_initialized():
        # the rendezvous only: rank and world size, before any collective
        dist.init_process_group(backend_for(device))
    world = dist.get_world_size() if launched else 1
    rank = dist.get_rank() if launched else 0
    try:
        parallel = parse_parallel(args.parallel, world)
        if parallel.pp > 1 and (parallel.tp > 1 or parallel.ep > 1):
            raise LaunchError(f"--parallel {parallel.spec()}: pipeline stages run with data parallelism only "
                              "(tp=1, ep=1)")
        config = model_config(args)  # --model, or --model-path's config.json
        config.check_tree_mode()
    except (LaunchError, ConfigError) as err:
        raise UserError(str(err)) from None
    trajectories = load_trajectories(args, config.vocab_size)
    if not trajectories:
        raise UserError("no trajectories to train on")
    plan = _plan(args, trajectories, config, parallel.dp, parallel.pp)
    try:
        check_launch(parallel, world, config, plan)
    except LaunchError as err:
        raise UserError(str(err)) from None
    if not launched:
        from harts.distributed.runner import free_port

        dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    if torch.device(device).type == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(torch.device(device))
    try:
        rc = _train(args, parallel, config, plan, trajectories, device, rank)
        dist.barrier()  # no rank tears its group down while a peer still talks to it
        return rc
    finally:
        dist.destroy_process_group()


def _plan(args: argparse.Namespace, trajectories: list, config, dp: int, pp: int = 1):
    from harts.plan.plan import Plan
    from harts.tree import build_forest

    forest = build_forest(trajectories)
    if args.plan is not None:
        try:
            plan = Plan.load(args.plan)
            plan.validate(forest)
        except (OSError, ValueError, KeyError) as err:
            raise UserError(f"--plan {args.plan}: {err}") from None
        return plan
    from harts.config.plan import PlanConfig
    from harts.plan.planners import known_planners, make_plan

    planner = args.planner or "l1l2"
    if planner not in known_planners():
        raise UserError(f"unknown planner {planner!r}; known: {', '.join(known_planners())}")
    try:
        return make_plan(forest, planner, PlanConfig(microbatch_tokens=args.microbatch_tokens,
                                                     chunk_size=config.chunk_size, dp=dp, pp=pp))
    except ValueError as err:
        raise UserError(str(err)) from None


def _train(args, parallel, config, plan, trajectories, device: str, rank: int) -> int:
    import itertools

    import torch

    from harts.cli import train_checkpoint
    from harts.cli.model_source import train_model
    from harts.config.optimizer import OptimizerConfig
    from harts.distributed.mesh import init_mesh
    from harts.distributed.parallelize import parallelize
    from harts.distributed.runner import DistPlanTrainer
    from harts.exec.loss import PolicyLossConfig
    from harts.exec.trainer import run_steps

    dtype = None if args.dtype is None else getattr(torch, args.dtype)  # None: the checkpoint's, or float32
    mesh = init_mesh(parallel, device)
    model, _ = train_model(args, config, dtype, device)  # every rank reads a checkpoint, then keeps its part
    optimizer = OptimizerConfig(lr=args.lr, grad_clip=args.grad_clip if args.grad_clip > 0 else None)
    loss = PolicyLossConfig(agg_mode=args.agg_mode, kl_coef=args.kl_coef)
    if parallel.pp > 1:
        # pipeline stages on torch.distributed.pipelining, the plan's schedule lowered to the
        # runtime's actions, each stage sharded over "dp" by FSDP2 (harts.distributed.pipeline)
        from harts.distributed.pipeline import pipeline_trainer

        trainer = pipeline_trainer(model, mesh.mesh, plan, args.schedule, optimizer=optimizer, loss=loss)
        applied = ["pp"] + (["fsdp"] if parallel.dp > 1 else [])
    else:
        pm = parallelize(model, mesh)
        trainer = DistPlanTrainer(pm, plan, optimizer, loss)
        applied = pm.applied
    # every rank checkpoints its own shards (torch.distributed.checkpoint over the default
    # group): FSDP's DTensors, or a pipeline stage's own parameters
    checkpoints = train_checkpoint.RunCheckpoints(args, trainer.model, trainer.optimizer)
    mbt = args.microbatch_tokens
    todo = args.steps - checkpoints.start
    if args.old_logprobs == "recompute":
        stream = (trainer.step(trainer.recompute_old_logprobs(trajectories, mbt), mbt) for _ in range(todo))
    else:
        stream = run_steps(trainer, itertools.repeat(trajectories, todo), mbt)
    records = []
    for step, result in enumerate(stream, start=checkpoints.start + 1):
        if parallel.pp > 1:  # one stage's view: the step's losses, this stage's passes
            rec = {"step": step, **result.losses, "grad_norm": result.grad_norm, "seconds": result.seconds,
                   "schedule": result.schedule, "executed_is_simulated": result.executed == result.simulated}
            rec["tokens_per_s"] = sum(len(t) for t in trajectories) / max(result.seconds, 1e-9)
        else:
            rec = {"step": step, **result.losses, "grad_norm": result.grad_norm, "tokens": result.tokens,
                   "microbatches": len(result.microbatches), "executed_rows": result.executed_rows,
                   "seconds": result.seconds, "tokens_per_s": result.tokens_per_second}
        records.append(rec)
        saved = checkpoints.after_step(step)
        if rank == 0 and not args.json:
            print(f"step {step}  loss {rec['loss']:.6f}  pg {rec['pg_loss']:.6f}  aux {rec['aux_loss']:.3e}  "
                  f"grad_norm {rec['grad_norm']:.4f}  {rec['tokens_per_s']:,.0f} tok/s", flush=True)
            if saved is not None:
                print(f"checkpoint {saved}", flush=True)
    if rank == 0:
        if args.json:
            print_json({"model": config.name, "mode": "tree", "parallel": parallel.spec(),
                        "world_size": mesh.world_size, "mesh": mesh.describe(), "applied": applied,
                        "steps": records})
        else:
            print(format_table(["step", "loss", "pg_loss", "aux_loss", "grad_norm", "tokens/s"],
                               [(r["step"], r["loss"], r["pg_loss"], r["aux_loss"], r["grad_norm"],
                                 round(r["tokens_per_s"])) for r in records]))
    return 0
