"""Triton kernels: the short convolution in gather form, fused (forward and backward).

Legend: T rows, D channels, W window (kernel width), BT/BD row/channel tile.

The function is `harts.exec.ops.conv.short_conv` (the reference) without carried state:

    pre[t] = bias + sum_j weight[:, j] * x[window[t, j]]      (window -1 = zero)
    y[t]   = silu(pre[t])

The reference materialises the [T, W, D] gather, multiplies it by the broadcast weights
and reduces over W: several passes over W times the activation's bytes. Measured in an H200
update step (docs/BENCHMARKS.md): that broadcast multiply alone was the largest non-GEMM
kernel, 1.16 s of a 6.7 s expanded step. Here one program reads the W window rows of a
tile of rows straight from x (they sit in cache: neighbouring rows share them), sums in
fp32 in the fixed order j = 0..W-1 and writes y once. A row's sum does not depend on the
layout around it, so a tree row and the same token in its trajectory get the same bits,
which the gather-form reference also guarantees and a dense conv1d does not (docs/LOG.md).

Backward, deterministic (no atomics): one kernel recomputes pre and writes g = dy *
silu'(pre) in fp32 with each program's partial sums of dW[:, j] = sum_t x[window[t, j]] *
g[t] and db = sum_t g (added up afterwards, a fixed order); a second reads dx as a gather
through the window's inverse (`window_inverse`: for each row, the (row, column) pairs that
read it, a fork's last rows having one per branch), dx[t] = sum weight[:, j] * g[r] in a
fixed order. The first version scattered all three with fp32 atomic adds; in the H200
step profile (benchmarks/results/profile/2026-11-29-4a66155-profile.json) that backward
took 5.8 ms a call at 2048 channels, 103.7 ms of the 1.40 s tree step and 460 ms of the
5.26 s expanded one, against 0.28 ms for the forward.

The default on CUDA (harts.exec.backend.conv_impl; `KernelConfig(conv="reference")` switches back):
on the H200 at 82k rows x 2048 channels, bf16, 0.32 vs 3.4 ms forward and 6.7 vs 11.2 ms
forward+backward against the gather form (benchmarks/results/conv/2026-11-29-9006abf-conv.json).
CI checks it under TRITON_INTERPRET=1 against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harts.exec.ops.segment_sum import inverse as segment_inverse


@triton.jit
def _pre_activation(x, win, w, b, o_t, o_d, m_t, m_d, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr, HAS_BIAS: tl.constexpr):
    """bias + sum_j weight[:, j] * x[window[t, j]] for a [BT, BD] tile, fp32, j in order."""
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        rows = tl.load(win + o_t * W + j, mask=m_t, other=-1)
        ok = (rows >= 0) & m_t
        xj = tl.load(x + rows[:, None] * D + o_d[None, :], mask=ok[:, None] & m_d[None, :], other=0.0)
        wj = tl.load(w + o_d * W + j, mask=m_d, other=0.0)
        acc += xj.to(tl.float32) * wj.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(x, win, w, b, y, T, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    acc = _pre_activation(x, win, w, b, o_t, o_d, m_t, m_d, D, W, BT, BD, HAS_BIAS)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + o_t[:, None] * D + o_d[None, :], acc.to(y.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _conv_bwd_g_kernel(x, win, w, b, dy, g_out, pdw, pdb, T, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                       BD: tl.constexpr, BW: tl.constexpr, NSUB: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SILU: tl.constexpr):
    """g = dy * silu'(pre) for NSUB row tiles (stored fp32), and this program's partial
    sums of dW and db over its rows (no atomics: summed afterwards in a fixed order)."""
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_w = tl.arange(0, BW)
    acc_dw = tl.zeros([BW, BD], dtype=tl.float32)
    acc_db = tl.zeros([BD], dtype=tl.float32)
    for s in range(NSUB):
        o_t = (i_t * NSUB + s) * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_td = m_t[:, None] & m_d[None, :]
        at = o_t.to(tl.int64)[:, None] * D + o_d[None, :]
        g = tl.load(dy + at, mask=m_td, other=0.0).to(tl.float32)
        if SILU:
            pre = _pre_activation(x, win, w, b, o_t, o_d, m_t, m_d, D, W, BT, BD, HAS_BIAS)
            sig = tl.sigmoid(pre)
            g = g * sig * (1.0 + pre * (1.0 - sig))
        tl.store(g_out + at, g, mask=m_td)
        if HAS_BIAS:
            acc_db += tl.sum(g, axis=0)
        for j in tl.static_range(W):
            rows = tl.load(win + o_t * W + j, mask=m_t, other=-1)
            ok = (rows >= 0) & m_t
            xj = tl.load(x + rows[:, None] * D + o_d[None, :], mask=ok[:, None] & m_d[None, :], other=0.0)
            part = tl.sum(xj.to(tl.float32) * g, axis=0)
            acc_dw += tl.where(o_w[:, None] == j, part[None, :], 0.0)
    tl.store(pdw + i_t * BW * D + o_w[:, None] * D + o_d[None, :], acc_dw, mask=(o_w[:, None] < W) & m_d[None, :])
    if HAS_BIAS:
        tl.store(pdb + i_t * D + o_d, acc_db, mask=m_d)


@triton.jit
def _conv_bwd_dx_kernel(g, w, ptr, ref, col, tile_pairs, dx, T, D: tl.constexpr, W: tl.constexpr,
                        BT: tl.constexpr, BD: tl.constexpr):
    """dx[t] = sum over the (row r, column j) with window[r, j] = t of weight[:, j] * g[r],
    read through the inverse window (pairs sorted by t, then r, then j): a fixed order."""
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    start = tl.load(ptr + o_t, mask=m_t, other=0)
    end = tl.load(ptr + o_t + 1, mask=m_t, other=0)
    n = tl.load(tile_pairs + i_t)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in range(0, n):
        idx = start + k
        ok = (idx < end) & m_t
        r = tl.load(ref + idx, mask=ok, other=0).to(tl.int64)
        j = tl.load(col + idx, mask=ok, other=0)
        m = ok[:, None] & m_d[None, :]
        gk = tl.load(g + r[:, None] * D + o_d[None, :], mask=m, other=0.0)
        wk = tl.load(w + o_d[None, :] * W + j[:, None], mask=m, other=0.0).to(tl.float32)
        acc += gk * wk
    tl.store(dx + o_t.to(tl.int64)[:, None] * D + o_d[None, :], acc.to(dx.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


_INVERSE_ATTR = "_harts_conv_inverse"


def window_inverse(window_TW: torch.Tensor, BT: int, rows: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of a window, for the backward's dx as a gather (no atomics, fixed order).

    `rows`: the number of input rows the window reads (default: its own row count; more or
    fewer where the output rows are another order of them, e.g. a KDA call's rounds with
    replayed rows repeated). Returns (ptr [rows+1], ref [P], col [P], tile_pairs
    [ceil(rows/BT)]), int32: the pairs (r, j) with window[r, j] = t are ref/col[ptr[t]:ptr[t+1]],
    sorted by r then j (a stable sort of the flat window by target); tile_pairs is the most
    pairs any row of a BT-row tile has (the dx kernel's trip count). A row referenced by
    several branches (a fork's last rows) has more than W pairs. Computed on the window's
    device without a host sync, and cached on the window tensor (the step's conv layers
    share one window).
    """
    T_out, W = window_TW.shape
    T = T_out if rows is None else int(rows)
    cached = getattr(window_TW, _INVERSE_ATTR, None)
    if cached is not None and cached[0] == (BT, T):
        return cached[1]
    ptr, order, tile_pairs = segment_inverse(window_TW, T, BT)
    ref = torch.div(order, W, rounding_mode="floor").to(torch.int32)
    col = (order % W).to(torch.int32)
    inverse = (ptr.contiguous(), ref.contiguous(), col.contiguous(), tile_pairs)
    try:
        setattr(window_TW, _INVERSE_ATTR, ((BT, T), inverse))
    except (AttributeError, RuntimeError):  # a tensor that takes no attributes: compute each time
        pass
    return inverse


