"""The references of the attention ops: dense masks, any device, every dtype (float64 too).

Legend: C query rows, L local rows (keys), H heads, D qk dim, E value dim.

Tree attention: query row q (local row `q_local_C[c]`) attends key row k iff k is q or
one of its ancestors, which in DFS order is `k <= q <= end_L[k]` (`end_L[k]`: the last row
of k's subtree). The fast paths compute the same function without the dense [C, L] mask:
`flex` (a block mask from the same intervals), `varlen` (one causal call over
root-to-row paths), `split` (two calls per query segment merged by log-sum-exp) and
`cudnn_graph` (cuDNN's graph API); their shared varlen kernel interface and its dense
reference are in `kernel`, the selection among them in `tree`.

Causal attention (the expanded baseline's, per packed sequence) is torch's SDPA with
`is_causal`; `causal` holds its GPU paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def ancestor_mask(q_local_C: Tensor, end_L: Tensor) -> Tensor:
    """[C, L] bool: key k is an ancestor-or-self of query row q_local_C[c]."""
    k_idx = torch.arange(end_L.numel(), device=end_L.device)
    q_idx = q_local_C.to(torch.int64)
    return (k_idx[None, :] <= q_idx[:, None]) & (q_idx[:, None] <= end_L.to(torch.int64)[None, :])


def tree_attention(q_CHD: Tensor, k_LHD: Tensor, v_LHE: Tensor, scale: float, mask_CL: Tensor) -> Tensor:
    """o_CHE: each query row attends the keys `mask_CL` allows (`ancestor_mask`), as one
    dense SDPA call."""
    q, k, v = (x.transpose(0, 1) for x in (q_CHD, k_LHD, v_LHE))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_CL, scale=scale).transpose(0, 1)


def causal_attention(q_HLD: Tensor, k_HLD: Tensor, v_HLE: Tensor, scale: float) -> Tensor:
    """o_HLE: causal SDPA over one sequence."""
    return F.scaled_dot_product_attention(q_HLD, k_HLD, v_HLE, is_causal=True, scale=scale)
