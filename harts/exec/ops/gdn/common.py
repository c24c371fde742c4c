"""Input checks and dtype policy shared by the Gated DeltaNet forms, so they accept exactly the
same calls (the dtype policy and cu_seqlens checks are KDA's: the two families differ only in
the decay's shape)."""

from __future__ import annotations

from harts.exec.ops.kda.common import check_recurrence_inputs


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Shape-check the packed GDN inputs and cast them to the compute dtype.

    q, k: [T, H, K]; v: [T, H, V]; g, beta: [T, H] (g the log-space decay per head, <= 0).
    Returns (q, k, v, g, beta, initial_state [N, H, K, V] (zeros for None), cu_seqlens, scale).
    """
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q, k must share shape [T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}")
    T, H, _ = q.shape
    if g.shape != (T, H):
        raise ValueError(f"g must be [T, H] = [{T}, {H}]; got {tuple(g.shape)}")
    return check_recurrence_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
