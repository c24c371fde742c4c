"""Each parallelism an `apply_*` function, composed in one place in a fixed order.

`parallelize(model, mesh, config)` is the one entry point (training, `harts verify
--parallel`); it applies, as torchtitan's parallelize.py orders them:

1. `apply_pp` (pp > 1): the pipeline split, this rank's stage (`harts.distributed.pipeline`,
   imported only when pp > 1), which the later steps then see as the model;
2. `apply_tp` (tp > 1): DTensor `parallelize_module` on the projections;
3. `apply_ep` (ep > 1): routed experts sharded over the "ep" dimension;
4. `apply_fsdp` (dp > 1): FSDP2 `fully_shard` per block, the experts on "dp_mod_ep", the root
   (the same units and settings for a whole model and a pipeline stage).

Tensor parallel (Megatron's column/row split, on the head and FFN dimensions):
- KDA: q/k/v, the gate's second low-rank factor f_proj[1], b_proj and g_proj[1] are
  column-wise (each rank holds whole heads), o_proj row-wise. The per-head parameters that
  are not Linear layers (the short-conv kernels, A_log, dt_bias) become this rank's slice
  of heads; the gated output norm's weight, shared by all heads, takes the sum of the TP
  ranks' gradients in backward (`_ReplicateGrad`). The rows' KDA recurrence and its tree
  replay are per head, so they run unchanged on the local heads and stay exact.
- MLA: q (q_b when low-rank) and kv_b column-wise, o_proj row-wise; the latent projection
  kv_a stays replicated, and its decoupled key (shared by every head) sums its gradient
  over the TP ranks. Ancestor attention is per head: exact.
- Dense FFN and shared experts: gate/up column-wise, down row-wise. The router and the
  routed experts stay replicated (routed experts are sharded by EP instead).
- Sequence parallel (`sequence_parallel=True`, the default with tp > 1): between the
  mixers and FFNs the residual stream is sharded by rows over TP, so the norms, the
  residual adds and their saved activations cost 1/tp per rank. The T rows are padded to
  T' (a multiple of tp) and rank r holds rows [r T'/tp, (r+1) T'/tp): the embedding's
  output is cut to this share (`_SliceRows`), each norm normalises its own rows (its
  weight's gradient summed over TP), and the rows are all-gathered (`_GatherRows`) only
  where a mixer or an FFN needs the whole microbatch: the mixing contexts and the MoE
  index rows across it (ancestor paths, KDA rounds, routing). The KDA and MLA output
  projections and the dense FFN's down projection are row-wise with a row-sharded output
  (`RowwiseParallel(output_layouts=Shard(0))`: a reduce-scatter instead of an all-reduce);
  the MoE routes the gathered T rows (padding rows never reach the router), and its
  replicated output is cut to this rank's share. The final norm's rows are gathered for
  the LM head. A gathered tensor's consumers are replicated or reduce their input's
  gradient over TP themselves (DTensor's column-wise input, `_ReplicateGrad`), so its
  gradient is whole on every rank and the gather's backward keeps this rank's rows.
Every TP sum (row-wise all-reduce or reduce-scatter, gradient sums) only reorders a sum:
results equal the single-process step up to rounding (1e-15 relative in float64).

Expert parallel: the routed experts of each MoE layer move into a `LocalExperts` module
holding this EP rank's E/ep experts; the (row, expert) assignments are sorted by expert,
sent to the owning rank with one all-to-all (the routing weight rides along as an extra
column, so its gradient comes back the same way), computed there, and returned with a
second all-to-all. Routing, expert loads and the aux loss are computed on the sending
rank from its rows and their occurrence weights before dispatch, so they are those of the
expanded batch. Each all-to-all's backward is the reverse all-to-all.

Parameters that end up as plain local slices (EP experts, TP per-head parameters) are
listed in `ParallelModel.shards` with the single-process name and the dimension they were
cut along, so full gradients and norms can be assembled (`harts.distributed.runner`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harts.config.models import FFNKind
from harts.config.parallel import ParallelizeConfig
from harts.distributed.mesh import DistMesh
from harts.exec import backend
from harts.exec.model.kda import KDAMixer
from harts.exec.model.layers import (
    GatedRMSNorm,
    OffsetRMSNorm,
    RMSNorm,
    SwiGLU,
    norm_kernels,
    offset_rms_norm,
)
from harts.exec.model.mla import MLAMixer
from harts.exec.model.model import Block, HybridModel, ModelOutput
from harts.exec.model.moe import MoE, experts_grouped, experts_loop

__all__ = ["ExpertParallelMoE", "LocalExperts", "ParallelModel", "ShardInfo", "apply_ep", "apply_fsdp",
           "apply_sequence_parallel", "apply_tp", "parallelize"]


@dataclass(frozen=True)
class ShardInfo:
    """A parameter held as a plain local slice: its single-process name, the dimension
    it was cut along and the mesh dimension whose ranks hold the other slices (in rank order)."""

    name: str
    dim: int
    mesh_dim: str


@dataclass
class ParallelModel:
    """The parallelised model and what the runner needs to drive it."""

    model: nn.Module
    mesh: DistMesh
    shards: dict[str, ShardInfo] = field(default_factory=dict)
    fsdp_modules: list[Any] = field(default_factory=list)  # FSDPModule instances, root last
    applied: list[str] = field(default_factory=list)  # the apply_* that changed something

    # FSDP2 driving: one all-gather per module at the start of a step, no gradient
    # reduction during the microbatches, one reduce-scatter per module at its end
    def unshard(self) -> None:
        for m in self.fsdp_modules:
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.unshard()

    def enable_gradient_sync(self) -> None:
        for m in self.fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)

    def reshard(self) -> None:
        for m in self.fsdp_modules:
            m.reshard()


class _ReplicateGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group (a replicated
    tensor used by each TP rank on its own heads only: its gradient is the ranks' sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class TPGatedRMSNorm(GatedRMSNorm):
    """GatedRMSNorm whose weight (shared by the heads) sums its gradient over the TP group."""

    tp_group: Any = None

    def forward(self, x: Tensor, gate: Tensor, ctx: Any = None) -> Tensor:
        weight = _ReplicateGrad.apply(self.weight, self.tp_group)
        kernels, record = norm_kernels(ctx)
        return backend.rms_norm(x, weight, self.eps, self.float32, kernels=kernels, record=record) * torch.sigmoid(gate)


# ---- sequence parallel: the residual stream's rows sharded over TP ----------------------
# Small autograd functions around torch.distributed's own collectives, as `_AllToAll`, rather
# than DTensor layouts on the residual stream: the shares are of the padded T' rows, while
# the mixers and the router must see exactly the microbatch's T rows (a gather strips the
# padding, which a Shard(0) -> Replicate redistribute would keep).


def _share(rows: int, tp: int) -> int:
    """Rows per TP rank: T rounded up to a multiple of tp, over tp."""
    return -(-rows // tp)


# torch 2.13 renamed all_gather_into_tensor (older releases have only the old name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_rows(x: Tensor, group) -> Tensor:
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _own_rows(x: Tensor, rank: int, n: int) -> Tensor:
    """Rows [rank n, (rank + 1) n) of x, zero past its end."""
    out = x.new_zeros((n, *x.shape[1:]))
    lo, hi = rank * n, min((rank + 1) * n, x.shape[0])
    if hi > lo:
        out[:hi - lo] = x[lo:hi]
    return out


class _SliceRows(torch.autograd.Function):
    """Replicated rows [T, ...] -> this TP rank's share [T'/tp, ...] of the zero-padded rows;
    backward all-gathers the shares' gradients (every rank's replicated producer needs all)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        return _own_rows(x, dist.get_rank(group), _share(x.shape[0], dist.get_world_size(group)))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather_rows(grad, ctx.group)[:ctx.rows], None


