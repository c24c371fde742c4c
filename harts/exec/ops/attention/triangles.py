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


def rectangle_backward(kern: VarlenKernel, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                       scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of every query over every key (no mask) from the union's o and lse: the
    rectangle tiled by squares of its shorter side along its longer one, each square as
    two causal calls (module docstring), what is left over (a strip narrower than a
    square) as one plain call; rows on dim 0 of every tensor."""
    n, m = q.shape[0], k.shape[0]
    if not fits(n, m, 1):
        raise ValueError(f"{n} queries x {m} keys: squares need both sides of at least 2 rows")
    side, s = squares(n, m)
    dev, H = q.device, q.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    at = torch.arange(s, device=dev)[:, None] * side + torch.arange(side, device=dev)[None, :]
    same = torch.arange(side, device=dev).expand(s, side)
    # the squares' query and key rows, [s, side]: along the keys (queries repeated) or along
    # the queries (keys repeated)
    qi, ki = (same, at) if n <= m else (at, same)
    dq = torch.zeros(q.shape, dtype=wide, device=dev)
    dk = torch.zeros(k.shape, dtype=wide, device=dev)
    dv = torch.zeros(v.shape, dtype=wide, device=dev)

    def run(qrows: Tensor, krows: Tensor, causal: bool) -> None:
        qr, kr = qrows.reshape(-1), krows.reshape(-1)
        cu_q = np.arange(qrows.shape[0] + 1, dtype=np.int64) * qrows.shape[1]
        cu_k = np.arange(krows.shape[0] + 1, dtype=np.int64) * krows.shape[1]
        g = kern.bwd(do[qr], q[qr], k[kr], v[kr], o[qr], lse[qr], kern.aux_for(cu_q, cu_k, H, dev), cu_q, cu_k,
                     qrows.shape[1], krows.shape[1], causal, scale)
        dq.index_add_(0, qr, g[0].to(wide))
        dk.index_add_(0, kr, g[1].to(wide))
        dv.index_add_(0, kr, g[2].to(wide))

    run(qi, ki, True)  # each square's lower triangle, diagonal included
    run(qi.flip(1)[:, 1:], ki.flip(1)[:, :-1], True)  # its strict upper triangle, reversed
    if s * side < max(n, m):  # the strip left over: every query over the keys past the squares, or the reverse
        rest = torch.arange(s * side, max(n, m), device=dev)[None, :]
        full = torch.arange(min(n, m), device=dev)[None, :]
        run(*((full, rest) if n <= m else (rest, full)), False)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
