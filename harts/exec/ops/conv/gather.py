"""Short causal depthwise convolution in gather form: one op for packed sequences and trees.

Shapes: T rows, D channels, W window (kernel width), N sequences.

Output row t is act(bias + sum_j weight[:, j] * x[window[t, j]]): `window_TW[t]` lists the W
rows feeding t, oldest first, the last column being t itself; -1 is zero padding. Where the
window comes from is the caller's business:

- packed sequences: `window_from_cu_seqlens` (the previous W-1 rows of the same sequence);
- rollout trees in compact (DFS) layout: `window_from_parents` (the previous W-1 rows along
  t's root path, found by repeated pointer jumping through parent pointers, vectorised over
  rows), so a row after a fork sees its own branch's history, as in each trajectory.

Carried state (packed sequences that continue earlier ones): `initial_state` [N, D, W-1]
holds, per sequence, the W-1 inputs just before its start (oldest first, last column = the
token immediately before). It is placed in front of the sequence by appending its columns
to the gathered rows: window index T + n*(W-1) + j means initial_state[n, :, j].
`window_from_cu_seqlens(..., with_initial_state=True)` emits those indices instead of -1,
and `final_conv_state` reads the state to hand to the next call (the last W-1 inputs).
"""

from __future__ import annotations

import torch

from harts.exec.ops.conv.naive import apply_activation


def _sequence_ids(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.as_tensor(cu_seqlens).to(torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}; got {cu.tolist()}")
    lens_N = cu[1:] - cu[:-1]
    if bool((lens_N < 0).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {cu.tolist()}")
    seq_T = torch.repeat_interleave(torch.arange(lens_N.numel(), device=cu.device), lens_N)
    return cu, seq_T


def _sequence_rows(
    cu: torch.Tensor, seq: torch.Tensor, rel: torch.Tensor, W: int, T: int, with_initial_state: bool
) -> torch.Tensor:
    """Gather index of position `rel` (relative to the start, may be < 0) of sequence `seq`."""
    inside = cu[seq] + rel
    if with_initial_state:
        before = T + seq * (W - 1) + (W - 1) + rel
    else:
        before = torch.full_like(rel, -1)
    return torch.where(rel >= 0, inside, before)


def window_from_cu_seqlens(
    cu_seqlens: torch.Tensor, W: int, T: int, *, with_initial_state: bool = False
) -> torch.Tensor:
    """int64 [T, W] windows of packed sequences: row t sees the W-1 rows before it in its own
    sequence; before the start, -1 (zeros) or, with_initial_state, the carried-state columns."""
    cu, seq_T = _sequence_ids(cu_seqlens, T)
    rel_T = torch.arange(T, device=cu.device) - cu[seq_T]
    lag_W = torch.arange(W - 1, -1, -1, device=cu.device)
    rel_TW = rel_T[:, None] - lag_W[None, :]
    seq_TW = seq_T[:, None].expand(T, W)
    return _sequence_rows(cu, seq_TW, rel_TW, W, T, with_initial_state)


def window_from_parents(parent_T: torch.Tensor, W: int) -> torch.Tensor:
    """int64 [T, W] windows along tree paths: column W-1 is t, column W-2 its parent, and so
    on up; -1 once the path passes its root. One vectorised pointer jump per column."""
    parent_T = torch.as_tensor(parent_T).to(torch.int64)
    T = parent_T.numel()
    if parent_T.dim() != 1 or bool(((parent_T < -1) | (parent_T >= T)).any()):
        raise ValueError("parent_T must be 1-D with entries in [-1, T)")
    columns = [torch.arange(T, device=parent_T.device)]
    for _ in range(W - 1):
        row = columns[-1]
        columns.append(torch.where(row >= 0, parent_T[row.clamp(min=0)], -1))
    return torch.stack(columns[::-1], dim=1)


def short_conv(
    x_TD: torch.Tensor,
    weight_DW: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    *,
    window_TW: torch.Tensor,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [T_out, D] = act(bias + sum_j weight[:, j] * x[window[:, j]]), one row per window
    row (usually T_out = T; a window over another order of x's rows, some repeated, gathers
    them in the same pass); -1 in the window is zero, indices T + n*(W-1) + j read
    initial_state[n, :, j] ([N, D, W-1], only if given)."""
    T, D = x_TD.shape
    W = weight_DW.shape[1]
    if weight_DW.shape != (D, W) or window_TW.dim() != 2 or window_TW.shape[1] != W:
        raise ValueError(
            f"expected weight [D, W] = [{D}, W] and window [T_out, W] = [T_out, {W}]; got "
            f"{list(weight_DW.shape)} and {list(window_TW.shape)}"
        )
    rows = [x_TD]
    if initial_state is not None:
        rows.append(initial_state.transpose(1, 2).reshape(-1, D).to(x_TD.dtype))
    rows.append(x_TD.new_zeros(1, D))
    source_RD = torch.cat(rows)
    zero_row = source_RD.shape[0] - 1
    window_TW = window_TW.to(torch.int64)
    if bool(((window_TW < -1) | (window_TW >= zero_row)).any()):
        raise ValueError(f"window indices must lie in [-1, {zero_row}) (T plus state columns)")
    gathered_TWD = source_RD[torch.where(window_TW < 0, zero_row, window_TW)]
    y_TD = (gathered_TWD * weight_DW.T[None]).sum(1)
    if bias_D is not None:
        y_TD = y_TD + bias_D
    return apply_activation(y_TD, activation)


def final_conv_state(
    x_TD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    W: int,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N, D, W-1]: the last W-1 inputs of each sequence (reaching into its initial state, or
    zeros, when the sequence is shorter), i.e. the state to carry into a continuation."""
    T, D = x_TD.shape
    cu, _ = _sequence_ids(cu_seqlens, T)
    N = cu.numel() - 1
    lens_N = cu[1:] - cu[:-1]
    rel_NJ = lens_N[:, None] - (W - 1) + torch.arange(W - 1, device=cu.device)[None, :]
    seq_NJ = torch.arange(N, device=cu.device)[:, None].expand_as(rel_NJ)
    index_NJ = _sequence_rows(cu, seq_NJ, rel_NJ, W, T, initial_state is not None)
    rows = [x_TD]
    if initial_state is not None:
        rows.append(initial_state.transpose(1, 2).reshape(-1, D).to(x_TD.dtype))
    rows.append(x_TD.new_zeros(1, D))
    source_RD = torch.cat(rows)
    index_NJ = torch.where(index_NJ < 0, source_RD.shape[0] - 1, index_NJ)
    return source_RD[index_NJ].transpose(1, 2)


def short_conv_varlen(
    x_TD: torch.Tensor,
    weight_DW: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed sequences with optional carried state [N, D, W-1]; returns (y [T, D],
    final_state [N, D, W-1] or None). cu_seqlens None means one sequence of length T."""
    T, D = x_TD.shape
    W = weight_DW.shape[1]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], device=x_TD.device)
    N = len(cu_seqlens) - 1
    if initial_state is not None and initial_state.shape != (N, D, W - 1):
        raise ValueError(
            f"initial_state must be [N, D, W-1] = {[N, D, W - 1]}; got {list(initial_state.shape)}"
        )
    window_TW = window_from_cu_seqlens(
        cu_seqlens, W, T, with_initial_state=initial_state is not None
    )
    y_TD = short_conv(
        x_TD,
        weight_DW,
        bias_D,
        window_TW=window_TW,
        activation=activation,
        initial_state=initial_state,
    )
    final = final_conv_state(x_TD, cu_seqlens, W, initial_state) if output_final_state else None
    return y_TD, final
