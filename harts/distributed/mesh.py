"""The launch of a distributed step: `--parallel` parsing, launch checks, the device mesh.

Ranks are laid out as one `init_device_mesh` of named dimensions ("pp", "dp", "tp"), tp
innermost (a TP group is adjacent ranks, the NVLink neighbours on a node). Expert parallel
is carved out of "dp" as torchtitan does: "dp" is unflattened into ("dp_mod_ep", "ep"), ep
innermost, so an EP group is `ep` consecutive DP replicas, and the replicas holding the
same experts are the "dp_mod_ep" group (they reduce the experts' gradients). NCCL on
CUDA, gloo on CPU.

Every launch check runs before any collective (`check_launch`), each failing with a
`LaunchError` of one line: the CLI prints it and exits with code 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harts.config.models import FFNKind, LayerKind, ModelConfig
from harts.config.parallel import ParallelConfig, parse_degrees

__all__ = ["DistMesh", "LaunchError", "check_launch", "init_mesh", "parse_parallel"]


class LaunchError(ValueError):
    """A launch that cannot run: one line, said before any collective starts."""


def parse_parallel(text: str, world_size: int | None = None) -> ParallelConfig:
    """`dp=2,pp=2,ep=2,tp=1` as a ParallelConfig; omitted degrees are 1, except dp, which
    with a known `world_size` fills the ranks the others leave (torchtitan's dp_shard=-1)."""
    try:
        degrees = parse_degrees(text)
    except ValueError as err:
        raise LaunchError(str(err)) from None
    if "dp" not in degrees and world_size is not None:
        rest = degrees.get("pp", 1) * degrees.get("tp", 1)
        if world_size % rest == 0:
            degrees["dp"] = world_size // rest
    try:
        return ParallelConfig(**degrees)
    except ValueError as err:
        raise LaunchError(f"--parallel {text!r}: {str(err).removeprefix('parallel config: ')}") from None


def check_launch(parallel: ParallelConfig, world_size: int, model: ModelConfig, plan: Any = None) -> None:
    """Refuse, with one line, a launch that cannot run the step: a mesh other than the world
    size, ep not dividing the experts, pp above the layer count, tp not dividing the heads
    and FFN widths, pipeline stages with tp or ep, a plan made for another number of DP
    replicas, expert parallelism on a plan whose windows cross on a replica (an EP group's
    lockstep needs them nested, `harts.plan.lockstep`), or a pipeline (pp > 1) on a plan
    that gives a replica no microbatch (the pipelining runtime runs a replica's
    microbatches; one with none would skip the stage's FSDP collectives). Without a
    pipeline a replica with no microbatch takes part in every collective with a zero
    contribution (`harts.distributed.runner`)."""
    p = parallel
    if p.world_size != world_size:
        raise LaunchError(f"mesh {p.spec()} needs {p.world_size} ranks (dp x pp x tp) and does not divide "
                          f"the world size {world_size}")
    if p.pp > 1 and (p.tp > 1 or p.ep > 1):
        raise LaunchError(f"--parallel {p.spec()}: pipeline stages run with data parallelism only (tp=1, ep=1)")
    if p.ep > 1:
        if not model.num_moe_layers:
            raise LaunchError(f"ep={p.ep}: {model.name} has no MoE layer to shard experts over")
        if model.num_experts % p.ep:
            raise LaunchError(f"ep={p.ep} does not divide the {model.num_experts} experts of {model.name}")
    if p.pp > model.num_layers:
        raise LaunchError(f"pp={p.pp} is larger than the {model.num_layers} layers of {model.name}")
    if p.tp > 1:
        widths = []
        if LayerKind.KDA in model.layer_kinds:
            widths.append(("KDA heads", model.kda_num_heads))
        if LayerKind.MLA in model.layer_kinds:
            widths.append(("MLA heads", model.mla_num_heads))
        if FFNKind.DENSE in model.ffn_kinds:
            widths.append(("dense FFN width", model.dense_ffn_dim))
        if model.num_moe_layers and model.num_shared_experts:
            widths.append(("shared-expert width", model.expert_ffn_dim * model.num_shared_experts))
        for what, n in widths:
            if n % p.tp:
                raise LaunchError(f"tp={p.tp} does not divide the {n} {what} of {model.name}")
    if plan is not None and plan.dp != p.dp:
        raise LaunchError(f"the plan was made for dp={plan.dp} replicas; this launch has dp={p.dp}")
    if plan is not None and p.ep > 1:
        from harts.plan.lockstep import sequences

        try:  # an EP group's lockstep merges its replicas' windows, which must nest
            sequences(plan.microbatches, range(p.dp))
        except ValueError as err:
            raise LaunchError(f"--parallel {p.spec()}: {err}") from None
    if plan is not None and p.pp > 1:
        idle = sorted(set(range(p.dp)) - {m.replica for m in plan.microbatches})
        if idle:
            raise LaunchError(f"--parallel {p.spec()}: the plan gives replica{'s' if len(idle) > 1 else ''} "
                              f"{', '.join(map(str, idle))} no microbatch ({len(plan.microbatches)} microbatch(es) "
                              f"over {p.dp} replicas); a pipeline needs one on every replica (lower dp)")


@dataclass(frozen=True)
class DistMesh:
    """The run's device mesh and this rank's coordinates in it."""

    parallel: ParallelConfig
    mesh: Any  # torch DeviceMesh, dims ("pp", "dp", "tp")
    ep_mesh: Any  # DeviceMesh, dims ("dp_mod_ep", "ep"): "dp" unflattened
    device: torch.device

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def local_rank(self, dim: str) -> int:
        if dim in ("dp_mod_ep", "ep"):
            return self.ep_mesh.get_local_rank(dim)
        return self.mesh.get_local_rank(dim)

    def submesh(self, dim: str) -> Any:
        """The 1-D mesh of `dim` through this rank ("pp", "dp", "tp", "ep", "dp_mod_ep")."""
        return self.ep_mesh[dim] if dim in ("dp_mod_ep", "ep") else self.mesh[dim]

    def group(self, dim: str) -> Any:
        return self.submesh(dim).get_group()

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica: the plan's `Microbatch.replica` it runs."""
        return self.local_rank("dp")

    def describe(self) -> dict[str, Any]:
        return {"dims": {"pp": self.parallel.pp, "dp": self.parallel.dp, "tp": self.parallel.tp,
                         "ep": self.parallel.ep, "dp_mod_ep": self.parallel.dp // self.parallel.ep},
                "backend": dist.get_backend(), "device": str(self.device)}


def init_mesh(parallel: ParallelConfig, device: str | torch.device = "cpu") -> DistMesh:
    """The run's mesh over an initialised default process group (`torchrun` and
    `dist.init_process_group`, or `harts.distributed.runner.launch`): one `init_device_mesh`
    ("pp", "dp", "tp"), "dp" unflattened into ("dp_mod_ep", "ep")."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs an initialised default process group")
    device = torch.device(device)
    p = parallel
    if p.world_size != dist.get_world_size():
        raise LaunchError(f"mesh {p.spec()} needs {p.world_size} ranks; the world has {dist.get_world_size()}")
    mesh = init_device_mesh(device.type, (p.pp, p.dp, p.tp), mesh_dim_names=("pp", "dp", "tp"))
    ep_mesh = mesh["dp"]._unflatten(0, (p.dp // p.ep, p.ep), ("dp_mod_ep", "ep"))
    return DistMesh(p, mesh, ep_mesh, device)


def backend_for(device: str | torch.device) -> str:
    """NCCL on CUDA, gloo on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
