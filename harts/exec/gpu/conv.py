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

Backward (same tiles, pre recomputed): g = dy * silu'(pre); db = sum_t g; dW[:, j] =
sum_t x[window[t, j]] * g[t]; dx[window[t, j]] += weight[:, j] * g[t]. The three sums run
with fp32 atomic adds, so gradients are deterministic only up to the order of those adds.

The default on CUDA (harts.exec.backend.conv_impl; `HARTS_CONV=reference` switches back):
on the H200 at 82k rows x 2048 channels, bf16, 0.32 vs 3.4 ms forward and 6.7 vs 11.2 ms
forward+backward against the gather form (benchmarks/results/h200_session3/conv.json).
CI checks it under TRITON_INTERPRET=1 against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _conv_bwd_kernel(x, win, w, b, dy, dx, dw, db, T, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    g = tl.load(dy + o_t[:, None] * D + o_d[None, :], mask=m_td, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre_activation(x, win, w, b, o_t, o_d, m_t, m_d, D, W, BT, BD, HAS_BIAS)
        sig = tl.sigmoid(pre)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    if HAS_BIAS:
        tl.atomic_add(db + o_d, tl.sum(g, axis=0), mask=m_d)
    for j in tl.static_range(W):
        rows = tl.load(win + o_t * W + j, mask=m_t, other=-1)
        ok = (rows >= 0) & m_t
        m = ok[:, None] & m_d[None, :]
        xj = tl.load(x + rows[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        wj = tl.load(w + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
        tl.atomic_add(dw + o_d * W + j, tl.sum(xj * g, axis=0), mask=m_d)
        tl.atomic_add(dx + rows[:, None] * D + o_d[None, :], g * wj[None, :], mask=m)


def _tiles(D: int) -> tuple[int, int]:
    return 32, min(128, max(16, triton.next_power_of_2(D)))


class _ShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weight_DW, bias_D, window_TW, silu):
        T, D = x_TD.shape
        W = weight_DW.shape[1]
        x = x_TD.contiguous()
        w = weight_DW.contiguous()
        win = window_TW.to(torch.int64).contiguous()
        y = torch.empty_like(x)
        BT, BD = _tiles(D)
        grid = (triton.cdiv(T, BT), triton.cdiv(D, BD))
        _conv_fwd_kernel[grid](x, win, w, bias_D if bias_D is not None else w, y, T, D=D, W=W, BT=BT, BD=BD,
                               HAS_BIAS=bias_D is not None, SILU=silu)
        ctx.save_for_backward(x, w, bias_D if bias_D is not None else w, win)
        ctx.has_bias, ctx.silu = bias_D is not None, silu
        return y

    @staticmethod
    def backward(ctx, dy_TD):
        x, w, b, win = ctx.saved_tensors
        T, D = x.shape
        W = w.shape[1]
        dx = torch.zeros(T, D, dtype=torch.float32, device=x.device)
        dw = torch.zeros(D, W, dtype=torch.float32, device=x.device)
        db = torch.zeros(D, dtype=torch.float32, device=x.device)
        BT, BD = _tiles(D)
        grid = (triton.cdiv(T, BT), triton.cdiv(D, BD))
        _conv_bwd_kernel[grid](x, win, w, b, dy_TD.contiguous(), dx, dw, db, T, D=D, W=W, BT=BT, BD=BD,
                               HAS_BIAS=ctx.has_bias, SILU=ctx.silu)
        return dx.to(x.dtype), dw.to(w.dtype), (db.to(b.dtype) if ctx.has_bias else None), None, None


def short_conv_fused(x_TD: torch.Tensor, weight_DW: torch.Tensor, bias_D: torch.Tensor | None, *,
                     window_TW: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """`harts.exec.ops.conv.short_conv` (no carried state) as one fused Triton kernel each way."""
    if activation not in ("silu", "swish", None):
        raise ValueError(f"unknown activation {activation!r}; expected 'silu', 'swish' or None")
    T, D = x_TD.shape
    W = weight_DW.shape[1]
    if weight_DW.shape != (D, W) or window_TW.shape != (T, W):
        raise ValueError(
            f"expected weight [D, W] = [{D}, W] and window [T, W] = [{T}, {W}]; got "
            f"{list(weight_DW.shape)} and {list(window_TW.shape)}"
        )
    return _ShortConvFn.apply(x_TD, weight_DW, bias_D, window_TW, activation is not None)
