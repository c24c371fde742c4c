"""What a producer microbatch hands its consumers in a sharing window: the `Stash` its
tree context records (every mixing input over its computed rows, the KDA states its rounds
hand on), cut to the `StashNeeds` of its consumers, and the detached leaves they read it
through (`harts.exec.tree.TreeContext` records and reads it; `harts.exec.window` runs the
windows).

In a chain of windows every piece's stash holds only rows it computed, and a piece reads
the rows above it from each producer up its chain by reference (`ChainStash`: its
producers' leaves, joined farthest first), so what a chain keeps is linear in its length; each
row's gradient lands on the leaves of the piece that computed it, whose backward runs
after every reader's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from harts.exec.ops.gather import RowGather
from harts.exec.tree_layout import KDASchedule, chunk_state_of


def stash_category(name: str) -> str:
    """Which row set a mixing input needs: attention keys/values, conv inputs or KDA inputs."""
    return "attention" if name == "attention" else ("conv" if name.startswith("conv:") else "kda")


@dataclass
class StashNeeds:
    """The producer rows (global ids, ascending) consumers read, per kind of state."""

    attention: np.ndarray  # context rows: every consumer row attends its ancestors
    conv: np.ndarray  # the W-1 rows above each consumer root
    kda: np.ndarray  # rows replayed by consumer KDA sequences
    states: list[tuple[int, int]]  # (global row at depth a-1, a): S(a) at consumer starts

    @classmethod
    def union(cls, needs: list[StashNeeds]) -> StashNeeds:
        def cat(name: str) -> np.ndarray:
            parts = [getattr(n, name) for n in needs]
            return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

        states = sorted({s for n in needs for s in n.states})
        return cls(cat("attention"), cat("conv"), cat("kda"), states)

    def split(self, rows: np.ndarray) -> tuple[StashNeeds, StashNeeds]:
        """(these needs on the given rows, the rest): in a chain of windows, what the
        producer computing `rows` keeps for a reader, and what producers further up keep.
        A state belongs to the producer computing its row (the row at depth a-1)."""
        def part(x: np.ndarray, inside: bool) -> np.ndarray:
            return x[np.isin(x, rows) == inside]

        def states(inside: bool) -> list[tuple[int, int]]:
            return [(r, a) for r, a in self.states if bool(np.isin(r, rows)) == inside]

        return tuple(StashNeeds(part(self.attention, inside), part(self.conv, inside), part(self.kda, inside),
                                states(inside)) for inside in (True, False))

    @property
    def empty(self) -> bool:
        return not (self.attention.size or self.conv.size or self.kda.size or self.states)

    @classmethod
    def chain(cls, needs: Sequence[StashNeeds]) -> StashNeeds:
        """The rows a reader of a chain of stashes (`needs` nearest producer first, as
        `ChainStash` takes them) finds, in the order it finds them: the farthest stash's
        kept rows first, each nearer one's after them."""
        if len(needs) == 1:
            return needs[0]
        needs = list(needs)[::-1]

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(n, name) for n in needs])

        return cls(cat("attention"), cat("conv"), cat("kda"), [s for n in needs for s in n.states])