def _tiles(D: int) -> tuple[int, int]:
    return 32, min(128, max(16, triton.next_power_of_2(D)))


def _bwd_tiles(D: int, tiles: tuple[int, ...] | None = None) -> tuple[int, int, int, int, int, int]:
    """(BD, BT and row tiles per program and warps of the g kernel, BT and warps of the dx
    kernel); `tiles` (`KernelConfig.conv_bwd_tiles`) overrides. The default is the fastest of 17 tile sets
    on the H200 at 82k rows x 2048 channels
    (benchmarks/results/conv/2026-11-29-edc4f35-convtiles.json: 1.89 ms per backward against
    2.28 for 128-channel, 32-row tiles of 4 warps; dx's bits do not depend on the tiles)."""
    pow2 = max(16, triton.next_power_of_2(D))
    if tiles is not None:
        BD, BTg, nsub, wg, BTx, wx = tiles
        return min(BD, pow2), BTg, nsub, wg, BTx, wx
    return min(64, pow2), 16, 16, 2, 16, 2


class _ShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weight_DW, bias_D, window_TW, silu, tiles):
        T_in, D = x_TD.shape
        T, W = window_TW.shape  # output rows: one per window row
        x = x_TD.contiguous()
        w = weight_DW.contiguous()
        win = window_TW.to(torch.int64).contiguous()
        y = x.new_empty(T, D)
        BT, BD = _tiles(D)
        grid = (triton.cdiv(T, BT), triton.cdiv(D, BD))
        _conv_fwd_kernel[grid](x, win, w, bias_D if bias_D is not None else w, y, T, D=D, W=W, BT=BT, BD=BD,
                               HAS_BIAS=bias_D is not None, SILU=silu)
        ctx.save_for_backward(x, w, bias_D if bias_D is not None else w, win)
        ctx.has_bias, ctx.silu, ctx.tiles = bias_D is not None, silu, tiles
        # the inverse is cached on the caller's window tensor (the step's conv layers share it)
        ctx.inverse = (window_inverse(window_TW if win is window_TW else win, _bwd_tiles(D, tiles)[4], T_in)
                       if ctx.needs_input_grad[0] else None)
        return y

    @staticmethod
    def backward(ctx, dy_TD):
        x, w, b, win = ctx.saved_tensors
        T_in, D = x.shape
        T = win.shape[0]
        W = w.shape[1]
        BD, BTg, nsub, warps_g, BTx, warps_x = _bwd_tiles(D, ctx.tiles)
        BW = triton.next_power_of_2(W)
        progs = triton.cdiv(T, BTg * nsub)
        g = torch.empty(T, D, dtype=torch.float32, device=x.device)
        pdw = torch.empty(progs, BW, D, dtype=torch.float32, device=x.device)
        pdb = torch.empty(progs, D, dtype=torch.float32, device=x.device) if ctx.has_bias else pdw
        _conv_bwd_g_kernel[(progs, triton.cdiv(D, BD))](
            x, win, w, b, dy_TD.contiguous(), g, pdw, pdb, T, D=D, W=W, BT=BTg, BD=BD, BW=BW, NSUB=nsub,
            HAS_BIAS=ctx.has_bias, SILU=ctx.silu, num_warps=warps_g)
        inverse = ctx.inverse
        if inverse is None or inverse[3].numel() != triton.cdiv(T_in, BTx) or inverse[0].numel() != T_in + 1:
            inverse = window_inverse(win, BTx, T_in)
        ptr, ref, col, tile_pairs = inverse
        dx = torch.empty_like(x)
        _conv_bwd_dx_kernel[(triton.cdiv(T_in, BTx), triton.cdiv(D, BD))](
            g, w, ptr, ref, col, tile_pairs, dx, T_in, D=D, W=W, BT=BTx, BD=BD, num_warps=warps_x)
        dw = pdw.sum(dim=0)[:W].t().contiguous()
        db = pdb.sum(dim=0).to(b.dtype) if ctx.has_bias else None
        return dx, dw.to(w.dtype), db, None, None, None


