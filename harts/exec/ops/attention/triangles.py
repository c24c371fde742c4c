"""A rectangle's attention backward as causal squares.

Part A of the split attention (a query segment over its ancestor keys, no mask) is a
rectangle. On cuDNN's flash backward a non-causal rectangle costs about 1.7x per attended
pair what a causal square does (one H100: 5.6-6.1 ps against 3.3-3.7,
benchmarks/results/attention/2026-12-06-492c23a-chain-attention-h100.json), the forwards
the same. An n x n square of pairs is two causal squares: the causal square over (Q, K),
diagonal included, and the strictly lower triangle of the two reversed, which is the causal
square over (Q reversed without its first row, K reversed without its last). So the
backward of an n x sn rectangle is s causal squares of n rows and s of n - 1, each set one
varlen call with the queries (and dO, o, lse) repeated per square. Each call, given the
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
    (0: never), at least that many queries (and 2), and the keys a multiple of them."""
    return min_rows > 0 and queries >= max(min_rows, 2) and keys > 0 and keys % queries == 0


def rectangle_backward(kern: VarlenKernel, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                       scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of every query over every key (no mask) from the union's o and lse, as
    causal squares (module docstring); rows on dim 0 of every tensor."""
    n, m = q.shape[0], k.shape[0]
    if not fits(n, m, 1):
        raise ValueError(f"{n} queries x {m} keys: the keys must be a nonzero multiple of the queries (>= 2)")
    s, H = m // n, q.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)

    def rep(x: Tensor) -> Tensor:
        return x.repeat(s, *([1] * (x.dim() - 1)))

    cu = np.arange(s + 1, dtype=np.int64) * n
    dq1, dk1, dv1 = kern.bwd(rep(do), rep(q), k, v, rep(o), rep(lse), kern.aux_for(cu, cu, H, q.device),
                             cu, cu, n, n, True, scale)

    def rev(x: Tensor) -> Tensor:  # queries reversed, the first dropped
        return rep(x.flip(0)[1:])

    def rev_keys(x: Tensor) -> Tensor:  # each square's keys reversed, the last dropped
        return x.view(s, n, *x.shape[1:]).flip(1)[:, :-1].reshape(s * (n - 1), *x.shape[1:])

    cu2 = np.arange(s + 1, dtype=np.int64) * (n - 1)
    dq2, dk2, dv2 = kern.bwd(rev(do), rev(q), rev_keys(k), rev_keys(v), rev(o), rev(lse),
                             kern.aux_for(cu2, cu2, H, q.device), cu2, cu2, n - 1, n - 1, True, scale)
    dq = dq1.to(wide).view(s, n, *q.shape[1:]).sum(0)
    dq[:-1] += dq2.to(wide).view(s, n - 1, *q.shape[1:]).sum(0).flip(0)
    out = [dq.to(q.dtype)]
    for first, second, like in ((dk1, dk2, k), (dv1, dv2, v)):
        d = first.to(wide).view(s, n, *like.shape[1:])
        d[:, 1:] += second.to(wide).view(s, n - 1, *like.shape[1:]).flip(1)
        out.append(d.view(like.shape).to(like.dtype))
    return out[0], out[1], out[2]
