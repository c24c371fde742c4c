"""KDA on the GPU: fla-core's chunkwise kernels, plus the boundary-state handoff they lack.

Legend: T packed tokens, N sequences, H heads, K key / V value channels, B chunk size,
NT chunks of all sequences, M handed-off boundary states.

`chunk_kda_fast` has the contract of `harts.exec.ops.kda.chunk_kda` (packed [T, H, *]
tensors, `cu_seqlens`, `initial_state`, `KDAOutput`):

- without `output_chunk_states` (the packed baseline, and the tree's no-replay rounds that
  hand over final states) it is fla's `chunk_kda` as is: fla takes `cu_seqlens` and
  `initial_state`, returns the final state, and its backward returns dh0 and consumes dht;
- with `output_chunk_states` (the tree's replay rounds) it runs fla's forward pieces with
  the state history `h` kept in fp32 (fla stores it in the input dtype and drops it), so the
  state after every full chunk is exact: in bf16 too, a consumer starting from it is
  bit-identical to the sequence running on (fla's o kernel casts h to the query dtype on
  load, so the outputs equal fla's). The backward is fla's, except the reverse state
  recurrence, which is our Triton kernel (`kda_dhu`) that adds each boundary state's
  incoming gradient where the state was produced. One call per round: the planner's
  minimum round count holds on the GPU path.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from harts.exec.gpu.kda_dhu import bwd_dhu_inject
from harts.exec.ops.kda.chunk import KDAOutput


def _fla() -> dict:
    """fla-core's KDA pieces (imported lazily: CPU-only machines never load them)."""
    from fla.ops.common import chunk_delta_h
    from fla.ops.gla import chunk as gla_chunk
    from fla.ops.kda import chunk_bwd, chunk_intra, wy_fast
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices, prepare_chunk_offsets
    from fla.ops.utils.constant import RCP_LN2

    return {
        "chunk_gated_delta_rule_fwd_h": chunk_delta_h.chunk_gated_delta_rule_fwd_h,
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
        "chunk_gla_fwd_o_gk": gla_chunk.chunk_gla_fwd_o_gk,
        "chunk_kda_bwd_dAv": chunk_bwd.chunk_kda_bwd_dAv,
        "chunk_kda_bwd_wy_dqkg_fused": chunk_bwd.chunk_kda_bwd_wy_dqkg_fused,
        "chunk_kda_bwd_intra": chunk_intra.chunk_kda_bwd_intra,
        "chunk_kda_fwd_intra": chunk_intra.chunk_kda_fwd_intra,
        "recompute_w_u_fwd": wy_fast.recompute_w_u_fwd,
        "chunk_local_cumsum": chunk_local_cumsum,
        "prepare_chunk_indices": prepare_chunk_indices,
        "prepare_chunk_offsets": prepare_chunk_offsets,
        "RCP_LN2": RCP_LN2,
    }


def _fwd_h_fp32(f, kg, w, u, gk, h0, cu, chunk_offsets, num_chunks, B):
    """fla's forward state kernel writing its state history in fp32."""
    _, T, H, K = kg.shape
    V = u.shape[-1]
    N = cu.numel() - 1
    h = torch.empty(1, num_chunks, H, K, V, dtype=torch.float32, device=kg.device)
    final = torch.zeros(N, H, K, V, dtype=torch.float32, device=kg.device)
    v_new = torch.empty_like(u)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]) * N * H,)

    f["chunk_gated_delta_rule_fwd_kernel_h_blockdim64"][grid](
        k=kg, v=u, w=w, v_new=v_new, g=None, gk=gk, h=h, h0=h0, ht=final, cu_seqlens=cu,
        chunk_offsets=chunk_offsets, T=T, H=H, HV=H, K=K, V=V, BT=B, STATE_V_FIRST=False,
    )
    return h, v_new, final


def boundary_index(cu_seqlens: np.ndarray, chunk_size: int) -> dict[str, np.ndarray]:
    """Host-side bookkeeping of the chunk grid of a packed call.

    For the state after the first c = (j+1)B tokens of sequence n (every full chunk j):
      chunk: its global chunk id (where its gradient is injected);
      source: its row in cat([h (state entering each chunk), final states]): the state
        entering chunk j+1, or the final state when c is the sequence's end.
    last_chunk [N]: each sequence's last chunk (where dht enters; -1 for empty sequences).
    """
    B = chunk_size
    lens = np.diff(cu_seqlens)
    nt = (lens + B - 1) // B
    offs = np.concatenate([[0], np.cumsum(nt)])
    num_full = lens // B
    n_M = np.repeat(np.arange(lens.size), num_full)
    j_M = np.arange(num_full.sum()) - np.repeat(np.cumsum(num_full) - num_full, num_full)
    chunk = offs[:-1][n_M] + j_M
    inside = (j_M + 1) < nt[n_M]
    source = np.where(inside, chunk + 1, offs[-1] + n_M)
    last = np.where(nt > 0, offs[1:] - 1, -1)
    state_offsets = np.concatenate([[0], np.cumsum(num_full)])
    return dict(chunk=chunk.astype(np.int64), source=source.astype(np.int64), last_chunk=last.astype(np.int64),
                num_chunks=int(offs[-1]), state_offsets=state_offsets.astype(np.int64))


