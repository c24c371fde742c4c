"""Chunkwise KDA (UT transform / WY representation) on packed varlen tensors, in plain PyTorch.

Shapes: T packed tokens, N sequences, H heads, K key channels, V value channels, B chunk
size, C = chunks of the longest sequence, M = boundary states of all sequences.

Each sequence is cut into chunks of B tokens counted from its own start; the last chunk is
zero-padded (k = v = g = beta = 0 is an exact identity step: it neither decays nor writes
the state). Inside a chunk, with G the within-chunk cumulative sum of g (inclusive) and
S0 the state entering the chunk, the recurrence unrolls to

    S_r = Diag(e^{G_r}) S0 + sum_{j<=r} Diag(e^{G_r - G_j}) k_j delta_j^T

where the pseudo-values delta solve the unit lower-triangular system (the UT transform)

    (I + L) delta = Diag(beta) (v - (e^{G} * k) S0),
    L[r, j] = beta_r k_r^T Diag(e^{G_r - G_j}) k_j   (j < r),

so delta = u - w S0 with the WY factors u = (I + L)^-1 Diag(beta) v and
w = (I + L)^-1 Diag(beta) (e^{G} * k), which depend on the chunk alone. Hence:

1. chunk-local work (L, u, w, the intra-chunk attention Aqk) runs for all chunks at once;
2. only the state hand-off is sequential: a loop over chunk index, vectorised over sequences:
       delta = u - w S;  o = (e^{G} * q) S + Aqk delta;
       S <- Diag(e^{G_B}) S + (e^{G_B - G} * k)^T delta.

Every chunk goes through exactly the same operations whatever its position in the pack,
and decays are formed as e^{G_r - G_j} with G_r - G_j <= 0 (never e^{G_r} e^{-G_j}), so
nothing overflows and splitting a sequence at a chunk boundary and passing the state on
reproduces the unsplit run bit for bit. The pairwise decay tensor is [.., B, B, K]: this is
a reference, readable before it is lean.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from harts.exec.ops.kda.common import check_inputs


class KDAOutput(NamedTuple):
    """Result of `chunk_kda`.

    o: [T, H, V] in v's dtype.
    final_state: [N, H, K, V] (None unless output_final_state).
    chunk_states: [M, H, K, V], the state after the first c tokens of each sequence for every
        multiple c of chunk_size with 0 < c <= len (None unless output_chunk_states). With a
        `chunk_state_index`, only those rows of that list, in its order: [len(index), H, K, V].
    chunk_state_offsets: int64 [N + 1]; sequence i's states are rows offsets[i]:offsets[i+1]
        of the full list (the numbering a `chunk_state_index` refers to).
    """

    o: torch.Tensor
    final_state: torch.Tensor | None
    chunk_states: torch.Tensor | None
    chunk_state_offsets: torch.Tensor | None


def check_chunk_state_index(index: torch.Tensor | np.ndarray, num_states: int) -> np.ndarray:
    """A `chunk_state_index` as an int64 host array, checked against the M states."""
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    index = np.asarray(index)
    if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
        raise ValueError(f"chunk_state_index must be a 1-D integer array; got {index.dtype} {index.shape}")
    index = index.astype(np.int64)
    if index.size and (index.min() < 0 or index.max() >= num_states):
        raise IndexError(f"chunk_state_index out of range for {num_states} chunk states")
    return index


def _chunk_index(cu_seqlens: torch.Tensor, chunk_size: int, T: int) -> tuple[torch.Tensor, int]:
    """Packed row of every (sequence, chunk, position) slot; T (a zero row) where padded.

    Returns (index [N, C, B], C).
    """
    lens_N = cu_seqlens[1:] - cu_seqlens[:-1]
    num_chunks = int(((lens_N + chunk_size - 1) // chunk_size).max()) if lens_N.numel() else 0
    offset_CB = torch.arange(num_chunks * chunk_size, device=cu_seqlens.device).view(
        num_chunks, chunk_size
    )
    inside_NCB = offset_CB[None] < lens_N[:, None, None]
    index_NCB = torch.where(inside_NCB, cu_seqlens[:-1, None, None] + offset_CB[None], T)
    return index_NCB, num_chunks


def _to_chunks(x_T: torch.Tensor, index_NCB: torch.Tensor) -> torch.Tensor:
    """Gather packed rows [T, H, ...] into chunks [N, C, H, B, ...], zeros in the padding."""
    x_pad = torch.cat([x_T, x_T.new_zeros(1, *x_T.shape[1:])])
    x_NCBH = x_pad[index_NCB]
    return x_NCBH.transpose(2, 3).contiguous()


def chunk_kda(
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
) -> KDAOutput:
    """KDA in chunkwise form over packed sequences; differentiable in every input.

    Args:
        q, k: [T, H, K] (L2 normalisation, if wanted, is the caller's); g: [T, H, K] log-space
            decay (<= 0); v: [T, H, V]; beta: [T, H].
        scale: multiplies the output; default K ** -0.5.
        initial_state: [N, H, K, V]; None means zeros.
        cu_seqlens: int64 [N + 1]; None means one sequence of length T. Chunks restart at
            every sequence start.
        chunk_size: B.
        output_final_state: return the state after each sequence.
        output_chunk_states: return the states at each sequence's chunk boundaries (see
            KDAOutput); they stay in the autograd graph so a consumer can start from them.
        chunk_state_index: int64 [U] (tensor or array): return only these states of the full
            list (see KDAOutput), in this order; None returns all. The reference computes all
            and selects; the GPU path materialises and back-propagates only the selected.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    if chunk_state_index is not None and not output_chunk_states:
        raise ValueError("chunk_state_index needs output_chunk_states=True")
    q_THK, k_THK, v_THV, g_THK, beta_TH, S_NHKV, cu_N1, scale = check_inputs(
        q, k, v, g, beta, scale, initial_state, cu_seqlens
    )
    T, B = q_THK.shape[0], chunk_size
    index_NCB, num_chunks = _chunk_index(cu_N1, B, T)
    q_c, k_c, v_c, g_c = (_to_chunks(x, index_NCB) for x in (q_THK * scale, k_THK, v_THV, g_THK))
    beta_c = _to_chunks(beta_TH, index_NCB)
    # q_c, k_c, g_c: [N, C, H, B, K]; v_c: [N, C, H, B, V]; beta_c: [N, C, H, B]

    # 1. Chunk-local work, all chunks at once.
    G = g_c.cumsum(-2)
    at_or_below = torch.ones(B, B, dtype=torch.bool, device=q.device).tril()
    # decay[.., r, j, :] = e^{G_r - G_j} for j <= r, 0 above the diagonal (masked before exp)
    diff = G[..., :, None, :] - G[..., None, :, :]
    decay = torch.where(at_or_below[:, :, None], diff, -torch.inf).exp()
    k_r, k_j = k_c[..., :, None, :], k_c[..., None, :, :]
    strictly_below = torch.ones(B, B, dtype=torch.bool, device=q.device).tril(-1)
    L = beta_c[..., :, None] * (k_r * k_j * decay).sum(-1) * strictly_below
    Aqk = (q_c[..., :, None, :] * k_j * decay).sum(-1)
    # UT transform: (I + L) [w | u] = Diag(beta) [e^G * k | v]
    eye = torch.eye(B, dtype=L.dtype, device=q.device)
    rhs = beta_c[..., None] * torch.cat([G.exp() * k_c, v_c], dim=-1)
    wu = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
    K = k_c.shape[-1]
    w, u = wu[..., :K], wu[..., K:]
    q_decayed = G.exp() * q_c
    G_last = G[..., -1:, :]
    k_to_end_T = ((G_last - G).exp() * k_c).transpose(-1, -2)
    state_decay = G_last.transpose(-1, -2).exp()  # [N, C, H, K, 1]
    # Chunk-major and contiguous, so that every step multiplies matrices of one fixed layout
    # whatever N and C are: CPU matmul picks its kernel by strides, and a different kernel
    # would round differently and break the bit-identical hand-off.
    w, u, q_decayed, Aqk, k_to_end_T, state_decay = (
        x.transpose(0, 1).contiguous() for x in (w, u, q_decayed, Aqk, k_to_end_T, state_decay)
    )
    S_NHKV = S_NHKV.contiguous()

    # 2. State hand-off, one chunk index at a time for all sequences.
    o_chunks: list[torch.Tensor] = []
    boundary_states: list[torch.Tensor] = []
    for c in range(num_chunks):
        delta = u[c] - w[c] @ S_NHKV
        o_chunks.append(q_decayed[c] @ S_NHKV + Aqk[c] @ delta)
        S_NHKV = state_decay[c] * S_NHKV + k_to_end_T[c] @ delta
        boundary_states.append(S_NHKV)

    H, V = S_NHKV.shape[1], v_THV.shape[-1]
    if num_chunks:
        # [N, C, H, B, V] -> rows in (sequence, chunk, position) order -> packed rows
        o_slots = torch.stack(o_chunks, dim=1).transpose(2, 3).reshape(-1, H, V)
        slot_T = (index_NCB.reshape(-1) < T).nonzero().squeeze(1)
        o_THV = o_slots[slot_T]
    else:
        o_THV = v_THV.new_zeros(T, H, V)

    chunk_states = chunk_state_offsets = None
    if output_chunk_states:
        lens_N = cu_N1[1:] - cu_N1[:-1]
        num_full_N = lens_N // B
        chunk_state_offsets = torch.cat([num_full_N.new_zeros(1), num_full_N.cumsum(0)])
        full_NC = torch.arange(num_chunks, device=q.device)[None, :] < num_full_N[:, None]
        if num_chunks:
            chunk_states = torch.stack(boundary_states, dim=1)[full_NC]
        else:
            chunk_states = S_NHKV.new_zeros(0, *S_NHKV.shape[1:])
        if chunk_state_index is not None:
            index = check_chunk_state_index(chunk_state_index, chunk_states.shape[0])
            chunk_states = chunk_states[torch.as_tensor(index, device=chunk_states.device)]
    return KDAOutput(
        o=o_THV.to(v.dtype),
        final_state=S_NHKV if output_final_state else None,
        chunk_states=chunk_states,
        chunk_state_offsets=chunk_state_offsets,
    )
