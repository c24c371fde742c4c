"""One way to train: a `TrainConfig` and the step's trajectories -> `build_trainer` -> the steps.

`build_trainer(config, trajectories)` checks the run, builds its model (a registered config
from the seed, or a checkpoint directory's weights), picks the execution from
`config.parallel` and builds its trainer, and loads the checkpoint a resume continues from:

- one process (`parallel` None): `harts.exec.factory.make_trainer` - the expanded
  baseline, whole trees per microbatch, or a planner's plan (sharing windows);
- DP / TP / EP / PP (`parallel` set; under torchrun one process per rank, without it a mesh
  of one rank): the launch checks before any collective, the process group and mesh,
  `harts.distributed.parallelize.parallelize` (this rank's part of the model: its shards,
  or its pipeline stage) and `harts.distributed.runner.distributed_trainer` (the replica's
  plan trainer, or the pipeline's under the simulator schedule `parallel.schedule`).

`TrainRun.steps()` then runs the update steps (`config.steps`, after those a resume found
done), each on the same trajectories: with `old_logprobs` "recompute" the current policy's
log-probs first (a forward-only pass), with "input" the rollouts' own (the data side of
each step then prepared one step ahead, `harts.exec.trainer.run_steps`); after each step
the checkpoint due. `train(config, trajectories)` is build, steps and the final Hugging
Face save in one iterator.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harts.config.models import ConfigError, ModelConfig
from harts.config.train import TrainConfig
from harts.train.checkpoints import RunCheckpoints, check_paths
from harts.train.errors import TrainError

__all__ = ["CPU_MAX_PARAMS", "StepRecord", "TrainRun", "build_trainer", "model_config", "train"]

# Refuse to build models this large on a CPU: the Table 1 configs are for GPUs (and the
# simulator), and allocating them here would only exhaust memory.
CPU_MAX_PARAMS = 200_000_000


@dataclass(frozen=True)
class StepRecord:
    """One finished update step: `values` its record (the step's loss terms, grad_norm and
    timing; in one process and data-parallel runs tokens, microbatches and executed rows; in
    a pipeline its schedule and whether every pass ran as simulated), `checkpoint` the
    checkpoint written after it (None if none was due), `result` the trainer's own result."""

    step: int
    values: dict[str, Any]
    checkpoint: Path | None = None
    result: Any = None


def model_config(config: TrainConfig) -> ModelConfig:
    """The ModelConfig of `config.model` (a registered name, or a checkpoint's config.json:
    `harts.models` errors pass through)."""
    if config.model.path is not None:
        from harts.models import load_config

        return load_config(config.model.path)[0]
    from harts.config.models import get_model_config

    try:
        return get_model_config(config.model.name)
    except ConfigError as err:
        raise TrainError(str(err), field="model.name") from None


