"""Token-by-token KDA recurrence: the readable reference every faster form is tested against.

Shapes (packed, batch-free; legend used across `harts.exec.ops.kda`):
  T tokens of all sequences back to back, N sequences (cu_seqlens [N+1]), H heads,
  K key/query channels, V value channels.

Per head, with alpha_t = exp(g_t) a per-key-channel decay (g_t <= 0, log space):

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

S is K x V. The code applies the first line literally (decay, then the delta-rule
correction, then the write), so reading it is checking it. It computes in the input dtype:
float64 stays float64 (half types are computed in float32).
"""

from __future__ import annotations

import torch

from harts.exec.ops.kda.common import check_inputs


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA by its recurrence, one token at a time, one sequence at a time.

    Args:
        q, k: [T, H, K]; g: [T, H, K] log-space decay (<= 0); v: [T, H, V]; beta: [T, H].
        scale: multiplies the output; default K ** -0.5.
        initial_state: [N, H, K, V]; None means zeros.
        cu_seqlens: int64 [N + 1] sequence boundaries; None means one sequence of length T.

    Returns:
        (o [T, H, V] in v's dtype, final_state [N, H, K, V] in the compute dtype).
    """
    q_THK, k_THK, v_THV, g_THK, beta_TH, S0_NHKV, cu_N1, scale = check_inputs(
        q, k, v, g, beta, scale, initial_state, cu_seqlens
    )
    num_seqs = cu_N1.numel() - 1
    o_rows: list[torch.Tensor] = []
    final_states: list[torch.Tensor] = []
    for n in range(num_seqs):
        S_HKV = S0_NHKV[n]
        for t in range(int(cu_N1[n]), int(cu_N1[n + 1])):
            q_HK, k_HK, v_HV = q_THK[t], k_THK[t], v_THV[t]
            b_H11 = beta_TH[t][:, None, None]
            # Diag(alpha_t) S_{t-1}
            S_HKV = g_THK[t].exp()[:, :, None] * S_HKV
            # (I - beta k k^T) applied to it, then + beta k v^T
            kS_HV = torch.einsum("hk,hkv->hv", k_HK, S_HKV)
            S_HKV = S_HKV - b_H11 * k_HK[:, :, None] * kS_HV[:, None, :]
            S_HKV = S_HKV + b_H11 * k_HK[:, :, None] * v_HV[:, None, :]
            o_rows.append(scale * torch.einsum("hk,hkv->hv", q_HK, S_HKV))
        final_states.append(S_HKV)
    if o_rows:
        o_THV = torch.stack(o_rows)
    else:
        o_THV = v_THV.new_zeros(v_THV.shape)
    return o_THV.to(v.dtype), torch.stack(final_states)
