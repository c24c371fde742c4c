"""KDA on the GPU: fla-core's chunkwise kernels, plus the boundary-state handoff they lack.

Legend: T packed tokens, N sequences, H heads, K key / V value channels, B chunk size,
NT chunks of all sequences, M boundary states (after every full chunk), U of them selected.

`chunk_kda_fast` has the contract of `harts.exec.ops.kda.chunk_kda` (packed [T, H, *]
tensors, `cu_seqlens`, `initial_state`, `chunk_state_index`, `KDAOutput`):

- without `output_chunk_states` (the packed baseline, and the tree's no-replay rounds that
  hand over final states), or with an empty `chunk_state_index` (a replay round whose
  states nobody reads), it computes fla's `chunk_kda`'s bits with fla's kernels (initial
  state in, final state out, dh0 and dht in the backward), through the states path below
  with nothing selected: fla's entry point copies its chunk grid from pageable host memory,
  a synchronisation per new `cu_seqlens`, where this path uploads the host copy's
  asynchronously;
- with `output_chunk_states` (the tree's replay rounds) it runs fla's forward pieces with
  the state history `h` kept in fp32 (fla stores it in the input dtype and drops it), so the
  state after every full chunk is exact: in bf16 too, a consumer starting from it is
  bit-identical to the sequence running on (fla's o kernel casts h to the query dtype on
  load, so the outputs equal fla's). The backward is fla's, except the reverse state
  recurrence, which is our Triton kernel (`dhu`) that adds each boundary state's
  incoming gradient where the state was produced. One call per round: the planner's
  minimum round count holds on the GPU path.

Sparse handoff: a tree round hands on only the few states that later rounds or consumer
microbatches start from, named by `chunk_state_index` (U of the M). The forward gathers
just those U states from `h` and the final states (never all M), and the backward builds
the kernel's injection on the device as a compact [U', H, K, V] (U' <= U + N: the selected
states' gradients plus each sequence's final-state gradient at its last chunk, index_add
so gradients meeting at one chunk add) with a per-chunk row map, instead of a dense
[NT, H, K, V] buffer. Index bookkeeping is host-side numpy on the host copy of cu_seqlens.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
from triton.runtime.errors import OutOfResources

from harts.config.kernels import KernelConfig
from harts.exec.ops.kda.chunk import KDAOutput, check_chunk_state_index
from harts.exec.ops.kda.dhu import bwd_dhu_inject
from harts.exec.ops.record import KernelRecord, report_fallback
from harts.exec.transfer import to_device

DEFAULT_KERNELS = KernelConfig()


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
        "chunk_gated_delta_rule_bwd_dhu": chunk_delta_h.chunk_gated_delta_rule_bwd_dhu,
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


def fwd_h_config(num_seqs: int, heads: int, v_dim: int, sms: int | None,
                 kernels: KernelConfig = DEFAULT_KERNELS) -> tuple[int, int, int] | None:
    """The launch config (BV, num_warps, num_stages) of fla's forward state kernel for a
    call of `num_seqs` sequences, or None for fla's own (autotuned) choice.

    Like the state backward (`dhu.value_block`), each program walks all chunks of one
    (sequence, head, value block) in turn, so a round of a few long sequences (a tree's
    root chain, its replay rounds) runs num_seqs x heads x V / BV programs on 132 SMs: 64 at
    one sequence with fla's BV 32. There a smaller value block (which fla's configs lack)
    gives more programs. Measured on the H200 (132 SMs; H = 16, K = V = 128; ms for fla's
    launch under --no-autotune (BV 32, 2 warps, 2 stages) / BV 16, 4 warps, 3 stages / the
    best config; benchmarks/results/kda/2026-11-29-f03a66c-fwdhbv.json): one 38.7k sequence
    1.79 / 1.10 / 1.10, two 1.47 / 0.91 / 0.91, three 1.31 / 0.86 / 0.85 (BV 32, 4, 3); at
    sixteen of 2k fla's own configs hold the best (BV 64, 4 warps, 2 stages: 0.38), so rounds of more
    than `kernels.kda_fwd_h_programs_per_sm` x sms programs at BV 32 keep fla's launch, as
    the expanded baseline does. `kernels.kda_fwd_h` overrides ("fla" or "BV,warps,stages")."""
    launch = kernels.kda_fwd_h_launch
    if launch == "fla":
        return None
    if launch != "auto":
        return launch
    if not sms or num_seqs * heads * triton.cdiv(v_dim, 32) > kernels.kda_fwd_h_programs_per_sm * sms:
        return None
    return 16, 4, 3


def _fwd_h(f, kg, w, u, gk, h0, cu, chunk_offsets, num_chunks, B, *, h_dtype, with_final,
           kernels: KernelConfig = DEFAULT_KERNELS, record: KernelRecord | None = None):
    """fla's forward state kernel: (h [1, NT, H, K, V] in h_dtype, v_new like u, final fp32
    [N, H, K, V] or None), launched with `fwd_h_config`'s config where it names one. Where
    fla does not take that launch, this call runs fla's own and reports the fallback."""
    _, T, H, K = kg.shape
    V = u.shape[-1]
    N = cu.numel() - 1
    h = torch.empty(1, num_chunks, H, K, V, dtype=h_dtype, device=kg.device)
    final = torch.zeros(N, H, K, V, dtype=torch.float32, device=kg.device) if with_final else None
    v_new = torch.empty_like(u)
    kernel = f["chunk_gated_delta_rule_fwd_kernel_h_blockdim64"]
    args = dict(k=kg, v=u, w=w, v_new=v_new, g=None, gk=gk, h=h, h0=h0, ht=final, cu_seqlens=cu,
                chunk_offsets=chunk_offsets, T=T, H=H, HV=H, K=K, V=V, BT=B, STATE_V_FIRST=False)
    sms = torch.cuda.get_device_properties(kg.device).multi_processor_count if kg.is_cuda else None
    config = fwd_h_config(N, H, V, sms, kernels)
    if config is not None:
        # past fla's heuristics and autotuner (kernel.fn.fn: the jitted function), so the
        # constexprs its heuristics would set are passed here: tied to fla-core 0.6.0's
        # signature, so any other fla that does not take these arguments gets its own launch
        bv, warps, stages = config
        try:
            kernel.fn.fn[(triton.cdiv(V, bv) * N * H,)](
                **args, BV=bv, USE_G=False, USE_GK=True, USE_INITIAL_STATE=h0 is not None,
                STORE_FINAL_STATE=with_final, SAVE_NEW_VALUE=True, IS_VARLEN=True,
                num_warps=warps, num_stages=stages)
            return h, v_new, final
        except (AttributeError, KeyError, TypeError, ValueError, OutOfResources) as err:
            report_fallback(record, "kda_fwd_h", "BV={},warps={},stages={}".format(*config), "fla",
                            f"fla's forward state kernel did not take the explicit launch config "
                            f"({type(err).__name__}: {err}); this call used fla's own launch")
    kernel[lambda meta: (triton.cdiv(V, meta["BV"]) * N * H,)](**args)
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