class TrainRun:
    """A built run (`build_trainer`): its trainer and what it set up around it."""

    def __init__(self, config: TrainConfig, model_config: ModelConfig, trainer: Any, trajectories: list,
                 checkpoints: RunCheckpoints, *, loaded: Any = None, device: str = "cpu", mesh: Any = None,
                 applied: Sequence[str] = (), rank: int = 0, owns_group: bool = False):
        self.config = config
        self.model_config = model_config
        self.trainer = trainer
        self.trajectories = trajectories
        self.checkpoints = checkpoints
        self.loaded = loaded  # the checkpoint source's LoadedModel (what `finish` saves)
        self.device = device
        self.mesh = mesh  # DistMesh of a distributed run, else None
        self.applied = list(applied)
        self.rank = rank
        self.finished: list[StepRecord] = []  # every step done, the one being checkpointed included
        self._owns_group = owns_group

    @property
    def start(self) -> int:
        """The steps a resume found done (the run continues at step start + 1)."""
        return self.checkpoints.start

    @property
    def is_main(self) -> bool:
        """Whether this process reports the run (rank 0)."""
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        """The run's shape for its report: model, mode and, distributed, the mesh."""
        out: dict[str, Any] = {"model": self.model_config.name, "mode": self.config.mode}
        if self.mesh is not None:
            out.update(parallel=self.mesh.parallel.spec(), world_size=self.mesh.world_size,
                       mesh=self.mesh.describe(), applied=self.applied)
        return out

    def steps(self) -> Iterator[StepRecord]:
        """The remaining update steps, each yielded after its checkpoint (if one is due) is
        written; `finished` holds each step's record before its checkpoint is written."""
        from harts.exec.trainer import run_steps

        trainer, trajectories = self.trainer, self.trajectories
        mbt = self.config.plan.microbatch_tokens
        todo = self.config.steps - self.start
        if self.config.old_logprobs == "recompute":  # each step's batch depends on the model the last step left
            stream = (trainer.step(trainer.recompute_old_logprobs(trajectories, mbt), mbt) for _ in range(todo))
        else:  # the same batch every step: its data side is prepared one step ahead
            stream = run_steps(trainer, itertools.repeat(trajectories, todo), mbt)
        for step, result in enumerate(stream, start=self.start + 1):
            record = StepRecord(step, _values(step, result, trajectories, self.mesh is not None), None, result)
            self.finished.append(record)
            saved = self.checkpoints.after_step(step)
            if saved is not None:
                record = dataclasses.replace(record, checkpoint=saved)
                self.finished[-1] = record
            yield record

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint a resume would continue from now."""
        return self.checkpoints.latest()

    def finish(self) -> Path | None:
        """After the steps: the trained weights written as a Hugging Face checkpoint where
        `checkpoint.save` asks (the source checkpoint's config.json, names and dtypes)."""
        target = self.config.checkpoint.save
        if self.loaded is None or target is None:
            return None
        from harts.models import CheckpointError, save

        try:
            save(self.loaded, target)
        except CheckpointError as err:
            raise TrainError(str(err), field="checkpoint.save") from None
        return Path(target)

    def close(self, ok: bool = True) -> None:
        """Tear down the process group the run set up (after a barrier when it went well:
        no rank tears its group down while a peer still talks to it)."""
        if not self._owns_group:
            return
        import torch.distributed as dist

        self._owns_group = False
        if dist.is_initialized():
            try:
                if ok:
                    dist.barrier()
            finally:
                dist.destroy_process_group()

    def __enter__(self) -> TrainRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        self.close(ok=exc_type is None)


def _values(step: int, result: Any, trajectories: list, distributed: bool) -> dict[str, Any]:
    """A step's record (`StepRecord.values`) from the trainer's result."""
    if hasattr(result, "schedule"):  # one pipeline stage's view: the step's losses, this stage's passes
        return {"step": step, **result.losses, "grad_norm": result.grad_norm, "seconds": result.seconds,
                "schedule": result.schedule, "executed_is_simulated": result.executed == result.simulated,
                "tokens_per_s": sum(len(t) for t in trajectories) / max(result.seconds, 1e-9)}
    values = {"step": step, **result.losses, "grad_norm": result.grad_norm, "tokens": result.tokens}
    if not distributed:  # (a replica counts its own trained tokens)
        values["trained_tokens"] = result.trained_tokens
    values.update(microbatches=len(result.microbatches), executed_rows=result.executed_rows,
                  largest_microbatch_rows=max((m["rows"] for m in result.layout), default=0),
                  seconds=result.seconds, tokens_per_s=result.tokens_per_second)
    return values


def train(config: TrainConfig, trajectories: Sequence[Any]) -> Iterator[StepRecord]:
    """The run `config` describes on `trajectories`: each remaining step's record as it
    finishes; at the end the Hugging Face save `checkpoint.save` asks for."""
    with build_trainer(config, trajectories) as run:
        yield from run.steps()
        run.finish()


def build_trainer(config: TrainConfig, trajectories: Sequence[Any]) -> TrainRun:
    """The run `config` describes, built and ready to step (module docstring). A run that
    cannot start raises TrainError naming the field; a checkpoint source's unreadable files
    raise `harts.models.CheckpointError`."""
    trajectories = list(trajectories)
    if not trajectories:
        raise TrainError("no trajectories to train on", field="data")
    mc = model_config(config)
    for t in trajectories:  # a rollout file is checked as it loads; generated workloads here
        top = int(t.tokens.max()) if len(t) else 0
        if top >= mc.vocab_size:
            raise TrainError(f"trajectory {t.id!r}: token id {top} is outside the vocabulary of {mc.name} (size "
                             f"{mc.vocab_size})", field="data")
    if config.loss.kl_coef > 0 and any(t.ref_logprobs is None for t in trajectories):
        raise TrainError("`loss.kl_coef` > 0 needs ref_logprobs in every trajectory", field="loss.kl_coef")
    check_paths(config)
    if config.parallel is None:
        return _build_single(config, mc, trajectories)
    return _build_distributed(config, mc, trajectories)


def _device(config: TrainConfig) -> str:
    import torch

    return config.precision.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _device_profile(device: str) -> str | None:
    """The shipped hardware profile of the CUDA device `device` (H100, H200), else None."""
    import torch

    from harts.sim.hardware import profile_for_device

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return profile_for_device(torch.cuda.get_device_name(dev))


def _dtype(config: TrainConfig) -> Any:
    import torch

    return None if config.precision.dtype is None else getattr(torch, config.precision.dtype)


def _model(config: TrainConfig, mc: ModelConfig, dtype: Any, device: str) -> tuple[Any, Any]:
    """(model, LoadedModel or None): `model.path`'s checkpoint in `dtype` (None: its own), or
    `mc` built from the seed (float32 where `dtype` is None); recompute from
    `model.recompute`, the MoE aux loss's scope from `aux_scope` (`ModelConfig.aux_scope`,
    what every trainer of the model reads)."""
    import torch

    if config.model.path is not None:
        from harts.models import load

        loaded = load(config.model.path, dtype=dtype, device=device, allow_pickle=config.model.allow_pickle)
        loaded.model.recompute = config.model.recompute
        # save() writes the checkpoint's config whatever the scope
        loaded.model.config = loaded.model.config.replace(aux_scope=config.aux_scope)
        return loaded.model, loaded
    from harts.exec.model import build_model

    return build_model(mc.replace(aux_scope=config.aux_scope), seed=config.seed, dtype=dtype or torch.float32,
                       device=device, recompute=config.model.recompute), None


def _check_tree_mode(mc: ModelConfig) -> None:
    try:
        mc.check_tree_mode()
    except ConfigError as err:
        raise TrainError(str(err), field="mode") from None


def _plan(config: TrainConfig, trajectories: list, mc: ModelConfig, dp: int = 1, pp: int = 1, ep: int = 1) -> Any:
    """The step plan: `plan.file`'s (checked against the step's forest), or the planner's
    for `dp` replicas (in expert-parallel groups of `ep`) and `pp` stages."""
    from harts.tree import build_forest

    forest = build_forest(trajectories)
    if config.plan.file is not None:
        from harts.plan.plan import Plan

        try:
            plan = Plan.load(config.plan.file)
            plan.validate(forest)
        except (OSError, ValueError, KeyError) as err:
            raise TrainError(f"`plan.file` {config.plan.file}: {err}", field="plan.file") from None
        return plan
    from harts.config.plan import PlanConfig
    from harts.plan.planners import known_planners, make_plan

    planner = config.planner
    if planner not in known_planners():
        raise TrainError(f"unknown planner {planner!r}; known: {', '.join(known_planners())}", field="plan.planner")
    floors = {}
    profile = None if config.plan.window_floors == "off" else config.plan.window_floors
    if profile == "auto":
        profile = _device_profile(_device(config))
    if profile is not None:
        from harts.sim.executor import plan_floors

        try:
            floors = plan_floors(mc, profile, config.plan.microbatch_tokens)
        except ValueError as err:
            raise TrainError(f"`plan.window_floors`: {err}", field="plan.window_floors") from None
    try:
        return make_plan(forest, planner, PlanConfig(microbatch_tokens=config.plan.microbatch_tokens,
                                                     chunk_size=mc.chunk_size, dp=dp, pp=pp, ep=ep, **floors))
    except ValueError as err:
        raise TrainError(str(err)) from None


def _build_single(config: TrainConfig, mc: ModelConfig, trajectories: list) -> TrainRun:
    import torch

    from harts.config.param_counts import parameter_counts
    from harts.exec.factory import chained_expanded_plan, make_trainer

    device = _device(config)
    total = parameter_counts(mc).total
    if torch.device(device).type == "cpu" and total > CPU_MAX_PARAMS:
        raise TrainError(f"{mc.name} has {total / 1e9:.1f}B parameters: too large to train on a CPU",
                         field="model.name")
    model, loaded = _model(config, mc, _dtype(config), device)
    if config.mode == "tree":
        _check_tree_mode(mc)
    kind, plan = config.mode, None
    if config.planner is not None:
        kind, plan = "plan", _plan(config, trajectories, mc)
    elif config.mode == "expanded":
        # a trajectory longer than the budget runs as a chain of windows, not over the budget
        try:
            plan = chained_expanded_plan(trajectories, config.plan.microbatch_tokens, mc.chunk_size)
        except ValueError as err:
            raise TrainError(str(err)) from None
        kind = "expanded" if plan is None else "plan"
    trainer = make_trainer(kind, model, plan, optimizer=config.optimizer, loss=config.loss, kernels=config.kernels)
    checkpoints = RunCheckpoints(config, trainer.model, trainer.optimizer)
    return TrainRun(config, mc, trainer, trajectories, checkpoints, loaded=loaded, device=device)


def _build_distributed(config: TrainConfig, mc: ModelConfig, trajectories: list) -> TrainRun:
    """Every launch check runs before the mesh's first collective (under torchrun the
    rendezvous comes first: it gives the world size that fills an unset dp)."""
    import torch
    import torch.distributed as dist

    from harts.distributed.mesh import LaunchError, backend_for, check_launch, init_mesh
    from harts.distributed.parallelize import parallelize
    from harts.distributed.runner import distributed_trainer

    device = _device(config)
    launched = dist.is_torchelastic_launched()
    owns = False
    if launched and not dist.is_initialized():
        dist.init_process_group(backend_for(device))  # the rendezvous only: rank and world size
        owns = True
    try:
        world = dist.get_world_size() if launched else 1
        rank = dist.get_rank() if launched else 0
        try:
            parallel = config.parallel.resolve(world)
            _check_tree_mode(mc)
            plan = _plan(config, trajectories, mc, parallel.dp, parallel.pp, parallel.ep)
            check_launch(parallel, world, mc, plan)
        except LaunchError as err:
            raise TrainError(str(err), field="parallel") from None
        if not launched:
            from harts.distributed.runner import free_port

            dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1)
            owns = True
        if torch.device(device).type == "cuda":
            device = f"cuda:{rank % torch.cuda.device_count()}"
            torch.cuda.set_device(torch.device(device))
        mesh = init_mesh(parallel, device)
        model, _ = _model(config, mc, _dtype(config), device)  # every rank reads a checkpoint, then keeps its part
        pm = parallelize(model, mesh, config.parallel.parallelize())
        trainer = distributed_trainer(pm, plan, schedule=config.parallel.schedule, optimizer=config.optimizer,
                                      loss=config.loss, kernels=config.kernels)
        # every rank checkpoints its own shards (torch.distributed.checkpoint over the default
        # group): FSDP's DTensors, or a pipeline stage's own parameters
        checkpoints = RunCheckpoints(config, trainer.model, trainer.optimizer)
    except BaseException:
        if owns and dist.is_initialized():
            dist.destroy_process_group()
        raise
    return TrainRun(config, mc, trainer, trajectories, checkpoints, device=device, mesh=mesh, applied=pm.applied,
                    rank=rank, owns_group=owns)
