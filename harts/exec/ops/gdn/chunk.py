"""Chunkwise Gated DeltaNet (UT transform / WY representation) on packed varlen tensors, in
plain PyTorch.

Shapes: T packed tokens, N sequences, H heads, K key channels, V value channels, B chunk
size, C = chunks of the longest sequence.

The same algorithm as `harts.exec.ops.kda.chunk` (read its docstring for the derivation)
with a scalar decay per head: G, the within-chunk cumulative sum of g, is [.., B] rather
than [.., B, K], so the pairwise decays e^{G_r - G_j} form a [B, B] matrix that multiplies
the k_r^T k_j and q_r^T k_j products instead of entering them channel by channel:

    L[r, j] = beta_r e^{G_r - G_j} k_r^T k_j  (j < r),   (I + L) [w | u] = Diag(beta) [e^G k | v]
    delta = u - w S;  o = e^{G} (q S) + Aqk delta;  S <- e^{G_B} S + (e^{G_B - G} k)^T delta.

Sequences restart their chunk grid at their own start; padding slots (k = v = g = beta = 0)
are identity steps. Decays are only ever e^{x} with x <= 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from harts.exec.ops.gdn.common import check_inputs
from harts.exec.ops.kda.chunk import _chunk_index, _to_chunks


class GDNOutput(NamedTuple):
    """o: [T, H, V] in v's dtype; final_state: [N, H, K, V] (None unless output_final_state)."""

    o: torch.Tensor
    final_state: torch.Tensor | None


def chunk_gdn(
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
) -> GDNOutput:
    """GDN in chunkwise form over packed sequences; differentiable in every input.

    Args: as `naive_recurrent_gdn` (q, k [T, H, K]; v [T, H, V]; g, beta [T, H]), plus
    chunk_size B and output_final_state.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    q_THK, k_THK, v_THV, g_TH, beta_TH, S_NHKV, cu_N1, scale = check_inputs(
        q, k, v, g, beta, scale, initial_state, cu_seqlens
    )
    T, B = q_THK.shape[0], chunk_size
    H, V = q_THK.shape[1], v_THV.shape[-1]
    index_NCB, num_chunks = _chunk_index(cu_N1, B, T)
    if num_chunks == 0:
        o_THV = v_THV.new_zeros(T, H, V)
        return GDNOutput(o_THV.to(v.dtype), S_NHKV if output_final_state else None)
    q_c, k_c, v_c = (_to_chunks(x, index_NCB) for x in (q_THK * scale, k_THK, v_THV))
    g_c, beta_c = (_to_chunks(x, index_NCB) for x in (g_TH, beta_TH))
    # q_c, k_c: [N, C, H, B, K]; v_c: [N, C, H, B, V]; g_c, beta_c: [N, C, H, B]

    G = g_c.cumsum(-1)
    at_or_below = torch.ones(B, B, dtype=torch.bool, device=q.device).tril()
    strictly_below = torch.ones(B, B, dtype=torch.bool, device=q.device).tril(-1)
    decay = torch.where(at_or_below, G[..., :, None] - G[..., None, :], -torch.inf).exp()  # [.., B, B]
    kk = k_c @ k_c.transpose(-1, -2)
    L = beta_c[..., :, None] * kk * decay * strictly_below
    Aqk = (q_c @ k_c.transpose(-1, -2)) * decay
    eye = torch.eye(B, dtype=L.dtype, device=q.device)
    rhs = beta_c[..., None] * torch.cat([G.exp()[..., None] * k_c, v_c], dim=-1)
    wu = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
    K = k_c.shape[-1]
    w, u = wu[..., :K], wu[..., K:]
    q_decayed = G.exp()[..., None] * q_c
    G_last = G[..., -1:]
    k_to_end_T = ((G_last - G).exp()[..., None] * k_c).transpose(-1, -2)
    state_decay = G_last.exp()[..., None]  # [N, C, H, 1, 1]
    # chunk-major and contiguous: one fixed layout for every step (see kda.chunk)
    w, u, q_decayed, Aqk, k_to_end_T, state_decay = (
        x.transpose(0, 1).contiguous() for x in (w, u, q_decayed, Aqk, k_to_end_T, state_decay)
    )
    S_NHKV = S_NHKV.contiguous()
    o_chunks: list[torch.Tensor] = []
    for c in range(num_chunks):
        delta = u[c] - w[c] @ S_NHKV
        o_chunks.append(q_decayed[c] @ S_NHKV + Aqk[c] @ delta)
        S_NHKV = state_decay[c] * S_NHKV + k_to_end_T[c] @ delta
    o_slots = torch.stack(o_chunks, dim=1).transpose(2, 3).reshape(-1, H, V)
    slot_T = (index_NCB.reshape(-1) < T).nonzero().squeeze(1)
    return GDNOutput(o_slots[slot_T].to(v.dtype), S_NHKV if output_final_state else None)