def locate(kept: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found, at): which of `rows` are among the distinct `kept` rows, and where (`at` is
    valid where found). `kept` need not be ascending (a `ChainStash`'s rows)."""
    kept, rows = np.asarray(kept, np.int64), np.asarray(rows, np.int64)
    if not kept.size:
        return np.zeros(rows.size, bool), np.zeros(rows.size, np.int64)
    ascending = bool((kept[1:] > kept[:-1]).all())
    order = None if ascending else np.argsort(kept, kind="stable")
    srt = kept if order is None else kept[order]
    at = np.minimum(np.searchsorted(srt, rows), srt.size - 1)
    found = srt[at] == rows
    return found, (at if order is None else order[at])


def _own_storage(grad: Tensor) -> Tensor:
    return grad.clone() if grad._base is not None else grad


def _leaf(t: Tensor) -> Tensor:
    """A detached leaf copy of a stashed tensor for consumers to read. Its gradient keeps
    storage of its own: a consumer reads a leaf through a cat or a placement whose backward
    hands it a slice of a wider gradient, and autograd would keep that slice (and so the
    whole wider buffer, e.g. a conv input's gradient over all the consumer's rows) as the
    leaf's `.grad` until the producer's backward. Later consumers add in place. (The hook
    does not look at the leaf: a reference to it would make a cycle that only the garbage
    collector frees, holding the stash past its window.)"""
    leaf = t.detach().requires_grad_(t.requires_grad)
    if leaf.requires_grad:
        leaf.register_hook(_own_storage)
    return leaf


class StashPart:
    """One kept attention input of a stash (keys or values over the rows consumers read),
    read through `read()` rather than a detached leaf: on the device, or, once
    `copy_to_host` moved it, from host memory, copied in for each read. Its gradient is
    accumulated where the tensor lives when each reader's backward runs (`grad` on the
    device, `grad_host` in host memory; a reader whose forward ran before the move has its
    backward land in host memory too), in the readers' order, each reader's gradient added
    in the tensor's dtype as autograd adds into a leaf's `.grad`: the values do not depend
    on where it lives.

    `out` is the producer's tensor, which its backward runs through; moving it frees its
    device storage (`untyped_storage().resize_(0)`, after every part of the stash was
    copied out: keys and values may be views of one projection's output): the producer's
    graph needs its `grad_fn`, not its data, where the producer recomputes its blocks in
    its backward (the stash is then the only holder of that storage; a producer that stores
    its activations may have saved it, and is never moved: `harts.exec.layouts.plan`)."""

    __slots__ = ("_anchor", "device", "grad", "grad_host", "host", "out", "stream")

    def __init__(self, t: Tensor):
        self.out = t
        self.device = t.device
        self.host: Tensor | None = None
        self.grad: Tensor | None = None
        self.grad_host: Tensor | None = None
        self.stream = None  # the copy stream on CUDA, once moved
        # the read's only autograd input: its output requires grad where the kept tensor does
        self._anchor = torch.empty(0).requires_grad_(t.requires_grad)

    def read(self) -> Tensor:
        """The tensor on its device, for one reader (autograd hands its gradient back here)."""
        return _StashRead.apply(self, self._anchor)

    def nbytes(self) -> int:
        return self.out.numel() * self.out.element_size()

    def copy_to_host(self, stream=None) -> int:
        """Copy the tensor and the gradient accumulated so far to host memory (pinned, on
        `stream`, on CUDA); reads and gradients go there from now on. The bytes copied
        (0 where it was moved before); `free` then releases the device storage."""
        if self.host is not None:
            return 0
        self.stream = stream
        self.host = self._copy_out(self.out)
        if self.grad is not None:
            self.grad_host, self.grad = self._copy_out(self.grad), None
        return self.nbytes()

    def free(self) -> None:
        self.out.untyped_storage().resize_(0)

    def _copy_out(self, t: Tensor) -> Tensor:
        if self.device.type != "cuda":
            return t.detach().clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t.detach(), non_blocking=True)
        t.record_stream(self.stream)
        return host

    def _copy_in(self, host: Tensor) -> Tensor:
        """`host` on the device, for the compute stream (after the copy stream's work)."""
        if self.device.type != "cuda":
            return host.detach()
        with torch.cuda.stream(self.stream):
            dev = host.to(self.device, non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        dev.record_stream(current)
        return dev

    def accumulate(self, g: Tensor) -> None:
        if self.host is None:
            self.grad = g.clone() if self.grad is None else self.grad.add_(g)
            return
        if self.grad_host is None:
            self.grad_host = self._copy_out(g)
        elif self.device.type != "cuda":
            self.grad_host.add_(g)
        else:  # in through the copy stream, added on the compute stream, out again
            acc = self._copy_in(self.grad_host).add_(g)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.grad_host.copy_(acc, non_blocking=True)
            acc.record_stream(self.stream)

    def take_grad(self) -> Tensor | None:
        """The accumulated gradient on the device, for the producer's backward."""
        if self.grad_host is not None:
            return self._copy_in(self.grad_host)
        return self.grad


class _StashRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: StashPart, anchor: Tensor) -> Tensor:  # noqa: ARG004
        ctx.part = part
        return part.out.detach() if part.host is None else part._copy_in(part.host)

    @staticmethod
    def backward(ctx, g: Tensor):
        ctx.part.accumulate(g)
        return None, None


