"""The routed experts as three grouped matrix products (torch's `grouped_mm`) over the
(row, expert) assignments sorted by expert: the same function as `naive.experts_loop`.

Shapes: T rows, D model dim, E routed experts, k top-k, F expert FFN dim, N = T k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from harts.exec.compiled import region


def experts_grouped(x_TD: Tensor, top_i_Tk: Tensor, top_w_Tk: Tensor, w_gate_EFD: Tensor,
                    w_up_EFD: Tensor, w_down_EDF: Tensor, mm=F.grouped_mm, kernels=None) -> Tensor:
    """The same function as `experts_loop` with three grouped matrix products.

    The T*k (row, expert) assignments are sorted by expert, so expert e's rows are one
    contiguous run ending at offs[e]; `grouped_mm` multiplies every run by its expert's
    weights in one launch each for gate, up and down (no per-expert Python loop, no host
    sync on the counts). The k weighted outputs of each row are summed in a fixed order
    (a view [T, k, D] reduced over k), so the result is deterministic. Hand-written rather
    than a library MoE layer because routing statistics, occurrence weights and the
    reference loop must stay in this module; torch supplies the kernels. `mm` is the
    grouped product (`grouped_mm_reference` runs the same bookkeeping in float64); the
    weighted SwiGLU product between the products is a compiled region where `kernels`
    asks (`expert_hidden`, `harts.exec.compiled`).
    """
    T, k = top_i_Tk.shape
    E = w_gate_EFD.shape[0]
    # the narrowest integer keys: a radix sort makes one pass per key byte (int16: 2, int64: 8)
    flat_e = top_i_Tk.reshape(-1).to(torch.int16 if E <= torch.iinfo(torch.int16).max else torch.int32)
    sorted_e, order = torch.sort(flat_e, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # end of each expert's run; searchsorted rather than bincount(...).cumsum(), whose
    # CUDA kernel reads the largest id on the host (a stream sync per MoE layer)
    offs = torch.searchsorted(sorted_e, torch.arange(E, device=flat_e.device, dtype=sorted_e.dtype),
                              right=True, out_int32=True)
    x_ND = _GatherSlots.apply(x_TD, order, inverse, k)
    gate_NF = mm(x_ND, w_gate_EFD.transpose(-2, -1), offs=offs)
    up_NF = mm(x_ND, w_up_EFD.transpose(-2, -1), offs=offs)
    # the routing weight scales the F-wide hidden before the down projection (the same
    # function: the projection is linear), a third of the elements of the D-wide output
    hidden = region(expert_hidden, kernels, gate_NF, up_NF, top_w_Tk)
    h_NF = hidden(gate_NF, up_NF, top_w_Tk.reshape(-1), order)
    y_ND = mm(h_NF, w_down_EDF.transpose(-2, -1), offs=offs)
    return _GatherSlots.apply(y_ND, inverse, order, 1).view(T, k, -1).sum(1)


def expert_hidden(gate_NF: Tensor, up_NF: Tensor, w_N: Tensor, order_N: Tensor) -> Tensor:
    """silu(gate) * up * w[order]: the expert hidden rows weighted by their routing weight
    (slot order: w_N per (row, expert) slot, `order_N` the slots sorted by expert; a
    compiled region, `harts.exec.compiled`)."""
    return F.silu(gate_NF) * up_NF * w_N[order_N, None].to(up_NF.dtype)


class _GatherSlots(torch.autograd.Function):
    """rows[index // k] where `index` is a permutation of the T*k slots (slot = row*k + j)
    and `inverse` its inverse. Autograd's backward of advanced indexing is a sort-based
    scatter-add; here it is a gather by the inverse and a fixed-order sum over the k slots
    of each row: faster, and deterministic (no atomics)."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, inverse: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return rows[index // k] if k > 1 else rows[index]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        g = grad[inverse]
        if ctx.k > 1:
            g = g.view(-1, ctx.k, g.shape[-1]).sum(1)
        return g, None, None, None