def chunk_index_pairs(cu_seqlens: np.ndarray, chunk_size: int) -> np.ndarray:
    """int64 [NT, 2]: (sequence, chunk within it) of every chunk, in order: what fla's
    `prepare_chunk_indices` returns, computed from a host copy of cu_seqlens."""
    nt = (np.diff(np.asarray(cu_seqlens, dtype=np.int64)) + chunk_size - 1) // chunk_size
    seq = np.repeat(np.arange(nt.size, dtype=np.int64), nt)
    within = np.arange(seq.size, dtype=np.int64) - np.repeat(np.cumsum(nt) - nt, nt)
    return np.stack([seq, within], axis=1)


def state_gather(source: np.ndarray, num_chunks: int) -> dict[str, np.ndarray]:
    """Where each selected state comes from: `source` rows below num_chunks are in h (the
    state entering each chunk), the others are final states. Returns the positions and rows
    of both parts, so the forward gathers U states without concatenating all NT + N."""
    in_h = source < num_chunks
    return dict(pos_h=np.flatnonzero(in_h), src_h=source[in_h],
                pos_f=np.flatnonzero(~in_h), src_f=source[~in_h] - num_chunks)


def build_injection(dstates: torch.Tensor | None, dht: torch.Tensor | None, chunk_sel: np.ndarray,
                    last_chunk: np.ndarray, num_chunks: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The compact injection for `bwd_dhu_inject`: (ext fp32 [U', H, K, V], ext_idx int64
    [NT]), or (None, None) when no gradient enters.

    The selected states' gradients `dstates` [U] enter after their chunks `chunk_sel` [U],
    each sequence's final-state gradient `dht` [N] after its last chunk `last_chunk` [N]
    (-1: an empty sequence, which has no chunk; the backward adds its dht to dh0 itself).
    ext has one row per chunk that receives anything;
    the state after a sequence's last full chunk can sit at the same chunk as its final
    state (or be selected twice), and index_add makes such gradients add.
    """
    chunks: list[np.ndarray] = []
    grads: list[torch.Tensor] = []
    has = np.zeros(0, np.int64)
    if dstates is not None and chunk_sel.size:
        chunks.append(chunk_sel)
        grads.append(dstates)
    # the non-empty sequences' final-state gradients, subset on the device below
    final_subset = False
    if dht is not None:
        has = np.flatnonzero(last_chunk >= 0)
        if has.size:
            chunks.append(last_chunk[has])
            grads.append(dht)
            final_subset = has.size < dht.shape[0]
    if not chunks:
        return None, None
    used, row = np.unique(np.concatenate(chunks), return_inverse=True)
    ext_idx = np.full(num_chunks, -1, np.int64)
    ext_idx[used] = np.arange(used.size)
    # one host-to-device copy for all index arrays
    host = [ext_idx, row.reshape(-1), has]
    dev = grads[0].device
    ext_idx_dev, row_dev, has_dev = to_device(np.concatenate(host), dev).split([x.size for x in host])
    ext = torch.zeros(used.size, *grads[0].shape[1:], dtype=torch.float32, device=dev)
    if final_subset:
        grads[-1] = dht[has_dev]
    start = 0
    for c, grad in zip(chunks, grads, strict=True):
        ext.index_add_(0, row_dev[start : start + c.size], grad.float())
        start += c.size
    return ext, ext_idx_dev


class _ChunkKDAStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, cu, B, chunk_sel, gather, last_N, num_chunks, cu_host, launch):
        ctx.set_materialize_grads(False)
        f = _fla()
        # fla's prepare_chunk_indices on a device cu_seqlens reads its sum on the host (a
        # stream sync); the same (sequence, chunk) pairs from the host copy, copied async
        chunk_indices = to_device(chunk_index_pairs(cu_host, B), q.device)
        chunk_offsets = f["prepare_chunk_offsets"](cu, B)
        g_cum = f["chunk_local_cumsum"](g=g, scale=f["RCP_LN2"], chunk_size=B, cu_seqlens=cu, chunk_indices=chunk_indices)
        w, u, _qg, kg, Aqk, Akk = f["chunk_kda_fwd_intra"](
            q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, cu_seqlens=cu, chunk_size=B,
            chunk_indices=chunk_indices, safe_gate=False, disable_recompute=False,
        )
        # h in float32 where states are selected from it (handed on exactly), else in the
        # inputs' dtype as fla's forward keeps it (the output kernel reads it at that width)
        h, v_new, final = _fwd_h(f, kg, w, u, g_cum, h0, cu, chunk_offsets, num_chunks, B,
                                 h_dtype=torch.float32 if chunk_sel.size else k.dtype, with_final=True,
                                 kernels=launch[0], record=launch[1])
        o = f["chunk_gla_fwd_o_gk"](
            q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, cu_seqlens=cu, chunk_size=B,
            chunk_indices=chunk_indices,
        )
        # only the selected states: U of the NT + N in h and final
        host = [gather["pos_h"], gather["src_h"], gather["pos_f"], gather["src_f"]]
        flat = to_device(np.concatenate(host), q.device)
        pos_h, src_h, pos_f, src_f = flat.split([x.size for x in host])
        states = final.new_empty(chunk_sel.size, *final.shape[1:])
        if pos_h.numel():
            states[pos_h] = h[0][src_h]
        if pos_f.numel():
            states[pos_f] = final[src_f]
        ctx.save_for_backward(q, k, v, g_cum, beta, Aqk, Akk, h0, cu, chunk_indices, chunk_offsets)
        ctx.scale, ctx.B, ctx.num_chunks, ctx.g_dtype = scale, B, num_chunks, g.dtype
        ctx.chunk_sel, ctx.last_N, ctx.launch = chunk_sel, last_N, launch
        # a call that selects no state, at fla's forward-state launch (many sequences): its
        # state backward is fla's own kernel, as when such calls ran fla's chunk_kda
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else None
        ctx.fla_dhu = chunk_sel.size == 0 and fwd_h_config(cu.numel() - 1, q.shape[2], v.shape[-1], sms,
                                                           launch[0]) is None
        return o, final, states

    @staticmethod
    def backward(ctx, do, dht, dstates):
        f = _fla()
        q, k, v, g, beta, Aqk, Akk, h0, cu, chunk_indices, chunk_offsets = ctx.saved_tensors
        scale, B, NT = ctx.scale, ctx.B, ctx.num_chunks
        # grads are not materialised: None where an output took no part in the loss
        do = torch.zeros_like(v) if do is None else do.contiguous()
        w, u, qg, kg = f["recompute_w_u_fwd"](
            q=q, k=k, v=v, beta=beta, A=Akk, gk=g, cu_seqlens=cu, chunk_indices=chunk_indices,
        )
        h, v_new, _ = _fwd_h(f, kg, w, u, g, h0, cu, chunk_offsets, NT, B, h_dtype=k.dtype, with_final=False,
                             kernels=ctx.launch[0], record=ctx.launch[1])
        dAqk, dv = f["chunk_kda_bwd_dAv"](
            q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu, chunk_size=B,
            chunk_indices=chunk_indices,
        )
        if ctx.fla_dhu:
            dh, dh0, dv = f["chunk_gated_delta_rule_bwd_dhu"](
                q=qg, k=kg, w=w, gk=g, h0=h0, dht=dht, do=do, dv=dv, scale=scale, cu_seqlens=cu, chunk_size=B,
                chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
            )
        else:
            ext, ext_idx = build_injection(dstates, dht, ctx.chunk_sel, ctx.last_N, NT)
            dh, dh0, dv = bwd_dhu_inject(
                qg, kg, w, g, do, dv, ext, ext_idx, cu, chunk_offsets, NT, scale, chunk_size=B,
                with_dh0=h0 is not None,
            )
            empty = np.flatnonzero(ctx.last_N < 0)
            if dht is not None and dh0 is not None and empty.size:
                # an empty sequence's final state is its initial state (the kernel has no
                # chunk to inject its gradient at)
                at = to_device(empty, dh0.device)
                dh0[at] += dht[at].float()
        dq, dk, dv, db, dg, dAkk = f["chunk_kda_bwd_wy_dqkg_fused"](
            q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv, scale=scale,
            cu_seqlens=cu, chunk_size=B, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
        )
        dq, dk, db, dg = f["chunk_kda_bwd_intra"](
            q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg,
            cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=B, safe_gate=False,
        )
        dg = f["chunk_local_cumsum"](dg, chunk_size=B, reverse=True, cu_seqlens=cu, chunk_indices=chunk_indices)
        return (dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), dh0, None, None, None, None, None, None, None,
                None, None)


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
    chunk_state_index: torch.Tensor | np.ndarray | None = None,
    cu_seqlens_cpu: torch.Tensor | np.ndarray | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
    record: KernelRecord | None = None,
) -> KDAOutput:
    """`harts.exec.ops.kda.chunk_kda` on fla-core's kernels (CUDA; fp32, bf16 or fp16 inputs).

    chunk_state_index: which of the M boundary states to return (host array preferred: a
    CUDA tensor is copied to the host); only those are gathered, and only their gradients
    enter the backward. An empty index hands on no state (fla's plain chunk_kda's bits).
    cu_seqlens_cpu: a host copy of cu_seqlens (saves a device-to-host sync per call).
    kernels: the forward state kernel's launch (`fwd_h_config`); record: where a launch
    fallback is reported.
    """
    if chunk_state_index is not None and not output_chunk_states:
        raise ValueError("chunk_state_index needs output_chunk_states=True")
    T, H, K = q.shape
    if scale is None:
        scale = K**-0.5
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], dtype=torch.int64)
    # host copy for the bookkeeping: given (no sync), or copied from cu_seqlens
    cu_host = torch.as_tensor(cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).to(torch.int64).cpu()
    on_device = torch.is_tensor(cu_seqlens) and cu_seqlens.device == q.device
    cu = cu_seqlens.to(torch.int64) if on_device else to_device(cu_host, q.device)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    q4, k4, v4, g4, b3 = (x.contiguous()[None] for x in (q, k, v, g, beta))
    dev = q.device
    ix = boundary_index(cu_host.numpy(), chunk_size) if output_chunk_states else None
    sel = None
    if output_chunk_states:
        num_states = int(ix["chunk"].size)
        sel = (np.arange(num_states) if chunk_state_index is None
               else check_chunk_state_index(chunk_state_index, num_states))
    if not output_chunk_states or sel.size == 0:
        # no state handed on: the same kernels as fla's chunk_kda, and the same bits
        # (tests/cuda/test_kda.py), through the states path with nothing selected. fla's own
        # entry point builds its chunk grid with a copy from pageable host memory, a stream
        # synchronisation for every new cu_seqlens (one per microbatch, in the middle of its
        # forward: the device drains and the host's lead over it is lost); here the grid
        # comes from the host copy, uploaded asynchronously. Where a round of few sequences
        # leaves SMs idle, the forward state kernel runs at `fwd_h_config`'s launch and the
        # state backward is `dhu.bwd_dhu_inject`; elsewhere both are fla's own.
        ix = ix if ix is not None else boundary_index(cu_host.numpy(), chunk_size)
        none = np.zeros(0, np.int64)
        o, final, _ = _ChunkKDAStates.apply(
            q4, k4, v4, g4, b3, h0, scale, cu, chunk_size, none, state_gather(none, ix["num_chunks"]),
            ix["last_chunk"], ix["num_chunks"], cu_host.numpy(), (kernels, record),
        )
        return KDAOutput(o[0].to(v.dtype), final if output_final_state else None,
                         final[:0] if output_chunk_states else None,
                         to_device(ix["state_offsets"], dev) if output_chunk_states else None)
    o, final, states = _ChunkKDAStates.apply(
        q4, k4, v4, g4, b3, h0, scale, cu, chunk_size, ix["chunk"][sel],
        state_gather(ix["source"][sel], ix["num_chunks"]), ix["last_chunk"], ix["num_chunks"], cu_host.numpy(),
        (kernels, record),
    )
    return KDAOutput(o[0].to(v.dtype), final if output_final_state else None, states,
                     to_device(ix["state_offsets"], dev))