class _GatherRows(torch.autograd.Function):
    """This TP rank's share -> the first `rows` rows of every rank's shares (T, or the padded
    T'); backward keeps this rank's rows of the gradient, which every rank holds whole."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: int, group) -> Tensor:
        ctx.group, ctx.n = group, x.shape[0]
        return _all_gather_rows(x, group)[:rows]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_rows(grad, dist.get_rank(ctx.group), ctx.n), None, None


class SPRMSNorm(RMSNorm):
    """RMSNorm of this rank's rows; the weight sums its gradient over the TP group."""

    tp_group: Any = None

    def forward(self, x: Tensor, ctx: Any = None) -> Tensor:
        kernels, record = norm_kernels(ctx)
        return backend.rms_norm(x, _ReplicateGrad.apply(self.weight, self.tp_group), self.eps, self.float32,
                                kernels=kernels, record=record)


class SPOffsetRMSNorm(OffsetRMSNorm):
    """OffsetRMSNorm of this rank's rows; the weight sums its gradient over the TP group."""

    tp_group: Any = None

    def forward(self, x: Tensor, ctx: Any = None) -> Tensor:
        return offset_rms_norm(x, _ReplicateGrad.apply(self.weight, self.tp_group), self.eps, self.float32)


_SP_NORMS: dict[type, type] = {RMSNorm: SPRMSNorm, OffsetRMSNorm: SPOffsetRMSNorm}


