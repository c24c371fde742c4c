"""Triton kernel: the backward state recurrence of chunkwise KDA with gradients injected at
chunk boundaries (what fla-core's `chunk_gated_delta_rule_bwd_dhu` lacks).

Legend: T packed tokens, N sequences, H heads, K key / V value channels, BT chunk size,
NT chunks of all sequences (sequence n owns chunks chunk_offsets[n]:chunk_offsets[n+1]).

fla's kernel seeds the reverse recurrence with dL/dS at each sequence's end (`dht`) only.
A tree's replay rounds also hand the states at *inner* chunk boundaries to later rounds,
and their gradients must enter the recurrence where those states were produced. With
dS_c = dL/d(state after chunk c), the recurrence over chunks, last to first, is

    dS_c   += ext[ext_idx[c]]                    (if ext_idx[c] >= 0: that state's consumers)
    dh[c]   = dS_c                               (what the dq/dk/dw kernels read)
    dv2_c   = kg_c dS_c + dv_c                   (value gradient through the state)
    dS_prev = Diag(2^{gk_last_c}) dS_c + scale * qg_c^T do_c - w_c^T dv2_c

with qg, kg, w, gk (log2-space cumulative gate) exactly as fla's KDA forward produces them,
so this kernel drops into fla's backward in place of `chunk_gated_delta_rule_bwd_dhu`
(`dht` becomes the injection at each sequence's last chunk).

The injection is sparse: a round hands on only the few boundary states later rounds or
consumer microbatches start from, so the injected gradients come as a compact fp32
`ext` [U, H, K, V] (one row per chunk that receives any: boundary-state and final-state
gradients at the same chunk already summed) plus a per-chunk map `ext_idx` [NT] (-1 where
nothing enters). Memory traffic scales with U, not with NT: no dense [NT, H, K, V]
buffer is zero-filled, written or read; a chunk without injection costs one scalar load
and a fully masked tile load. One program per (value block, sequence x head) walks its
chunks in reverse; the state gradient [K, BV] stays in fp32 registers. No loop variable
is cast (`.to`), so the kernel also runs under TRITON_INTERPRET=1 on CPU, where the tests
check it against `bwd_dhu_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources


@triton.jit
def _bwd_dhu_inject_kernel(
    q, k, w, gk, ext, ext_idx, do, dv, dh, dv2, dh0, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, HAS_EXT: tl.constexpr, USE_H0: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NT = (T + BT - 1) // BT
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    for it in range(0, NT):
        i_t = NT - 1 - it
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        row = bos + o_t
        state = ((boh + i_t) * H + i_h) * (K * V)
        if HAS_EXT:
            # ext_idx is int64, so the compact row offset cannot overflow; the mask is built
            # as a block (a scalar bool & a block mask fails under the interpreter)
            e = tl.load(ext_idx + boh + i_t)
            row_e = (tl.maximum(e, 0) * H + i_h) * (K * V)
            m_e = m_kv & ((tl.zeros([BK, BV], dtype=tl.int64) + e) >= 0)
            b_dh += tl.load(ext + row_e + off_kv, mask=m_e, other=0.0)
        tl.store(dh + state + off_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)

        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        off_tk = (row[:, None] * H + i_h) * K + o_k[None, :]
        off_tv = (row[:, None] * H + i_h) * V + o_v[None, :]
        b_k = tl.load(k + off_tk, mask=m_tk, other=0.0)
        b_dv = tl.dot(b_k, b_dh.to(b_k.dtype))
        b_dv += tl.load(dv + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(dv2 + off_tv, b_dv.to(dv2.dtype.element_ty), mask=m_tv)

        last = tl.minimum((i_t + 1) * BT, T) - 1
        b_gl = tl.load(gk + ((bos + last) * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_dh *= tl.exp2(b_gl)[:, None]

        off_kt = (row[None, :] * H + i_h) * K + o_k[:, None]
        m_kt = m_k[:, None] & m_t[None, :]
        b_q = tl.load(q + off_kt, mask=m_kt, other=0.0)
        b_w = tl.load(w + off_kt, mask=m_kt, other=0.0)
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        b_dh += tl.dot(b_q, b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))

    if USE_H0:
        tl.store(dh0 + i_nh * (K * V) + off_kv, b_dh.to(dh0.dtype.element_ty), mask=m_kv)


def value_block(num_seqs: int, heads: int, v_dim: int, sms: int | None) -> int:
    """The value block: the largest of 64 / 32 / 16 that still gives about one program per
    SM (>= 0.9 x sms programs), 64 when the SM count is unknown. Each program walks all its
    sequence's chunks in turn, so a round of a few long sequences (a tree's root chain)
    with 64-wide blocks leaves most SMs idle. Measured on the H200 (132 SMs; H = 16, K = V
    = 128, ms for BV 64 / 32 / 16; benchmarks/results/kda/2026-11-29-eda63d2-dhubv.json): one 38.7k
    sequence 2.30 / 1.77 / 1.64, two 1.87 / 1.45 / 1.67, three 1.57 / 1.21 / 1.41, sixteen
    of 2k 0.64 / 0.85 / 1.26 (fla's own kernel: 1.77, 1.64, 1.55, -); earlier, BV 64 beat 32
    at 16 and 64 sequences of the replay path (1.169-1.19x fla against 1.179-1.23x)."""
    if not sms:
        return 64
    for bv in (64, 32):
        if num_seqs * heads * triton.cdiv(v_dim, bv) >= 0.9 * sms:
            return bv
    return 16


# launches that did not fit the device, by (device, dtype, K, V, chunk, BV, stages): their errors
_DOES_NOT_FIT: dict[tuple, OutOfResources] = {}


def bwd_dhu_inject(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, gk: torch.Tensor, do: torch.Tensor,
    dv: torch.Tensor, ext: torch.Tensor | None, ext_idx: torch.Tensor | None,
    cu_seqlens: torch.Tensor, chunk_offsets: torch.Tensor, num_chunks: int, scale: float, *,
    chunk_size: int = 64, with_dh0: bool = True, block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dh [1, NT, H, K, V] in q's dtype, dh0 [N, H, K, V] fp32 or None, dv2 like dv).

    q, k, w, gk: [1, T, H, K] (fla's qg, kg, w and log2 cumulative gate); do, dv: [1, T, H, V];
    ext: fp32 [U, H, K, V], the injected gradients w.r.t. states after chunks, and ext_idx:
    int [NT], the row of ext injected after chunk c (-1: none). ext None: nothing injected.
    """
    _, T, H, K = q.shape
    V = do.shape[-1]
    N = cu_seqlens.numel() - 1
    BK = max(16, triton.next_power_of_2(K))
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else None
    BV = block_v or value_block(N, H, V, sms)
    BV = min(BV, max(16, triton.next_power_of_2(V)))
    dh = q.new_empty(1, num_chunks, H, K, V)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if with_dh0 else None
    dv2 = torch.empty_like(dv)
    if ext is not None:
        if ext_idx is None or ext_idx.numel() != num_chunks:
            raise ValueError(f"ext needs ext_idx with one entry per chunk ({num_chunks})")
        ext = ext.float().contiguous()
        ext_idx = ext_idx.to(torch.int64).contiguous()
    for bv, stages in launch_configs(BV):
        key = (q.device.index, q.dtype, K, V, chunk_size, bv, stages)
        if key in _DOES_NOT_FIT:
            continue
        grid = (triton.cdiv(V, bv), N * H)
        try:
            _bwd_dhu_inject_kernel[grid](
                q, k, w, gk, ext, ext_idx, do, dv, dh, dv2, dh0, cu_seqlens, chunk_offsets, scale,
                H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=bv, HAS_EXT=ext is not None, USE_H0=with_dh0,
                num_warps=4, **({} if stages is None else {"num_stages": stages}),
            )
        except OutOfResources as err:  # raised before the launch: nothing was written
            _DOES_NOT_FIT[key] = err
            continue
        return dh, dh0, dv2
    raise _DOES_NOT_FIT[key]  # the narrowest launch's own error: what it asked, what the device has


def launch_configs(block_v: int) -> list[tuple[int, int | None]]:
    """(BV, num_stages) to try in order, None = Triton's default stages. The operand tiles
    of q, k and w ([K, BT] each) do not shrink with BV, and Triton's software pipelining
    keeps num_stages copies of them in shared memory: in float32 at K = 128 the default
    launch asks 323,584 bytes where an H100 has 232,448, so fewer stages come next and a
    smaller value block last (bf16 at K = 128 fits the default launch)."""
    return [(block_v, None), (block_v, 2), (block_v, 1)] + [(bv, 1) for bv in (32, 16) if bv < block_v]


def bwd_dhu_reference(q, k, w, gk, do, dv, ext, ext_idx, cu_seqlens, scale, chunk_size=64):
    """The same recurrence in plain PyTorch (float64), one sequence and chunk at a time
    (same arguments as `bwd_dhu_inject`, less the chunk offsets it derives)."""
    q, k, w, gk, do, dv = (x[0].double() for x in (q, k, w, gk, do, dv))
    T, H, K = q.shape
    V = do.shape[-1]
    cu = [int(c) for c in cu_seqlens]
    B = chunk_size
    dh_rows, dh0_rows = [], []
    dv2 = torch.empty_like(dv)
    chunk = 0
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        nt = (eos - bos + B - 1) // B
        rows = []
        S = torch.zeros(H, K, V, dtype=torch.float64, device=q.device)
        for i in reversed(range(nt)):
            s, e = bos + i * B, min(bos + (i + 1) * B, eos)
            if ext is not None and int(ext_idx[chunk + i]) >= 0:
                S = S + ext[int(ext_idx[chunk + i])].double()
            rows.append(S.clone())
            d = torch.einsum("thk,hkv->thv", k[s:e], S) + dv[s:e]
            dv2[s:e] = d
            S = gk[e - 1].exp2()[:, :, None] * S
            S = S + scale * torch.einsum("thk,thv->hkv", q[s:e], do[s:e]) - torch.einsum("thk,thv->hkv", w[s:e], d)
        dh_rows.extend(rows[::-1])
        dh0_rows.append(S)
        chunk += nt
    return torch.stack(dh_rows)[None], torch.stack(dh0_rows), dv2[None]