class _ChunkKDAStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, cu, B, chunk_M, source_M, last_N, num_chunks):
        f = _fla()
        chunk_indices = f["prepare_chunk_indices"](cu, B)
        chunk_offsets = f["prepare_chunk_offsets"](cu, B)
        g_cum = f["chunk_local_cumsum"](g=g, scale=f["RCP_LN2"], chunk_size=B, cu_seqlens=cu, chunk_indices=chunk_indices)
        w, u, _qg, kg, Aqk, Akk = f["chunk_kda_fwd_intra"](
            q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, cu_seqlens=cu, chunk_size=B,
            chunk_indices=chunk_indices, safe_gate=False, disable_recompute=False,
        )
        h, v_new, final = _fwd_h_fp32(f, kg, w, u, g_cum, h0, cu, chunk_offsets, num_chunks, B)
        o = f["chunk_gla_fwd_o_gk"](
            q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, cu_seqlens=cu, chunk_size=B,
            chunk_indices=chunk_indices,
        )
        states = torch.cat([h[0], final])[source_M]
        ctx.save_for_backward(q, k, v, g_cum, beta, Aqk, Akk, h0, cu, chunk_indices, chunk_offsets,
                              chunk_M, last_N)
        ctx.scale, ctx.B, ctx.num_chunks, ctx.g_dtype = scale, B, num_chunks, g.dtype
        return o, final, states

    @staticmethod
    def backward(ctx, do, dht, dstates):
        f = _fla()
        q, k, v, g, beta, Aqk, Akk, h0, cu, chunk_indices, chunk_offsets, chunk_M, last_N = ctx.saved_tensors
        scale, B, NT = ctx.scale, ctx.B, ctx.num_chunks
        _, _, H, K = q.shape
        V = v.shape[-1]
        do = do.contiguous()
        dh_ext = None
        if dstates is not None or dht is not None:
            dh_ext = torch.zeros(NT, H, K, V, dtype=torch.float32, device=q.device)
            if dstates is not None and chunk_M.numel():
                dh_ext.index_add_(0, chunk_M, dstates.float())
            if dht is not None:
                has = last_N >= 0
                dh_ext.index_add_(0, last_N[has], dht.float()[has])
        w, u, qg, kg = f["recompute_w_u_fwd"](
            q=q, k=k, v=v, beta=beta, A=Akk, gk=g, cu_seqlens=cu, chunk_indices=chunk_indices,
        )
        h, v_new, _ = f["chunk_gated_delta_rule_fwd_h"](
            k=kg, w=w, u=u, gk=g, initial_state=h0, output_final_state=False, cu_seqlens=cu,
            chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, chunk_size=B,
        )
        dAqk, dv = f["chunk_kda_bwd_dAv"](
            q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu, chunk_size=B,
            chunk_indices=chunk_indices,
        )
        dh, dh0, dv = bwd_dhu_inject(
            qg, kg, w, g, do, dv, dh_ext, cu, chunk_offsets, NT, scale, chunk_size=B, with_dh0=h0 is not None,
        )
        dq, dk, dv, db, dg, dAkk = f["chunk_kda_bwd_wy_dqkg_fused"](
            q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv, scale=scale,
            cu_seqlens=cu, chunk_size=B, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        )
        dq, dk, db, dg = f["chunk_kda_bwd_intra"](
            q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg,
            cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=B, safe_gate=False,
        )
        dg = f["chunk_local_cumsum"](dg, chunk_size=B, reverse=True, cu_seqlens=cu, chunk_indices=chunk_indices)
        return (dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), dh0, None, None, None, None, None, None, None)


def chunk_kda_fast(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    output_final_state: bool = True,
    output_chunk_states: bool = False,
) -> KDAOutput:
    """`harts.exec.ops.kda.chunk_kda` on fla-core's kernels (CUDA; fp32, bf16 or fp16 inputs)."""
    T, H, K = q.shape
    if scale is None:
        scale = K**-0.5
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], dtype=torch.int64)
    cu_host = torch.as_tensor(cu_seqlens).to(torch.int64).cpu()
    cu = cu_host.to(q.device)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    q4, k4, v4, g4, b3 = (x.contiguous()[None] for x in (q, k, v, g, beta))
    if not output_chunk_states:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        o, final = fla_chunk_kda(
            q4, k4, v4, g4, b3, scale=scale, initial_state=h0, output_final_state=output_final_state,
            cu_seqlens=cu, cu_seqlens_cpu=cu_host, chunk_size=chunk_size,
        )
        return KDAOutput(o[0].to(v.dtype), final, None, None)
    ix = boundary_index(cu_host.numpy(), chunk_size)
    dev = q.device
    o, final, states = _ChunkKDAStates.apply(
        q4, k4, v4, g4, b3, h0, scale, cu, chunk_size,
        torch.as_tensor(ix["chunk"], device=dev), torch.as_tensor(ix["source"], device=dev),
        torch.as_tensor(ix["last_chunk"], device=dev), ix["num_chunks"],
    )
    return KDAOutput(o[0].to(v.dtype), final if output_final_state else None, states,
                     torch.as_tensor(ix["state_offsets"], device=dev))
