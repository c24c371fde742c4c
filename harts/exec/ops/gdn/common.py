"""Input checks and dtype policy shared by the Gated DeltaNet forms, so they accept exactly the
same calls (the dtype policy and cu_seqlens checks are KDA's: the two families differ only in
the decay's shape)."""

from __future__ import annotations

from harts.exec.ops.kda.common import check_cu_seqlens, compute_dtype


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Shape-check the packed GDN inputs and cast them to the compute dtype.

    q, k: [T, H, K]; v: [T, H, V]; g, beta: [T, H] (g the log-space decay per head, <= 0).
    Returns (q, k, v, g, beta, initial_state [N, H, K, V] (zeros for None), cu_seqlens, scale).
    """
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q, k must share shape [T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}")
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (T, H):
        raise ValueError(f"v must be [T, H, V] = [{T}, {H}, V]; got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (T, H):
            raise ValueError(f"{name} must be [T, H] = [{T}, {H}]; got {tuple(x.shape)}")
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
