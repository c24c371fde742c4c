"""A rectangle's attention backward as causal squares.

Part A of the split attention (a query segment over its ancestor keys, no mask) is a
rectangle. On cuDNN's flash backward a non-causal rectangle costs about 1.7x per attended
pair what a causal square does (one H100: 5.6-6.1 ps against 3.3-3.7,
benchmarks/results/attention/2026-12-06-492c23a-chain-attention-h100.json), the forwards
the same. An n x n square of pairs is two causal squares: the causal square over (Q, K),
diagonal included, and the strictly lower triangle of the two reversed, which is the causal
square over (Q reversed without its first row, K reversed without its last). So a
rectangle's backward is its tiling by squares of its shorter side (s of them along the
longer side), s causal squares of that many rows and s of one row fewer, each set one
varlen call with the shorter side's rows repeated per square, and one plain call for the
strip left over where the longer side is no multiple of the shorter. Each call, given the
union's o and lse, returns its exact share of dq, dk and dv (the split's identity: the
probabilities and the row term are the union's), and the shares add up. The values are
the one call's up to the order of the sums (float32, then the inputs' dtype).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from harts.exec.ops.attention.kernel import VarlenKernel


def fits(queries: int, keys: int, min_rows: int) -> bool:
    """Whether a rectangle of `queries` x `keys` pairs takes the squares: `min_rows` > 0
    (0: never) and its shorter side at least that many rows (and 2)."""
    return min_rows > 0 and min(queries, keys) >= max(min_rows, 2)


def squares(queries: int, keys: int) -> tuple[int, int]:
    """(side, count): the squares tiling a rectangle along its longer side."""
    side = min(queries, keys)
    return side, max(queries, keys) // side


# rows of the longer side per group of squares: the squares' query and key rows are
# gathered per call (the shorter side's rows once per square) and their gradient shares
# come back in float32, so one call over every square held about 36 KB per row of a
# 240k-row context at once (tiny-h200's MLA: a 262k trajectory's chain at a 32k budget);
# groups of at most this many rows bound that, each writing its own range of the longer
# side's gradients
GROUP_ROWS = 65536


def rectangle_backward(kern: VarlenKernel, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                       scale: float, group_rows: int = GROUP_ROWS) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of every query over every key (no mask) from the union's o and lse: the
    rectangle tiled by squares of its shorter side along its longer one, each square as
    two causal calls (module docstring), what is left over (a strip narrower than a
    square) as one plain call; rows on dim 0 of every tensor. The squares run in groups
    of at most `group_rows` rows of the longer side (at least one square each): a group's
    range of the longer side's gradients is complete when its two calls are, and only the
    shorter side's gradients add up over the groups (in float32)."""
    n, m = q.shape[0], k.shape[0]
    if not fits(n, m, 1):
        raise ValueError(f"{n} queries x {m} keys: squares need both sides of at least 2 rows")
    side, s = squares(n, m)
    dev, H = q.device, q.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    along_keys = n <= m  # the squares lie along the keys (queries repeated), else along the queries
    # the shorter side's gradients, summed over every square and the strip
    short = [torch.zeros(t.shape, dtype=wide, device=dev) for t in ((q,) if along_keys else (k, v))]
    out = [torch.empty_like(t) for t in (q, k, v)]

    def run(qrows: Tensor, krows: Tensor, causal: bool, long_acc: list[Tensor], lo: int) -> None:
        qr, kr = qrows.reshape(-1), krows.reshape(-1)
        cu_q = np.arange(qrows.shape[0] + 1, dtype=np.int64) * qrows.shape[1]
        cu_k = np.arange(krows.shape[0] + 1, dtype=np.int64) * krows.shape[1]
        g = kern.bwd(do[qr], q[qr], k[kr], v[kr], o[qr], lse[qr], kern.aux_for(cu_q, cu_k, H, dev), cu_q, cu_k,
                     qrows.shape[1], krows.shape[1], causal, scale)
        if along_keys:
            short[0].index_add_(0, qr, g[0].to(wide))
            long_acc[0].index_add_(0, kr - lo, g[1].to(wide))
            long_acc[1].index_add_(0, kr - lo, g[2].to(wide))
        else:
            long_acc[0].index_add_(0, qr - lo, g[0].to(wide))
            short[0].index_add_(0, kr, g[1].to(wide))
            short[1].index_add_(0, kr, g[2].to(wide))

    def long_range(lo: int, hi: int) -> list[Tensor]:
        ts = (k, v) if along_keys else (q,)
        return [torch.zeros((hi - lo, *t.shape[1:]), dtype=wide, device=dev) for t in ts]

    def write(long_acc: list[Tensor], lo: int, hi: int) -> None:
        for t, acc in zip(out[1:] if along_keys else out[:1], long_acc, strict=True):
            t[lo:hi] = acc.to(t.dtype)

    per = max(1, int(group_rows) // side)
    for g0 in range(0, s, per):
        g1 = min(s, g0 + per)
        lo, hi = g0 * side, g1 * side
        at = torch.arange(g0, g1, device=dev)[:, None] * side + torch.arange(side, device=dev)[None, :]
        same = torch.arange(side, device=dev).expand(g1 - g0, side)
        # the group's query and key rows, [squares, side]
        qi, ki = (same, at) if along_keys else (at, same)
        acc = long_range(lo, hi)
        run(qi, ki, True, acc, lo)  # each square's lower triangle, diagonal included
        run(qi.flip(1)[:, 1:], ki.flip(1)[:, :-1], True, acc, lo)  # its strict upper triangle, reversed
        write(acc, lo, hi)
    if s * side < max(n, m):  # the strip left over: every query over the keys past the squares, or the reverse
        lo, hi = s * side, max(n, m)
        rest = torch.arange(lo, hi, device=dev)[None, :]
        full = torch.arange(min(n, m), device=dev)[None, :]
        acc = long_range(lo, hi)
        run(*((full, rest) if along_keys else (rest, full)), False, acc, lo)
        write(acc, lo, hi)
    for t, acc in zip(out[:1] if along_keys else out[1:], short, strict=True):
        t.copy_(acc.to(t.dtype))
    return out[0], out[1], out[2]
