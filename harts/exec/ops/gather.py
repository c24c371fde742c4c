"""Row gathers whose backward is a gather, not a scatter-add.

`x[index]` is how the tree executor builds the inputs of a KDA round (the round's rows,
sequence after sequence, replayed rows repeated) and reads the kept outputs back. Autograd's
backward of advanced indexing zero-fills a source-sized gradient, then scatter-adds into
it with a sort-based kernel, once per call; the round's gradients then add up as
source-sized tensors. On the H200 that was 48 ms of the 1.43 s swe-treestep-1 tree step
(`IndexBackward0`: fill, index_put, add;
benchmarks/results/profile/2026-11-29-eda63d2-opsites.json).

`RowGather` is built once per layout from the host index. On CUDA its backward is one
launch: a gather by the inverse permutation where every source row occurs once, else one
fixed-order gather-add (`segment_sum.gather_add`: each source row's occurrences summed in
fp32 in ascending order, rounded once; its inverse built on the host). Elsewhere (and for
float64) it runs by occurrence levels: the positions where each source row first occurs
(a gather by their inverse when every source row occurs or at least half of them do, the
others zeroed after; otherwise one `index_copy_` into zeros) and, for rows that occur more
than once (replayed rows), one `index_add_` per further occurrence level, each level's
rows distinct. No atomics collide either way, so the result is deterministic, and a row's
gradient is summed in the order of its occurrences, as the sort-based scatter does.
Several tensors gathered by the same index share one autograd node; an identity index
(every row once, in order) returns its inputs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from harts.exec.transfer import to_device


class RowGather:
    """x[index] for tensors of `num_rows` rows; `index` is a host int array.

    The backward sums each source row's gradients over its occurrences in `index`. On CUDA
    (or where `gather_add` asks for it) that is one fixed-order gather-add
    (`segment_sum.gather_add`: fp32 sums, one launch) unless every row occurs exactly once
    in some order (one gather by the inverse permutation, also one launch). By occurrence
    levels it would be a zero-fill, a gather and a copy for a gather that leaves rows out,
    and a gather and an `index_add_` per further level: a row occurs once per sequence
    below a fork where a KDA round reads the fork's last partial chunk again, so those
    levels were the launches a step paid per sequence, per tensor, layer and pass. A row
    read once is copied exactly either way; float64 keeps the levels (the gather-add sums
    in fp32)."""

    def __init__(self, index: np.ndarray, num_rows: int, device, gather_add: bool | None = None):
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
        self.index_host = index
        # every row once, in order (a one-sequence round: a stepwise chain): x[index] is x
        self.identity = index.size == num_rows and bool((index == np.arange(num_rows)).all())
        self.covers_all = bool(levels) and levels[0][0].size == num_rows
        # most source rows occur (a KDA round's outputs read back: all but the replayed rows'
        # second copies): the gradient still starts as a gather, and the few rows that never
        # occur are zeroed after (one pass, not a zero-fill, a gather and a scatter: the
        # tree step's out-gather backward, 3.8 ms of fill and index_copy_ in
        # benchmarks/results/profile/2026-11-29-334d11c-opsites.json)
        self.mostly = bool(levels) and not self.covers_all and 2 * levels[0][0].size >= num_rows
        if gather_add is None:
            gather_add = torch.device(device).type == "cuda"
        if self.covers_all or self.mostly:  # its gradient starts as a gather
            inverse = np.zeros(num_rows, dtype=np.int64)
            inverse[levels[0][1]] = levels[0][0]
            missing = np.ones(num_rows, dtype=bool)
            missing[levels[0][1]] = False
            first = (inverse, np.flatnonzero(missing) if self.mostly else None)
        else:
            first = (levels[0][0], levels[0][1]) if levels else None
        self._device = device
        self._levels_host = (first, levels[1:])
        self.first = self.more = None  # the occurrence levels on the device (`_levels`)
        self.inverse = None  # (ptr, order, tile_pairs) on the device, for the gather-add
        if gather_add and levels and not (self.covers_all and len(levels) == 1):
            from harts.exec.ops import segment_sum

            self.inverse = tuple(to_device(a, device)
                                 for a in segment_sum.inverse_host(index, self.num_rows, segment_sum.BT))
        else:
            self._levels()

    def _levels(self) -> None:
        """The occurrence levels' index arrays copied to the device (once; a gather-add
        gather needs them only for a float64 gradient)."""
        if self.more is not None:
            return
        first, more = self._levels_host
        dev = self._device
        self.first = None if first is None else tuple(None if a is None else to_device(a, dev) for a in first)
        self.more = [(to_device(p, dev), to_device(r, dev)) for p, r in more]

    def __call__(self, *xs: Tensor) -> tuple[Tensor, ...]:
        for x in xs:
            if x.shape[0] != self.num_rows:
                raise ValueError(f"gather over {self.num_rows} rows given a tensor of {x.shape[0]}")
        if self.identity:  # no copy each way (the stepwise tree step's KDA rounds: ~5 ms,
            # benchmarks/results/profile/2026-11-29-6799d3c-opsites.json)
            return tuple(xs)
        return _RowGatherFn.apply(self, *xs)

    def backward(self, g: Tensor) -> Tensor:
        if self.inverse is not None and g.dtype != torch.float64:
            from harts.exec.ops import segment_sum

            return segment_sum.gather_add(None, g, self.inverse, rows=self.num_rows)
        self._levels()
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


class RowPlace:
    """Rows of two sources placed into one tensor of `num_rows` rows: `own` rows at
    `own_at`, `src` rows `src_rows` at `src_at`, every other row zero (a sharing-window
    consumer's local rows: its producer's stashed rows of its context rows, its own
    computed rows, zeros for context rows the stash does not keep for this input).

    The forward joins [the placed source rows | the own rows (| one zero row)] with one
    `cat` and, unless that already is the layout (a consumer whose context rows all come
    before its computed rows, as its root path's do on a chain or under one shared prompt),
    puts the rows in place with one row gather; the backward gathers the output's gradient
    back into that order and splits it (views where the sources are taken whole). Where
    the other rows are few against the own ones (a KDA round's replayed context rows), the
    own rows are gathered into place in one pass and the others written over them. Every
    row is copied, never summed, so values and gradients are the indexing's bit for bit;
    no scatter-add, no atomics. Before, the rows went in by `index_copy_`, whose
    element-wise kernel took 14.7 ms of an H100 window step on grpo/2@16384
    (benchmarks/results/windows/2026-12-06-744bbd7-window-anatomy-grpo2-h100.json); and
    before that, `cat([cat([src, zero_row])[pick], own])[inverse]`, whose two
    advanced-indexing backwards each zero-filled and scatter-added (sort-based) into a
    full-size gradient. Several tensors placed by the same positions share one autograd
    node."""

    def __init__(self, num_rows: int, own_at: np.ndarray, src_at: np.ndarray, src_rows: np.ndarray,
                 num_src: int, device):
        own_at, src_at, src_rows = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (own_at, src_at, src_rows))
        if src_at.size != src_rows.size:
            raise ValueError("src_at and src_rows must have one entry per placed source row")
        placed = np.concatenate([own_at, src_at])
        if placed.size and (placed.min() < 0 or placed.max() >= num_rows):
            raise ValueError(f"positions out of range [0, {num_rows})")
        if np.unique(placed).size != placed.size:
            raise ValueError("each position takes one row")
        if src_rows.size and (src_rows.min() < 0 or src_rows.max() >= num_src or np.unique(src_rows).size != src_rows.size):
            raise ValueError(f"source rows must be distinct and in [0, {num_src})")
        self.num_rows, self.num_own, self.num_src = int(num_rows), int(own_at.size), int(num_src)
        n_src = int(src_at.size)
        self.full = placed.size == num_rows  # no zero rows to fill
        # the joined rows: [src rows src_rows | own rows | a zero row where not full]
        self.src_whole = n_src == num_src and bool((src_rows == np.arange(num_src)).all())
        self.src_pick = None if self.src_whole else to_device(src_rows, device)
        perm = np.full(num_rows, n_src + own_at.size, dtype=np.int64)  # unplaced: the zero row
        perm[src_at] = np.arange(n_src)
        perm[own_at] = n_src + np.arange(own_at.size)
        self.in_place = self.full and bool((perm == np.arange(num_rows)).all())
        # few rows besides the own ones (a KDA round's replayed context rows among a
        # consumer's own): the own rows gathered into place in one pass, the others
        # written over them, rather than a join and a gather (two passes over every row)
        others = num_rows - own_at.size
        self.own_first = not self.in_place and own_at.size > 0 and 4 * others <= own_at.size
        if self.own_first:
            own_perm = np.zeros(num_rows, dtype=np.int64)
            own_perm[own_at] = np.arange(own_at.size)
            self.own_perm = to_device(own_perm, device)
            self.src_at = to_device(src_at, device) if n_src else None
            zero_at = np.setdiff1d(np.arange(num_rows), placed) if not self.full else np.zeros(0, np.int64)
            self.zero_at = to_device(zero_at, device) if zero_at.size else None
            self.own_at = to_device(own_at, device)
        self.perm = None if self.in_place or self.own_first else to_device(perm, device)
        # the gradient of the joined rows: each one's position in the output
        self.back = None if self.in_place or self.own_first else to_device(np.concatenate([src_at, own_at]), device)
        self.n_placed_src = n_src
        # the source's gradient from its placed rows' (in src_rows order): a gather from
        # [placed | zero row], rows never read taking the zero row, where most are read;
        # else a copy into zeros
        self.src_mostly = 2 * n_src >= num_src
        if not self.src_whole:
            if self.src_mostly:
                where = np.full(num_src, n_src, dtype=np.int64)
                where[src_rows] = np.arange(n_src)
                self.src_from = to_device(where, device)
                self.src_unread = bool((where == n_src).any())
            else:
                self.src_rows = to_device(src_rows, device)

    def __call__(self, src: tuple[Tensor | tuple[Tensor, ...], ...], own: tuple[Tensor, ...]
                 ) -> tuple[Tensor, ...]:
        """Each source a tensor, or a tuple of tensors whose rows, one part after another,
        are the source's (a piece of a chain reading its producers' stashes): where the
        source is taken whole the parts are joined with the own rows in the one `cat`,
        rather than joined first and copied again."""
        if len(src) != len(own):
            raise ValueError("one source tensor per own tensor")
        parts = [(s,) if isinstance(s, Tensor) else tuple(s) for s in src]
        for ps, o in zip(parts, own, strict=True):
            n = sum(p.shape[0] for p in ps)
            if not ps or n != self.num_src or o.shape[0] != self.num_own or any(p.dtype != o.dtype for p in ps):
                raise ValueError(f"placing {self.num_src} + {self.num_own} rows of one dtype given "
                                 f"{n} {ps[0].dtype if ps else None} + {o.shape[0]} {o.dtype}")
        counts = tuple(len(ps) for ps in parts)
        return _RowPlaceFn.apply(self, counts, *(p for ps in parts for p in ps), *own)

    def forward(self, s: tuple[Tensor, ...], o: Tensor) -> Tensor:
        """The placed rows from the source's parts `s` and the own rows `o`."""
        if self.own_first or self.src_pick is not None:
            s = s[0] if len(s) == 1 else torch.cat(s)
        if self.own_first:
            out = o[self.own_perm]
            if self.src_at is not None:
                out.index_copy_(0, self.src_at, s if self.src_pick is None else s[self.src_pick])
            if self.zero_at is not None:
                out.index_fill_(0, self.zero_at, 0)
            return out
        parts = [*s, o] if self.src_pick is None else [s[self.src_pick], o]
        if not self.full:
            parts.append(o.new_zeros((1, *o.shape[1:])))
        joined = torch.cat(parts)
        return joined if self.in_place else joined[self.perm]

    def backward(self, g: Tensor, need_src: bool, need_own: bool) -> tuple[Tensor | None, Tensor | None]:
        """(gradient of the source, of the own rows) from the output's."""
        n = self.n_placed_src
        if self.own_first:
            g_own = g[self.own_at] if need_own else None
            if not need_src:
                return None, g_own
            placed = g[self.src_at] if self.src_at is not None else g[:0]
        else:
            joined = g if self.in_place else g[self.back]
            g_own = joined[n:n + self.num_own] if need_own else None
            if not need_src:
                return None, g_own
            placed = joined[:n]
        if self.src_whole:
            return placed, g_own
        if self.src_mostly:
            padded = torch.cat([placed, placed.new_zeros((1, *placed.shape[1:]))]) if self.src_unread else placed
            return padded[self.src_from], g_own
        out = g.new_zeros((self.num_src, *g.shape[1:]))
        return out.index_copy_(0, self.src_rows, placed), g_own


class _RowPlaceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, place: RowPlace, counts: tuple[int, ...], *xs: Tensor):
        n = sum(counts)
        ends = np.cumsum((0, *counts)).tolist()
        src = [xs[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)]
        own = xs[n:]
        ctx.place = place
        ctx.sizes = [[p.shape[0] for p in ps] for ps in src]
        ctx.needs = [[p.requires_grad for p in ps] for ps in src], [x.requires_grad for x in own]
        return tuple(place.forward(s, o) for s, o in zip(src, own, strict=True))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        place = ctx.place
        needs_src, needs_own = ctx.needs
        src, own = [], []
        for g, need_parts, sizes, need_own in zip(grads, needs_src, ctx.sizes, needs_own, strict=True):
            need_src = any(need_parts)
            if g is None or not (need_src or need_own):
                src += [None] * len(sizes)
                own.append(None)
                continue
            a, b = place.backward(g.contiguous(), need_src, need_own)
            if a is None:
                src += [None] * len(sizes)
            else:  # each part's rows of the source's gradient (views)
                src += [p if need else None for p, need in zip(a.split(sizes), need_parts, strict=True)]
            own.append(b)
        return (None, None, *src, *own)
