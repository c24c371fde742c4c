"""The routed experts' reference: one SwiGLU per expert over the rows routed to it, in a
Python loop over the experts (any device, every dtype, float64 included); and what
`F.grouped_mm` computes, one group at a time, so the grouped path's bookkeeping can be
checked exactly in float64.

Shapes: T rows, D model dim, E routed experts, k top-k, F expert FFN dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def experts_loop(x_TD: Tensor, top_i_Tk: Tensor, top_w_Tk: Tensor, w_gate_EFD: Tensor,
                 w_up_EFD: Tensor, w_down_EDF: Tensor) -> Tensor:
    """Reference: one SwiGLU per expert over the rows routed to it (any dtype, float64 too)."""
    T, k = top_i_Tk.shape
    flat_e = top_i_Tk.reshape(-1)
    flat_t = torch.arange(T, device=x_TD.device).repeat_interleave(k)
    flat_w = top_w_Tk.reshape(-1).to(x_TD.dtype)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=w_gate_EFD.shape[0]).tolist()
    y_TD = torch.zeros_like(x_TD)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = order[start : start + n]
        start += n
        rows = flat_t[idx]
        x_nD = x_TD[rows]
        h_nF = F.silu(x_nD @ w_gate_EFD[e].T) * (x_nD @ w_up_EFD[e].T) * flat_w[idx, None]
        y_TD = y_TD.index_add(0, rows, h_nF @ w_down_EDF[e].T)
    return y_TD


def grouped_mm_reference(mat_a: Tensor, mat_b: Tensor, *, offs: Tensor) -> Tensor:
    """What `F.grouped_mm(a [N, K], b [G, K, M], offs=offs)` computes, one group at a time
    (any dtype, float64 included: lets the tests check `experts_grouped` exactly)."""
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(mat_a[start:end] @ mat_b[g])
        start = end
    return torch.cat(out) if out else mat_a.new_zeros(0, mat_b.shape[-1])