def short_conv_fused(x_TD: torch.Tensor, weight_DW: torch.Tensor, bias_D: torch.Tensor | None, *,
                     window_TW: torch.Tensor, activation: str | None = "silu",
                     bwd_tiles: tuple[int, ...] | None = None) -> torch.Tensor:
    """`harts.exec.ops.conv.short_conv` (no carried state) as one fused Triton kernel each way.
    One output row per window row; the window's indices are rows of x (so the output may
    be another order of x's rows, some repeated: a gather fused into the conv). `bwd_tiles`:
    the backward's tiles (`_bwd_tiles`; None = the default)."""
    if activation not in ("silu", "swish", None):
        raise ValueError(f"unknown activation {activation!r}; expected 'silu', 'swish' or None")
    T, D = x_TD.shape
    W = weight_DW.shape[1]
    if weight_DW.shape != (D, W) or window_TW.dim() != 2 or window_TW.shape[1] != W:
        raise ValueError(
            f"expected weight [D, W] = [{D}, W] and window [T_out, W] = [T_out, {W}]; got "
            f"{list(weight_DW.shape)} and {list(window_TW.shape)}"
        )
    return _ShortConvFn.apply(x_TD, weight_DW, bias_D, window_TW, activation is not None,
                              None if bwd_tiles is None else tuple(bwd_tiles))
