"""Input checks and dtype policy shared by the KDA forms, so they accept exactly the same calls."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 and float32 compute as themselves; half types compute in float32."""
    return dtype if dtype in (torch.float64, torch.float32) else torch.float32


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
    """Validate (or build, for None) int64 boundaries [N + 1]: 0 = cu[0] <= ... <= cu[N] = T."""
    if cu_seqlens is None:
        return torch.tensor([0, T], dtype=torch.int64, device=device)
    cu = torch.as_tensor(cu_seqlens, device=device)
    if cu.dtype not in (torch.int64, torch.int32) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1], N >= 1; got {cu!r}")
    cu = cu.to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}; got {cu.tolist()}")
    return cu


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Shape-check the packed KDA inputs and cast them to the compute dtype.

    Returns (q, k, v, g, beta, initial_state [N, H, K, V] (zeros for None), cu_seqlens, scale).
    """
    if q.dim() != 3 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share shape [T, H, K]; got {q.shape}, {k.shape}, {g.shape}")
    return check_recurrence_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)


def check_recurrence_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """The checks and casts every gated delta rule form shares, once q, k and the decay g
    are checked (KDA's g is [T, H, K], Gated DeltaNet's [T, H]): v [T, H, V], beta [T, H],
    the boundaries, the initial state and the default scale K**-0.5."""
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (T, H):
        raise ValueError(f"v must be [T, H, V] = [{T}, {H}, V]; got {tuple(v.shape)}")
    if beta.shape != (T, H):
        raise ValueError(f"beta must be [T, H] = [{T}, {H}]; got {tuple(beta.shape)}")
    V = v.shape[-1]
    dtype = compute_dtype(q.dtype)
    cu = check_cu_seqlens(cu_seqlens, T, q.device)
    N = cu.numel() - 1
    if initial_state is None:
        S0 = q.new_zeros(N, H, K, V, dtype=dtype)
    else:
        if initial_state.shape != (N, H, K, V):
            raise ValueError(
                f"initial_state must be [N, H, K, V] = {[N, H, K, V]}; got {list(initial_state.shape)}"
            )
        S0 = initial_state.to(dtype)
    if scale is None:
        scale = K**-0.5
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    return q, k, v, g, beta, S0, cu, scale
