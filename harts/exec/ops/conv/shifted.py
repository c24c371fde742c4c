"""The short convolution as one dense depthwise conv1d plus a gather for the rows that need it.

In a packed microbatch, and along the chains of a tree's DFS layout, almost every row's
window is the plain causal shift: rows t-W+1, ..., t. Only rows near a sequence start or
just below a fork (or a jump in the DFS order) read other rows. So: run `F.conv1d` with
groups = channels over all rows as if the layout were one sequence (one fused, vectorised
kernel), then recompute the few rows whose window differs in gather form and write them
over the dense result. Same function as `short_conv` (the gather-form reference), which
materialises a [T, W, D] gather and a broadcast multiply for every row; the test suite
checks the two against each other on packed sequences and trees, outputs and gradients.
`ConvWindows.of(window)` finds the rows to fix once per layout (one host sync); the
contexts cache it per window width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harts.exec.ops.conv.naive import apply_activation


@dataclass(frozen=True)
class ConvWindows:
    window_TW: torch.Tensor  # int64 [T, W], as `short_conv` takes it (-1: zero)
    fix_rows: torch.Tensor  # int64 [F]: rows whose window is not the plain causal shift

    @classmethod
    def of(cls, window_TW: torch.Tensor) -> ConvWindows:
        T, W = window_TW.shape
        dev = window_TW.device
        shift = torch.arange(T, device=dev)[:, None] - torch.arange(W - 1, -1, -1, device=dev)[None, :]
        plain = (window_TW == shift.clamp(min=-1)).all(1)
        return cls(window_TW, torch.nonzero(~plain).flatten())

    def to(self, device: torch.device | str) -> ConvWindows:
        return ConvWindows(self.window_TW.to(device), self.fix_rows.to(device))


def short_conv_shifted(x_TD: torch.Tensor, weight_DW: torch.Tensor, bias_D: torch.Tensor | None,
                       windows: ConvWindows, activation: str | None = "silu") -> torch.Tensor:
    """act(bias + sum_j weight[:, j] * x[window[:, j]]) ([T, D]); windows without state columns."""
    T, D = x_TD.shape
    W = weight_DW.shape[1]
    if weight_DW.shape != (D, W) or windows.window_TW.shape != (T, W):
        raise ValueError(
            f"expected weight [D, W] = [{D}, W] and window [T, W] = [{T}, {W}]; got "
            f"{list(weight_DW.shape)} and {list(windows.window_TW.shape)}"
        )
    y_DT = F.conv1d(F.pad(x_TD.T[None], (W - 1, 0)), weight_DW[:, None, :], bias_D, groups=D)[0]
    y_TD = y_DT.T
    fix = windows.fix_rows
    if fix.numel():
        window_FW = windows.window_TW[fix]
        source_RD = torch.cat([x_TD, x_TD.new_zeros(1, D)])
        gathered_FWD = source_RD[torch.where(window_FW < 0, T, window_FW)]
        y_FD = (gathered_FWD * weight_DW.T[None]).sum(1)
        if bias_D is not None:
            y_FD = y_FD + bias_D
        y_TD = y_TD.index_copy(0, fix, y_FD.to(y_TD.dtype))
    return apply_activation(y_TD, activation)