class SPBlock(Block):
    """A block on this rank's share of the rows: norms and residual adds on the share, rows
    gathered for the mixer and the FFN. `sharded_mixer`: the mixer's output projection
    reduce-scatters to the share itself (else its replicated output is cut here)."""

    tp_group: Any = None
    sharded_mixer: bool = False

    def forward(self, x: Tensor, ctx) -> tuple[Tensor, Tensor | None, Tensor | None]:
        group, rows = self.tp_group, ctx.num_rows
        mixed = self.mixer(_GatherRows.apply(self.attn_norm(x, ctx), rows, group), ctx)
        x = x + (mixed if self.sharded_mixer else _SliceRows.apply(mixed, group))
        h = self.ffn_norm(x, ctx)
        if self.ffn_kind == FFNKind.DENSE:
            # every padded row: the row-wise down projection reduce-scatters them to shares
            return x + self.ffn(_GatherRows.apply(h, h.shape[0] * dist.get_world_size(group), group)), None, None
        y, aux, load = self.ffn(_GatherRows.apply(h, rows, group), ctx)
        return x + _SliceRows.apply(y, group), aux, load


class SPHybridModel(HybridModel):
    """The model with its residual stream row-sharded over TP (the embedding's output cut
    to this rank's share by a hook); the final norm's rows gathered for the LM head."""

    tp_group: Any = None

    def forward(self, input_ids_T: Tensor, ctx) -> ModelOutput:
        out = super().forward(input_ids_T, ctx)
        return ModelOutput(_GatherRows.apply(out.hidden_TD, ctx.num_rows, self.tp_group), out.aux_loss,
                           out.expert_load)


def _split_mixer(block: nn.Module) -> bool:
    """Whether `apply_tp` splits this block's mixer (KDA, MLA): its output projection is
    row-wise, reduce-scattered to row shares under sequence parallel."""
    return isinstance(block.mixer, (KDAMixer, MLAMixer))


def _pad_rows_to(multiple: int):
    """A forward pre-hook padding a module's input rows to a multiple of `multiple`."""

    def hook(_module, args):
        x = args[0]
        extra = -x.shape[0] % multiple
        if extra == 0:
            return None
        return (torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]), *args[1:])

    return hook


def apply_sequence_parallel(model: nn.Module, tp: int, group) -> None:
    """Row-shard the residual stream (the module docstring); after `apply_tp`'s projections."""
    if not isinstance(model, HybridModel):
        raise TypeError(f"sequence parallel needs a HybridModel; got {type(model).__name__}")
    model.__class__ = SPHybridModel
    model.tp_group = group
    model.embed.register_forward_hook(lambda _m, _args, out: _SliceRows.apply(out, group))
    # the residual stream's norms only: a norm inside a mixer (MLA's kv_a_norm) sees gathered rows
    for norm in [model.norm, *(n for b in model.layers for n in (b.attn_norm, b.ffn_norm))]:
        norm.__class__ = _SP_NORMS[type(norm)]
        norm.tp_group = group
    for block in model.layers:
        block.__class__ = SPBlock
        block.tp_group = group
        block.sharded_mixer = _split_mixer(block)


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of rows with uneven splits; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        in_splits, out_splits = ctx.splits
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return out, None, None, None


class LocalExperts(nn.Module):
    """This EP rank's routed experts: [E_local, F, D] gate/up and [E_local, D, F] down."""

    def __init__(self, w_gate: Tensor, w_up: Tensor, w_down: Tensor):
        super().__init__()
        self.w_gate = nn.Parameter(w_gate.detach().clone())
        self.w_up = nn.Parameter(w_up.detach().clone())
        self.w_down = nn.Parameter(w_down.detach().clone())

    def forward(self, x_ND: Tensor, expert_N: Tensor, weight_N: Tensor) -> Tensor:
        """Each row through its local expert, scaled by its routing weight (before the down
        projection, as `experts_loop`)."""
        from harts.exec.backend import DEFAULT_KERNELS, Impl, moe_impl

        fn = experts_grouped if moe_impl(x_ND.device, x_ND.dtype, DEFAULT_KERNELS) is Impl.GROUPED else experts_loop
        return fn(x_ND, expert_N[:, None], weight_N[:, None], self.w_gate, self.w_up, self.w_down)


