"""Token-by-token Gated DeltaNet recurrence: the readable reference of `harts.exec.ops.gdn`.

Shapes (packed, batch-free, fla's names): T tokens of all sequences back to back, N
sequences (cu_seqlens [N+1]), H heads, K key/query channels, V value channels.

Per head, with alpha_t = exp(g_t) one scalar decay per head and token (g_t <= 0, log space):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

S is K x V. This is KDA's recurrence with the decay Diag(alpha_t) replaced by the scalar
alpha_t (a scalar commutes with I - beta k k^T), which is why trees run GDN through the KDA
machinery with g broadcast along K (`harts.exec.model.gdn`). The code applies the first
line literally; it computes in the input dtype (float64 stays float64, half types in float32).
"""

from __future__ import annotations

import torch

from harts.exec.ops.gdn.common import check_inputs


def naive_recurrent_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN by its recurrence, one token at a time, one sequence at a time.

    Args:
        q, k: [T, H, K]; v: [T, H, V]; g: [T, H] log-space decay (<= 0); beta: [T, H].
        scale: multiplies the output; default K ** -0.5.
        initial_state: [N, H, K, V]; None means zeros.
        cu_seqlens: int64 [N + 1] sequence boundaries; None means one sequence of length T.

    Returns:
        (o [T, H, V] in v's dtype, final_state [N, H, K, V] in the compute dtype).
    """
    q_THK, k_THK, v_THV, g_TH, beta_TH, S0_NHKV, cu_N1, scale = check_inputs(
        q, k, v, g, beta, scale, initial_state, cu_seqlens
    )
    o_rows: list[torch.Tensor] = []
    final_states: list[torch.Tensor] = []
    for n in range(cu_N1.numel() - 1):
        S_HKV = S0_NHKV[n]
        for t in range(int(cu_N1[n]), int(cu_N1[n + 1])):
            q_HK, k_HK, v_HV = q_THK[t], k_THK[t], v_THV[t]
            b_H11 = beta_TH[t][:, None, None]
            # alpha_t S_{t-1}
            S_HKV = g_TH[t].exp()[:, None, None] * S_HKV
            # (I - beta k k^T) applied to it, then + beta k v^T
            kS_HV = torch.einsum("hk,hkv->hv", k_HK, S_HKV)
            S_HKV = S_HKV - b_H11 * k_HK[:, :, None] * kS_HV[:, None, :]
            S_HKV = S_HKV + b_H11 * k_HK[:, :, None] * v_HV[:, None, :]
            o_rows.append(scale * torch.einsum("hk,hkv->hv", q_HK, S_HKV))
        final_states.append(S_HKV)
    o_THV = torch.stack(o_rows) if o_rows else v_THV.new_zeros(v_THV.shape)
    return o_THV.to(v.dtype), torch.stack(final_states)
