"""The distributed step against the single-process expanded reference.

`verify_distributed` starts `world_size` worker processes (`harts.distributed.runner.launch`:
gloo on CPU, NCCL on CUDA), each building the same model from the seed, the same plan for
`dp` replicas (and `pp` stages) and its share of the mesh
(`harts.distributed.parallelize.parallelize`); they run one distributed forward/backward
(`harts.distributed.runner.distributed_trainer`: this replica's `DistPlanTrainer`, or with
pp > 1 the pipeline under a simulator schedule) and assemble the full gradients. Rank 0
then runs the single-process `ExpandedTrainer` from the same weights and compares every
log-prob, entropy, loss term, expert load and parameter gradient (`compare_steps`), as
`harts verify` does for one process. The MoE aux loss is in the step-global scope on both sides, the scope whose value
does not depend on how the step is split.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from harts.config.kernels import KernelConfig
from harts.config.models import ModelConfig, get_model_config
from harts.config.parallel import ParallelConfig
from harts.exec.loss import PolicyLossConfig
from harts.tree import Trajectory

__all__ = ["verify_distributed", "verify_distributed_dtypes"]


def _plan(trajectories, config: ModelConfig, planner: str, microbatch_tokens: int, dp: int, pp: int = 1, ep: int = 1):
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.tree import build_forest

    return make_plan(build_forest(trajectories), planner,
                     PlanConfig(microbatch_tokens=microbatch_tokens, chunk_size=config.chunk_size, dp=dp, pp=pp,
                                ep=ep if pp == 1 else 1))


def _worker(payload: dict, out_path: str) -> None:
    """One step report per dtype of `payload["dtypes"]`, on one mesh (rank 0 writes them)."""
    import torch.distributed as dist

    from harts.distributed.mesh import init_mesh

    mesh = init_mesh(payload["parallel"], payload["device"])
    reports = [_step_report(payload, mesh, dtype) for dtype in payload["dtypes"]]
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(reports))


def _step_report(payload: dict, mesh, dtype: torch.dtype) -> dict[str, Any] | None:
    """The distributed step in `dtype` against the single-process expanded one: the report
    on rank 0, None on the others."""
    import torch.distributed as dist

    from harts.config.parallel import ParallelizeConfig
    from harts.distributed.parallelize import parallelize
    from harts.distributed.runner import distributed_trainer, full_gradients
    from harts.exec.factory import make_trainer
    from harts.exec.model.model import build_model
    from harts.verify.equivalence import compare_steps

    parallel: ParallelConfig = payload["parallel"]
    config: ModelConfig = payload["config"]
    device, loss = payload["device"], payload["loss"]
    mbt = payload["microbatch_tokens"]
    trajectories = payload["trajectories"]
    template = build_model(config, seed=payload["seed"], dtype=dtype, device=device)
    if payload["weights"] is not None:  # a checkpoint's weights (harts verify --model-path), cast to dtype
        template.load_state_dict(payload["weights"])
    if payload["recompute_old_logprobs"]:
        box = [None]
        if dist.get_rank() == 0:
            box[0] = make_trainer("expanded", copy.deepcopy(template), loss=loss).recompute_old_logprobs(
                trajectories, mbt)
        dist.broadcast_object_list(box, src=0)
        trajectories = box[0]
    plan = _plan(trajectories, config, payload["planner"], mbt, parallel.dp, parallel.pp, parallel.ep)
    extra: dict[str, Any] = {}
    model = copy.deepcopy(template)
    pm = parallelize(model, mesh, ParallelizeConfig(sequence_parallel=payload["sequence_parallel"]))
    trainer = distributed_trainer(pm, plan, schedule=payload["schedule"], loss=loss, kernels=payload["kernels"])
    if parallel.pp > 1:
        got, grads, extra = _pipeline_step(model, trainer, trajectories)
    else:
        got = trainer.forward_backward(trajectories, mbt)
        grads = full_gradients(pm)
    applied = pm.applied
    if dist.get_rank() != 0:
        return None
    ref_model = copy.deepcopy(template)
    ref = make_trainer("expanded", ref_model, loss=loss, kernels=payload["kernels"]).forward_backward(trajectories, mbt)
    got_model = copy.deepcopy(template)
    for name, p in got_model.named_parameters():
        p.grad = grads[name].to(device=p.device, dtype=p.dtype)
    report: dict[str, Any] = {
        "model": config.name,
        "dtype": str(dtype).removeprefix("torch."),
        "planner": payload["planner"],
        "aux_scope": config.aux_scope,
        "num_trajectories": len(trajectories),
        "num_targets": int(sum(len(t) - 1 for t in trajectories)),
        "microbatches": len(plan.microbatches),
        "sharing_windows": len(plan.consumers()),
        "expanded_tokens": got.tokens,
        "compact_tokens": sum(m["rows"] for m in got.layout),
        "rounds": max(m.get("kda_rounds", 0) for m in got.layout),
        "replay_tokens": sum(m.get("replay_tokens", 0) for m in got.layout),
        "world_size": dist.get_world_size(),
        "parallel": parallel.spec(),
        "mesh": mesh.describe(),
        "applied": applied,
        **extra,
        "grad_norm": got.grad_norm,
        "ref_grad_norm": ref.grad_norm,
        "losses": got.losses,
        "ref_losses": ref.losses,
        **compare_steps(ref, ref_model, got, got_model),
    }
    return report


def _pipeline_step(model, trainer, trajectories) -> tuple[Any, dict, dict]:
    """One pipeline forward/backward (`harts.distributed.pipeline_step.PipelineTrainer` on
    this rank's stage of `model`) and, on rank 0, the whole step assembled from the ranks:
    every stage's gradients (replica 0's: the replicas' are all-reduced), the log-probs and
    entropies of every replica's last stage, the losses and expert loads every rank holds;
    plus whether every rank ran the simulated schedule's passes in its order."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from harts.distributed.pipeline_step import executed_schedule
    from harts.distributed.runner import merge_per_trajectory

    result = trainer.forward_backward(trajectories)
    ran = executed_schedule(result).to_text()
    simulated = trainer.simulated_schedule(trajectories).to_text()
    from torch.distributed.tensor import DTensor

    # an FSDP-sharded stage (dp > 1): its gradients gathered whole over "dp"
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu()
             for n, p in model.named_parameters() if p.grad is not None}
    mine = (result.replica, result.stage, grads, result.logprobs, result.entropy)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    full: dict[str, Any] = {}
    for replica, _stage, g, _lps, _ents in parts:
        if replica == 0:
            full.update(g)
    # each replica's last stage holds its trajectories' values
    logprobs = merge_per_trajectory([p[3] for p in parts])
    entropy = merge_per_trajectory([p[4] for p in parts])
    got = SimpleNamespace(logprobs=logprobs, entropy=entropy, losses=result.losses, expert_load=result.expert_load,
                          tokens=sum(len(t) for t in trajectories), grad_norm=float("nan"), layout=result.layout)
    return got, full, {"schedule": result.schedule, "executed_is_simulated": ran == simulated}


