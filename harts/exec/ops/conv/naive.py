"""Reference short causal depthwise convolution: one `F.conv1d` per packed sequence.

Shapes: T packed tokens, N sequences, D channels, W window (kernel width).

Output t of a sequence is act(bias + sum_j weight[:, j] * x[t - (W-1) + j]), j = 0..W-1,
i.e. weight column W-1 multiplies the current token (nn.Conv1d(D, D, W, groups=D,
padding=W-1) truncated to the first L outputs, as fla's ShortConvolution). In front of each
sequence sit W-1 columns: zeros, or that sequence's carried state `initial_state[n]`
([D, W-1], oldest first, last column = the token just before the sequence start).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unknown activation {activation!r}; expected 'silu', 'swish' or None")


def naive_short_conv(
    x_TD: torch.Tensor,
    weight_DW: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence conv1d loop. Returns (y [T, D], final_state [N, D, W-1]), where the final
    state is the last W-1 input columns of each (state-prefixed) sequence."""
    T, D = x_TD.shape
    W = weight_DW.shape[1]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    bounds = [int(b) for b in cu_seqlens]
    outputs, final_states = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if initial_state is None:
            prefix_DW1 = x_TD.new_zeros(D, W - 1)
        else:
            prefix_DW1 = initial_state[n]
        seq_DL = torch.cat([prefix_DW1, x_TD[start:end].T], dim=1)
        if end > start:
            y_1DL = F.conv1d(seq_DL[None], weight_DW[:, None, :], bias_D, groups=D)
            outputs.append(y_1DL[0].T)
        final_states.append(seq_DL[:, seq_DL.shape[1] - (W - 1) :])
    y_TD = apply_activation(torch.cat([x_TD[:0], *outputs]), activation)
    return y_TD, torch.stack(final_states)