class ExpertParallelMoE(MoE):
    """MoE whose routed experts are spread over the EP group (see the module docstring);
    routing, loads and aux loss are `MoE.forward`'s."""

    ep_group: Any = None
    ep_size: int = 1

    def _experts(self, x_TD: Tensor, top_i_Tk: Tensor, top_w_Tk: Tensor, ctx: object = None) -> Tensor:
        T, k = top_i_Tk.shape
        ep, E = self.ep_size, self.num_experts
        E_local = E // ep
        flat_e = top_i_Tk.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        # assignments per (destination rank, its local expert); exchanged first so each
        # rank knows how many rows of each of its experts every source sends
        send_counts = torch.bincount(flat_e, minlength=E).view(ep, E_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        weight_N1 = top_w_Tk.reshape(-1)[order, None].to(x_TD.dtype)
        send_ND1 = torch.cat([x_TD[order // k], weight_N1], dim=1)
        recv_ND1 = _AllToAll.apply(send_ND1, recv_splits, send_splits, self.ep_group)
        local_e = torch.arange(E_local, device=x_TD.device).repeat(ep)
        expert_N = torch.repeat_interleave(local_e, recv_counts.reshape(-1).to(x_TD.device))
        y_recv = self.experts(recv_ND1[:, :-1], expert_N, recv_ND1[:, -1])
        y_sorted = _AllToAll.apply(y_recv, send_splits, recv_splits, self.ep_group)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return y_sorted[inverse].view(T, k, x_TD.shape[1]).sum(1)


def _moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def apply_ep(model: nn.Module, mesh: DistMesh, shards: dict[str, ShardInfo]) -> bool:
    """Shard every MoE layer's routed experts over "ep": rank r keeps experts
    [r E/ep, (r+1) E/ep) in a `LocalExperts` and dispatches rows by all-to-all."""
    ep = mesh.parallel.ep
    if ep == 1:
        return False
    r = mesh.local_rank("ep")
    group = mesh.group("ep")
    for name, moe in _moe_modules(model):
        n = moe.num_experts // ep
        cut = slice(r * n, (r + 1) * n)
        experts = LocalExperts(moe.w_gate[cut], moe.w_up[cut], moe.w_down[cut])
        del moe.w_gate, moe.w_up, moe.w_down
        moe.__class__ = ExpertParallelMoE
        moe.experts = experts
        moe.ep_group, moe.ep_size = group, ep
        for w in ("w_gate", "w_up", "w_down"):
            shards[f"{name}.experts.{w}"] = ShardInfo(f"{name}.{w}", 0, "ep")
    return True


def _local_slice(module: nn.Module, attr: str, prefix: str, mesh: DistMesh, shards: dict[str, ShardInfo]) -> None:
    """Replace parameter `attr` by this TP rank's contiguous slice along dim 0."""
    tp, r = mesh.parallel.tp, mesh.local_rank("tp")
    p = getattr(module, attr)
    n = p.shape[0] // tp
    setattr(module, attr, nn.Parameter(p.detach()[r * n:(r + 1) * n].clone()))
    shards[f"{prefix}.{attr}"] = ShardInfo(f"{prefix}.{attr}", 0, "tp")


def apply_tp(model: nn.Module, mesh: DistMesh, shards: dict[str, ShardInfo], sequence_parallel: bool = True) -> bool:
    """Column/row-wise TP on the attention, KDA and FFN projections, and with
    `sequence_parallel` the residual stream row-sharded (module docstring)."""
    tp = mesh.parallel.tp
    if tp == 1:
        return False
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp_mesh = mesh.submesh("tp")
    group = mesh.group("tp")
    col, row = ColwiseParallel(), RowwiseParallel()
    # the rows' output projections: reduce-scattered to row shares under sequence parallel
    out_row = RowwiseParallel(output_layouts=Shard(0)) if sequence_parallel else row
    if sequence_parallel:
        for block in getattr(model, "layers", []):
            outs = [block.mixer.o_proj] if _split_mixer(block) else []
            if isinstance(block.ffn, SwiGLU):
                outs.append(block.ffn.down_proj)
            for proj in outs:  # Shard(0) needs rows that divide evenly: padded first
                proj.register_forward_pre_hook(_pad_rows_to(tp), prepend=True)
    dense = {id(b.ffn) for b in getattr(model, "layers", []) if isinstance(b.ffn, SwiGLU)}
    for name, module in model.named_modules():
        if isinstance(module, KDAMixer):
            parallelize_module(module, tp_mesh, {"q_proj": col, "k_proj": col, "v_proj": col, "f_proj.1": col,
                                                 "b_proj": col, "g_proj.1": col, "o_proj": out_row})
            for attr in ("q_conv", "k_conv", "v_conv", "A_log", "dt_bias"):
                _local_slice(module, attr, name, mesh, shards)
            module.num_heads //= tp
            module.o_norm.__class__ = TPGatedRMSNorm
            module.o_norm.tp_group = group
        elif isinstance(module, MLAMixer):
            q = {"q_proj": col} if hasattr(module, "q_proj") else {"q_b_proj": col}
            parallelize_module(module, tp_mesh, {**q, "kv_b_proj": col, "o_proj": out_row})
            module.num_heads //= tp
            C = module.kv_rank

            def sum_k_pe_grad(_mod, _inp, out, C=C):
                # the decoupled key is shared by all heads: each TP rank uses it on its own
                return torch.cat([out[..., :C], _ReplicateGrad.apply(out[..., C:], group)], dim=-1)

            module.kv_a_proj.register_forward_hook(sum_k_pe_grad)
        elif isinstance(module, SwiGLU):
            # a block's dense FFN ends on row shares; a shared expert's output stays whole
            down = out_row if id(module) in dense else row
            parallelize_module(module, tp_mesh, {"gate_proj": col, "up_proj": col, "down_proj": down})
    if sequence_parallel:
        apply_sequence_parallel(model, tp, group)
    return True


def apply_fsdp(model: nn.Module, mesh: DistMesh) -> list[Any]:
    """FSDP2 over "dp", one set of settings for a whole model and a pipeline stage: each
    block a unit (a stage's own blocks), a layer's local experts a unit over "dp_mod_ep"
    (the replicas holding the same experts), the root last.

    - Not resharded after each forward: the step's driver gathers every unit once per step
      and frees it at the end (`ParallelModel.unshard` / `reshard` for a whole model, the
      pipelining runtime's UNSHARD / RESHARD actions for a stage), so every replica issues
      the same collectives however many microbatches it runs.
    - Gradients are summed (divide factor 1): the loss already carries the step's
      denominators. The reduction is a plain SUM collective
      (`set_force_sum_reduction_for_comms`): in float32 and bfloat16 FSDP2 would otherwise
      fold the factor into a PREMUL_SUM, which gloo lacks; a divide factor of 1 then divides
      by nothing, so the sum is the same."""
    if mesh.parallel.dp == 1:
        return []
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh.submesh("dp")
    units = []
    for _, moe in _moe_modules(model):
        if isinstance(moe, ExpertParallelMoE):
            units.append(fully_shard(moe.experts, mesh=mesh.submesh("dp_mod_ep"), reshard_after_forward=False))
    layers = getattr(model, "layers", [])
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        units.append(fully_shard(block, mesh=dp_mesh, reshard_after_forward=False))
    units.append(fully_shard(model, mesh=dp_mesh, reshard_after_forward=False))
    for u in units:
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)
    return units


def apply_pp(model: nn.Module, mesh: DistMesh) -> nn.Module:
    """This rank's pipeline stage over the mesh's "pp" group (`harts.distributed.pipeline.apply_pp`),
    imported only when pp > 1."""
    from harts.distributed.pipeline import apply_pp as pipeline_apply_pp

    return pipeline_apply_pp(model, mesh)


def parallelize(model: HybridModel, mesh: DistMesh, config: ParallelizeConfig | None = None) -> ParallelModel:
    """The one entry point from a whole model to this rank's part of it: PP, then TP (with
    `config.sequence_parallel`, row-sharded norms), then EP, then FSDP (the module
    docstring); each a no-op at degree 1. With pp > 1 `ParallelModel.model` is this rank's
    stage (a `harts.distributed.pipeline.PipelineStageModule`, the model keeping only its
    parameters; stages run with tp = ep = 1), sharded over "dp" by the same `apply_fsdp`.
    `harts.distributed.runner.distributed_trainer` builds the trainer that drives it."""
    config = config if config is not None else ParallelizeConfig()
    shards: dict[str, ShardInfo] = {}
    applied = []
    if mesh.parallel.pp > 1:
        if mesh.parallel.tp > 1 or mesh.parallel.ep > 1:
            raise ValueError(f"{mesh.parallel.spec()}: pipeline stages run with data parallelism only (tp=1, ep=1)")
        model = apply_pp(model, mesh)
        applied.append("pp")
    if apply_tp(model, mesh, shards, config.sequence_parallel):
        applied.append("tp")
        if config.sequence_parallel:
            applied.append("sp")
    if apply_ep(model, mesh, shards):
        applied.append("ep")
    units = apply_fsdp(model, mesh)
    if units:
        applied.append("fsdp")
    return ParallelModel(model, mesh, shards, units, applied)