def verify_distributed(
    trajectories: Sequence[Trajectory],
    *,
    parallel: ParallelConfig,
    model: str | ModelConfig | torch.nn.Module = "tiny-cpu",
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    microbatch_tokens: int = 1 << 20,
    planner: str = "l1l2",
    loss: PolicyLossConfig | None = None,
    device: str = "cpu",
    recompute_old_logprobs: bool = True,
    kernels: KernelConfig | None = None,
    schedule: str = "consumer-1f1b",
    sequence_parallel: bool = True,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """One distributed forward/backward under `parallel` against the single-process
    expanded step (`verify_distributed_dtypes` with one dtype); the comparison report
    (`compare_steps`'s fields, the step's shape, `world_size` and the mesh). With pp > 1
    the pipeline runs the simulator's `schedule` (tp = ep = 1) and the report adds
    `schedule` and `executed_is_simulated`. With tp > 1, `sequence_parallel` row-shards the
    residual stream (`harts.distributed.parallelize`). `model`: a registered name or config
    (weights from `seed`), or a model (a loaded checkpoint) whose weights every worker
    starts from. Launch checks (`check_launch`, the plan's included) run before any
    process starts."""
    return verify_distributed_dtypes(
        trajectories, parallel=parallel, model=model, dtypes=(dtype,), seed=seed, microbatch_tokens=microbatch_tokens,
        planner=planner, loss=loss, device=device, recompute_old_logprobs=recompute_old_logprobs, kernels=kernels,
        schedule=schedule, sequence_parallel=sequence_parallel, timeout=timeout)[0]


def verify_distributed_dtypes(
    trajectories: Sequence[Trajectory],
    *,
    parallel: ParallelConfig,
    dtypes: Sequence[torch.dtype],
    model: str | ModelConfig | torch.nn.Module = "tiny-cpu",
    seed: int = 0,
    microbatch_tokens: int = 1 << 20,
    planner: str = "l1l2",
    loss: PolicyLossConfig | None = None,
    device: str = "cpu",
    recompute_old_logprobs: bool = True,
    kernels: KernelConfig | None = None,
    schedule: str = "consumer-1f1b",
    sequence_parallel: bool = True,
    timeout: float = 300.0,
) -> list[dict[str, Any]]:
    """`verify_distributed`'s report for each of `dtypes`, one after the other in the same
    worker processes (one launch, one mesh; each dtype its own model from the same weights,
    its own distributed step and its own single-process reference in that dtype)."""
    from harts.distributed.mesh import check_launch
    from harts.distributed.runner import launch

    weights = None
    if isinstance(model, torch.nn.Module):
        weights = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        model = model.config
    config = get_model_config(model) if isinstance(model, str) else model
    config = config.replace(aux_scope="global")
    trajectories = list(trajectories)
    check_launch(parallel, parallel.world_size, config)
    if loss is None:
        has_ref = all(t.ref_logprobs is not None for t in trajectories)
        loss = PolicyLossConfig(kl_coef=0.1 if has_ref else 0.0)
    # the plan is made here first so a planner's refusal, or a plan the launch cannot run,
    # is reported before workers start
    check_launch(parallel, parallel.world_size, config,
                 _plan(trajectories, config, planner, microbatch_tokens, parallel.dp, parallel.pp, parallel.ep))
    payload = {"schedule": schedule, "parallel": parallel, "config": config, "device": device, "dtypes": list(dtypes),
               "loss": loss,
               "microbatch_tokens": microbatch_tokens, "trajectories": trajectories, "seed": seed,
               "planner": planner, "recompute_old_logprobs": recompute_old_logprobs,
               "sequence_parallel": sequence_parallel, "weights": weights,
               "kernels": kernels if kernels is not None else KernelConfig.from_env()}
    with tempfile.TemporaryDirectory(prefix="harts-verify-") as tmp:
        out = Path(tmp) / "report.json"
        launch(_worker, (payload, str(out)), parallel.world_size, device=device, timeout=timeout)
        return json.loads(out.read_text())