def _read(x):
    return x.read() if isinstance(x, StashPart) else x


class Stash:
    """What a producer microbatch hands to its consumers.

    While the producer runs, its context records every mixing input over its computed rows
    and the states its KDA rounds hand on. `keep(needs)` then cuts that down to what the
    consumers read — attention keys/values of context rows, conv inputs of the W-1 rows
    above each consumer root, KDA inputs of replayed rows, the K x V states at consumer
    starts — and nothing more: with activation recomputation this is all the producer
    retains until its backward.
    `leaves()` gives the consumers detached leaf copies (shared by all consumers, so their
    backward passes accumulate into `.grad`); `producer_backward_pairs()` pairs each kept
    tensor with that gradient for the producer's single backward.

    Given the consumers' `needs` up front, each input is cut to its kept rows as it is
    recorded, so the producer never holds every layer's full mixing inputs at once (it
    would until the end of its forward otherwise). The cuts are `RowGather`s, built once
    per kind of input: their backward is a gather, not autograd's zero-fill and
    scatter-add of `t[idx]`.
    """

    def __init__(self, computed_rows: np.ndarray, local_rows: np.ndarray | None = None,
                 needs: StashNeeds | None = None, device: torch.device | str | None = None):
        self.rows = computed_rows  # global rows the recorded tensors are indexed by
        # their local rows in the producer's layout (the schedule's numbering)
        self.local_rows = np.arange(computed_rows.size) if local_rows is None else local_rows
        self.needs = needs
        self._cuts: dict[str, RowGather] = {}
        if needs is not None:
            if device is None:
                raise ValueError("a stash cut as it records needs the device of its index tensors")
            self._device = torch.device(device)
            for cat in ("attention", "conv", "kda"):
                self._cut(cat, getattr(needs, cat))
        self.inputs: dict[tuple[int, str], tuple[Tensor, ...]] = {}
        self.input_rows: dict[str, np.ndarray] = {}  # category -> global rows kept
        self.kda_states: dict[int, Tensor] = {}  # layer -> [n, H, K, V] at `state_keys`
        self.state_keys: list[tuple[int, int]] = []
        self.schedule: KDASchedule | None = None
        # per round: which of its full chunk-state list the recorded `handed` states are
        # (None: all of them)
        self.chunk_state_index: list[np.ndarray | None] = []
        self._handed: dict[int, list[Tensor]] = {}
        self._leaves: dict = {}

    def fresh(self) -> Stash:
        """An empty stash over the same rows, sharing this one's gathers (built once)."""
        new = Stash(self.rows, self.local_rows)
        new.needs, new._cuts = self.needs, self._cuts
        if self.needs is not None:
            new._device = self._device
        return new

    def _cut(self, cat: str, rows: np.ndarray, device=None) -> RowGather:
        """The gather of `rows` (global ids, ascending) out of the recorded rows."""
        if cat not in self._cuts:
            at = np.searchsorted(self.rows, rows)
            if rows.size and (at.max() >= self.rows.size or not np.array_equal(self.rows[at], rows)):
                raise ValueError(f"the producer does not compute every {cat} row its consumers read")
            self._cuts[cat] = RowGather(at, self.rows.size, self._device if device is None else device)
        return self._cuts[cat]

    def record_input(self, key: tuple[int, str], own: tuple[Tensor, ...]) -> None:
        """A mixing input over the computed rows, as the producer's context sees it. Cut to
        the kept rows at once where the needs are known; a second call for the same key
        (activation recomputation in the producer's backward) records nothing."""
        if self.needs is None:
            self.inputs[key] = own
        elif key not in self.inputs:
            cat = stash_category(key[1])
            self.inputs[key] = self._cuts[cat](*own)
            self.input_rows[cat] = getattr(self.needs, cat)

    def record_rounds(self, key: tuple[int, str], ts: tuple[Tensor, ...], order: np.ndarray, device) -> None:
        """KDA inputs recorded in the rounds' order (a fused producer's q, k, v, g, beta):
        `order[i]` is where computed row i sits among the rounds' rows. Cut to the kept rows
        in one gather straight from that order where the needs are known, else gathered back
        to computed order like `record_input`'s inputs."""
        if key in self.inputs:
            return
        cat = stash_category(key[1])
        self.inputs[key] = self.rounds_cut(cat, order, ts[0].shape[0], device)(*ts)
        if self.needs is not None:
            self.input_rows[cat] = getattr(self.needs, cat)

    def rounds_cut(self, cat: str, order: np.ndarray, n: int, device) -> RowGather:
        """The gather `record_rounds` cuts a category's inputs with, out of `n` rows in the
        rounds' order (built once and shared by `fresh` copies; a context prepared ahead
        builds it then)."""
        cut_key = f"{cat}@rounds"
        if cut_key not in self._cuts:
            if self.needs is None:
                self._cuts[cut_key] = RowGather(order, n, device)
            else:
                rows = getattr(self.needs, cat)
                at = np.searchsorted(self.rows, rows)
                if rows.size and (at.max() >= self.rows.size or not np.array_equal(self.rows[at], rows)):
                    raise ValueError(f"the producer does not compute every {cat} row its consumers read")
                self._cuts[cut_key] = RowGather(order[at], n, device)
        return self._cuts[cut_key]

    def record_kda(self, layer: int, handed: list[Tensor]) -> None:
        if self.needs is None or layer not in self.kda_states:
            self._handed[layer] = handed

    def keep(self, needs: StashNeeds) -> None:
        """Keep only what consumers read (called once, after the producer's forward)."""
        if self.needs is None:
            for key, ts in self.inputs.items():
                cat = stash_category(key[1])
                self.inputs[key] = self._cut(cat, getattr(needs, cat), ts[0].device)(*ts)
                self.input_rows[cat] = getattr(needs, cat)
        self.state_keys = list(needs.states)
        for layer in self._handed:
            states = [self._state_at(layer, row, a) for row, a in self.state_keys]
            self.kda_states[layer] = torch.stack(states) if states else None  # type: ignore[assignment]
        self._handed = {}

    def _state_at(self, layer: int, global_row: int, position: int) -> Tensor:
        i = int(np.searchsorted(self.rows, global_row))
        sch = self.schedule
        if i >= self.rows.size or self.rows[i] != global_row or sch is None:
            raise ValueError(f"the producer did not compute row {global_row}")
        r, index = chunk_state_of(sch, int(self.local_rows[i]), position)
        requested = self.chunk_state_index[r] if r < len(self.chunk_state_index) else None
        if requested is not None:
            at = int(np.searchsorted(requested, index))
            if at >= requested.size or requested[at] != index:
                raise ValueError(f"S({position}) at row {global_row} was not requested when the producer "
                                 "ran (TreeContext record_states)")
            index = at
        return self._handed[layer][r][index]

    def state_at(self, layer: int, global_row: int, position: int) -> Tensor:
        """S(position) on the path through `global_row` (the row at depth position-1)."""
        return self.kda_states[layer][self.state_keys.index((global_row, position))]

    def leaves(self) -> Stash:
        """A view whose tensors are detached leaves (created once, shared by all consumers);
        attention inputs are `StashPart`s, read through `StashPart.read`."""
        if not self._leaves:
            for key, ts in self.inputs.items():
                wrap = StashPart if stash_category(key[1]) == "attention" else _leaf
                self._leaves[("in", key)] = tuple(wrap(t) for t in ts)
            for layer, st in self.kda_states.items():
                if st is not None:
                    self._leaves[("kda", layer)] = _leaf(st)
        view = Stash(self.rows)
        view.schedule = self.schedule
        view.local_rows = self.local_rows
        view.chunk_state_index = self.chunk_state_index
        view.input_rows = self.input_rows
        view.state_keys = self.state_keys
        view.inputs = {key: self._leaves[("in", key)] for key in self.inputs}
        view.kda_states = {layer: self._leaves.get(("kda", layer)) for layer in self.kda_states}
        return view

    def input_parts(self, key: tuple[int, str]) -> tuple[tuple[Tensor, ...], ...]:
        """Per tensor of input `key`, its rows as parts to be joined in order (one here)."""
        return tuple((_read(t),) for t in self.inputs[key])

    def stash_parts(self) -> list[StashPart]:
        """The attention inputs' `StashPart`s (once `leaves` made them)."""
        return [x for ts in self._leaves.values() if isinstance(ts, tuple) for x in ts if isinstance(x, StashPart)]

    def parts_to_host(self, stream=None) -> int:
        """Every `StashPart` copied to host memory, then their device storage freed; the
        bytes moved."""
        parts = self.stash_parts()
        moved = [p.copy_to_host(stream) for p in parts]
        for p, n in zip(parts, moved, strict=True):
            if n:
                p.free()
        return sum(moved)

    def producer_backward_pairs(self) -> tuple[list[Tensor], list[Tensor]]:
        outs, grads = [], []
        for key, ts in self.inputs.items():
            for t, leaf in zip(ts, self._leaves.get(("in", key), ()), strict=False):
                grad = leaf.take_grad() if isinstance(leaf, StashPart) else leaf.grad
                if grad is not None:
                    outs.append(t)
                    grads.append(grad)
        for layer, st in self.kda_states.items():
            leaf = self._leaves.get(("kda", layer))
            if leaf is not None and leaf.grad is not None:
                outs.append(st)
                grads.append(leaf.grad)
        return outs, grads

    def retained_bytes(self) -> int:
        tensors = [t for ts in self.inputs.values() for t in ts]
        tensors += [t for t in self.kda_states.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class _ChainInputs:
    """A `ChainStash`'s inputs: per key, its stashes' tensors one after another, joined
    when read (a reader's transient; nothing joined is kept). Readers that join them with
    rows of their own take `ChainStash.input_parts` instead."""

    def __init__(self, parts: Sequence[Stash]):
        self._parts = parts

    def __getitem__(self, key: tuple[int, str]) -> tuple[Tensor, ...]:
        groups = [[_read(t) for t in p.inputs[key]] for p in self._parts]
        return tuple(torch.cat(ts) for ts in zip(*groups, strict=True))

    def __contains__(self, key: object) -> bool:
        return all(key in p.inputs for p in self._parts)


class ChainStash:
    """What a piece of a chain of windows reads: the leaf views (`Stash.leaves`) of every
    producer up its chain (`parts` nearest first), each holding only the rows its own
    producer computed. Its rows are theirs one after another, the farthest producer's first
    (`StashNeeds.chain` gives the same order ahead of the run), which on a chain is the
    path's order: the reader's context rows then come out of the join in place, with no
    gather into the layout's order (and none of the gradient back). Inputs are joined when
    read, in the same copy as the reader's own rows where it places them after (keys and
    values, conv inputs: `input_parts`); a state comes from the nearest stash that keeps
    it. No row is copied into another piece's stash: the reader's gradients accumulate on
    the leaves of the piece that computed each row."""

    def __init__(self, parts: Sequence[Stash]):
        if not parts:
            raise ValueError("a chain of stashes needs at least one")
        self.parts = list(parts)[::-1]
        cats = set().union(*(p.input_rows for p in self.parts))
        self.input_rows = {cat: np.concatenate([p.input_rows.get(cat, np.zeros(0, np.int64)) for p in self.parts])
                           for cat in cats}
        self.inputs = _ChainInputs(self.parts)
        self._state_of: dict[tuple[int, int], Stash] = {}
        for p in reversed(self.parts):
            for key in p.state_keys:
                self._state_of.setdefault(key, p)

    def input_parts(self, key: tuple[int, str]) -> tuple[tuple[Tensor, ...], ...]:
        """Per tensor of input `key`, its producers' rows farthest first, unjoined: a reader
        joins them with its own rows in one copy (`RowPlace`, a conv's input)."""
        return tuple(zip(*([_read(t) for t in p.inputs[key]] for p in self.parts), strict=True))

    def state_at(self, layer: int, global_row: int, position: int) -> Tensor:
        stash = self._state_of.get((global_row, position))
        if stash is None:
            raise ValueError(f"S({position}) at row {global_row}: no producer up the chain keeps it")
        return stash.state_at(layer, global_row, position)


def chain_view(parts: Sequence[Stash]) -> Stash | ChainStash:
    """What a consumer reads from its producers' leaf views (nearest first): the one
    producer's view as it is, or a `ChainStash` over a chain's."""
    return parts[0] if len(parts) == 1 else ChainStash(parts)
