"""Row gathers whose backward is a gather, not a scatter-add.

`x[index]` is how the tree executor builds the inputs of a KDA round (the round's rows,
sequence after sequence, replayed rows repeated) and reads the kept outputs back. Autograd's
backward of advanced indexing zero-fills a source-sized gradient, then scatter-adds into
it with a sort-based kernel, once per call; the round's gradients then add up as
source-sized tensors. On the H200 that was 48 ms of the 1.43 s swe-treestep-1 tree step
(`IndexBackward0`: fill, index_put, add; benchmarks/results/h200_session5/s5c).

`RowGather` is built once per layout from the host index: the positions where each source
row first occurs (a gather by their inverse when every source row occurs or at least half
of them do, the others zeroed after; otherwise one `index_copy_` into zeros) and, for rows
that occur more than once (replayed rows), one `index_add_` per further occurrence level,
each level's rows distinct. No atomics collide, so the result is deterministic, and a
row's gradient is summed in the order of its occurrences, as the sort-based scatter does.
Several tensors gathered by the same index share one autograd node; an identity index
(every row once, in order) returns its inputs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from harts.exec.transfer import to_device


class RowGather:
    """x[index] for tensors of `num_rows` rows; `index` is a host int array."""

    def __init__(self, index: np.ndarray, num_rows: int, device):
        index = np.asarray(index, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= num_rows):
            raise ValueError(f"gather index out of range [0, {num_rows})")
        self.num_rows = int(num_rows)
        self.size = int(index.size)
        order = np.argsort(index, kind="stable")
        srt = index[order]
        first = np.ones(srt.size, dtype=bool)
        first[1:] = srt[1:] != srt[:-1]
        start = np.maximum.accumulate(np.where(first, np.arange(srt.size), 0)) if srt.size else srt
        occurrence = np.empty(index.size, dtype=np.int64)
        occurrence[order] = np.arange(srt.size) - start
        levels = []
        for k in range(int(occurrence.max()) + 1 if index.size else 0):
            pos = np.flatnonzero(occurrence == k)
            levels.append((pos, index[pos]))
        self.index = to_device(index, device)
        # every row once, in order (a one-sequence round: a stepwise chain): x[index] is x
        self.identity = index.size == num_rows and bool((index == np.arange(num_rows)).all())
        self.covers_all = bool(levels) and levels[0][0].size == num_rows
        # most source rows occur (a KDA round's outputs read back: all but the replayed rows'
        # second copies): the gradient still starts as a gather, and the few rows that never
        # occur are zeroed after (one pass, not a zero-fill, a gather and a scatter: the
        # tree step's out-gather backward, 3.8 ms of fill and index_copy_ in s7c)
        self.mostly = bool(levels) and not self.covers_all and 2 * levels[0][0].size >= num_rows
        if self.covers_all or self.mostly:  # its gradient starts as a gather
            inverse = np.zeros(num_rows, dtype=np.int64)
            inverse[levels[0][1]] = levels[0][0]
            missing = np.ones(num_rows, dtype=bool)
            missing[levels[0][1]] = False
            self.first = (to_device(inverse, device), to_device(np.flatnonzero(missing), device)
                          if self.mostly else None)
        else:
            self.first = (to_device(levels[0][0], device), to_device(levels[0][1], device)) if levels else None
        self.more = [(to_device(p, device), to_device(r, device)) for p, r in levels[1:]]

    def __call__(self, *xs: Tensor) -> tuple[Tensor, ...]:
        for x in xs:
            if x.shape[0] != self.num_rows:
                raise ValueError(f"gather over {self.num_rows} rows given a tensor of {x.shape[0]}")
        if self.identity:  # no copy each way (the stepwise tree step's KDA rounds: ~5 ms, s7a)
            return tuple(xs)
        return _RowGatherFn.apply(self, *xs)

    def backward(self, g: Tensor) -> Tensor:
        shape = (self.num_rows, *g.shape[1:])
        if self.covers_all:
            out = g.index_select(0, self.first[0])
        elif self.mostly:
            out = g.index_select(0, self.first[0]).index_fill_(0, self.first[1], 0)
        else:
            out = g.new_zeros(shape)
            if self.first is not None:
                out.index_copy_(0, self.first[1], g.index_select(0, self.first[0]))
        for pos, rows in self.more:
            out.index_add_(0, rows, g.index_select(0, pos))
        return out


class _RowGatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gather: RowGather, *xs: Tensor):
        ctx.gather = gather
        ctx.needs = [x.requires_grad for x in xs]
        return tuple(x.index_select(0, gather.index) for x in xs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        out = [None]
        for need, g in zip(ctx.needs, grads, strict=True):
            out.append(ctx.gather.backward(g.contiguous()) if need and g is not None else None)
        return tuple(out)
