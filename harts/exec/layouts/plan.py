"""The plan layout: a step `Plan`'s microbatches, sharing windows included, exactly.

Legend: C rows a microbatch computes, X context rows it reads from its producer.

A tree-mode `Plan` (harts.plan.plan) places microbatches on replicas. A microbatch
computes the rows of its pieces and holds its trajectories; a *consumer* also reads
context rows that its *producer* computed. A target's loss term is computed where its
hidden row is: in its trajectory's microbatch, or for a row that microbatch reads as
context, in the producer that computed it (`serving_microbatch`), so every row's logits
are formed once, as in the unsplit tree. Execution, per replica in plan
order (replicas run one after another here: their gradients simply add, which is what a
data-parallel all-reduce of the step-global loss computes):

1. producer forward over its rows, recording through its context a `Stash`: the mixing
   inputs of every row (attention keys/values, conv inputs, KDA inputs), the KDA states
   its rounds handed on. No backward yet. On CUDA its other
   large saved tensors (its blocks' checkpointed inputs) wait in pinned host memory until
   its backward (`harts.exec.offload.HostOffload`; `PlanLayout(offload_producers=...)`).
2. each consumer: forward over its own rows, with every mixing op extended by the
   context rows' stashed inputs (detached leaves shared by all consumers of the window),
   KDA trees starting from the producer's chunk-aligned states; loss over the targets it
   serves; backward, which accumulates into the leaves' `.grad`.
3. after the window's last consumer: one producer backward, feeding its own loss and the
   accumulated leaf gradients through the producer graph.

Chains of windows (trajectories longer than the budget, `harts.plan.planners.chains`): a
consumer that is a producer itself records its stash over the rows it computes, as any
producer. A microbatch reads each context row from the stash of the nearest producer up
its chain that computed it (`ChainStash`: the leaves of every producer up the chain, by
reference), so each producer keeps the rows it computed that any reader below it reads
(`StashNeeds.split`), and what a chain keeps is linear in its length. Its backward runs
when its own window closes, which may close its producer's window in turn; the rows a
reader took from producers further up have their gradients on those producers' leaves,
whose backward runs later still. An expanded plan's chains run the same way, its other
microbatches packed between them.

The windows are this layout's business: the step runner iterates its microbatches as any
layout's, and the iteration (`_WindowRun`) binds consumers to stashes, hands producers a
fresh stash and runs each producer's backward after its last consumer. The data side is
built ahead (`StepRunner.prepare`, as the other layouts', so `run_steps` overlaps it with
the previous step): a consumer's context needs only the rows its producer's stash will
keep (the window's `StashNeeds`), and the stash is bound when the consumer runs. Every read of stashed rows and every cut of the producer's tensors is a
fixed-order gather (`RowGather`, `RowPlace`) whose backward is a gather, not autograd's
scatter-add of advanced indexing.

Row weights (occurrence counts for MoE statistics) count, for every computed row, the
trajectories whose targets use *that computation*: a microbatch's own trajectories, and
for a producer its consumers' trajectories. Summed over the step they are the expanded
batch's counts, whatever the split. Loss denominators are the step's, as everywhere.

Prior-art plans without windows may compute a shared row in several microbatches; each
copy is then an independent computation weighted by its own trajectories.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from harts.config.kernels import KernelConfig
from harts.exec.layouts.base import LayoutBase
from harts.exec.layouts.packed import PackedLayout
from harts.exec.layouts.tree import target_table
from harts.exec.offload import HostOffload
from harts.exec.ops.record import KernelRecord
from harts.exec.stash import Stash, StashNeeds, chain_view
from harts.exec.step import Microbatch
from harts.exec.transfer import to_device
from harts.exec.tree import TreeContext, consumer_needs
from harts.exec.tree_layout import LocalLayout, plan_replay_schedule
from harts.plan.plan import Plan, PlanMode
from harts.plan.schedule import Schedule
from harts.plan.step import plan_kda_calls_of
from harts.tree import Trajectory, build_forest
from harts.tree.forest import RolloutForest

__all__ = ["PAUSE", "PlanLayout", "WindowStats", "order_from_schedule", "piece_rows"]

# what a window run yields between a cascade's producer backwards where its layout pauses
# them (`PlanLayout.pause_cascades`): not a microbatch
PAUSE = object()


def piece_rows(forest: RolloutForest, pieces: Sequence) -> np.ndarray:
    starts = forest.node_row_start
    parts = [np.arange(starts[p.node] + p.start, starts[p.node] + p.end) for p in pieces]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


@dataclass
class WindowStats:
    """What a sharing window held: reported per producer."""

    producer: int
    consumers: list[int]
    retained_bytes: int = 0
    # CUDA: device memory the producer still held at the end of its forward (its autograd
    # graph, its loss's saved tensors and the stash), measured as the change in allocated
    # memory since its microbatch started; 0 elsewhere
    held_bytes: int = 0
    producer_rows: int = 0
    context_rows_read: int = 0
    # bytes of the producer's saved tensors held in host memory across the window
    # (`PlanLayout(offload_producers=...)`, harts.exec.offload)
    offloaded_bytes: int = 0
    # bytes of its stash's keys and values moved to host memory as an outer stash of a long
    # chain (`KernelConfig.chain_stash_device_budgets`)
    stash_host_bytes: int = 0


@dataclass
class _Window:
    producer: int
    consumers: list[int]
    needs: StashNeeds | None = None
    stash: Stash | None = None
    loss: torch.Tensor | None = None
    done: int = 0
    mem_start: int = 0
    stats: WindowStats = field(default=None)  # type: ignore[assignment]
    # the contexts holding the window's state: released after the producer's backward
    producer_ctx: TreeContext | None = None
    consumer_ctxs: list[TreeContext] = field(default_factory=list)
    offload: HostOffload | None = None


class _WindowRun:
    """A tree-mode plan's microbatches, built ahead, as the step runner iterates them: each
    iteration (the MoE statistics pass, then the training pass) binds every consumer's
    context to its producer's stash when the consumer comes up, gives each producer a fresh
    stash, and runs a producer's backward right after its window's last consumer."""

    def __init__(self, layout: PlanLayout, consumers: dict[int, list[int]]):
        self.layout = layout
        self.consumers = consumers
        self.items: list[tuple[int, int | None, TreeContext, Microbatch]] = []
        self.open: dict[int, _Window] = {}
        self.producer_of: dict[int, int | None] = {}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Microbatch:
        return self.items[i][3]

    def keep_forward(self, producer: int, ctx: TreeContext):
        """A producer's `Microbatch.keep_forward`: its stash cut to what its consumers read,
        its loss kept for its backward after the last of them. The hook holds the run
        weakly: the run holds the microbatch holding the hook, and a cycle would keep the
        run's device tensors (contexts, index arrays, tables) alive until a garbage
        collection, not until the run is dropped."""
        run = weakref.ref(self)

        def hook(out, loss):
            self = run()
            w = self.open[producer]
            w.stash = ctx.record
            w.stash.keep(w.needs)
            w.loss = loss
            w.stats.retained_bytes = w.stash.retained_bytes()
            if w.offload is not None:
                w.stats.offloaded_bytes = w.offload.bytes
            if ctx.device.type == "cuda":
                w.stats.held_bytes = torch.cuda.memory_allocated(ctx.device) - w.mem_start
            tr = self.layout
            tr._open_bytes += w.stats.retained_bytes
            tr.peak_retained_bytes = max(tr.peak_retained_bytes, tr._open_bytes)
            self.outer_stashes_to_host(producer, ctx.device)

        return hook

    def outer_stashes_to_host(self, producer: int, device: torch.device) -> None:
        """The rule for what a chain keeps on the device: the stashes up `producer`'s chain
        above it (outer to its consumers) stay, nearest first, while their attention rows
        sum to at most `KernelConfig.chain_stash_device_budgets` microbatch budgets; the
        farther ones' keys and values move to host memory (`Stash.parts_to_host`). Only where
        producers recompute their blocks (a model built with `recompute`, the default, and
        `producer_recompute`): a producer that stores its activations may have saved the
        tensors its stash keeps."""
        tr = self.layout
        if not (tr.producer_recompute and getattr(tr.model, "recompute", False)):
            return
        cap, rows = tr.kernels.chain_stash_device_budgets * tr.plan.microbatch_tokens, 0
        for p in self.chain(producer)[1:]:
            w = self.open[p]
            if w.stash is None:
                continue
            rows += len(w.stash.input_rows.get("attention", ()))
            if rows > cap:
                w.stats.stash_host_bytes += w.stash.parts_to_host(tr.copy_stream(device))

    def offload(self, producer: int) -> HostOffload:
        """The saved-tensor hooks of a producer's forward (`Microbatch.saved_tensor_hooks`)."""
        w = self.open[producer]
        w.offload = HostOffload()
        return w.offload

    def __iter__(self):
        tr = self.layout
        tr.windows = []
        tr.peak_retained_bytes = 0
        tr._open_bytes = 0
        self.open = {}
        self.producer_of = {mb_id: producer for mb_id, producer, _, _ in self.items}
        for mb_id, producer, ctx, mb in self.items:
            window = None
            if producer is not None:
                window = self.open.get(producer)
                if window is None or window.stash is None:
                    raise ValueError(f"consumer {mb_id} runs before its producer {producer}")
                ctx.bind(chain_view([self.open[p].stash.leaves() for p in self.chain(producer)]))
                window.consumer_ctxs.append(ctx)
            if mb_id in self.consumers:
                ctx.start_recording()
                w = _Window(mb_id, self.consumers[mb_id], needs=ctx.record.needs, producer_ctx=ctx)
                w.stats = WindowStats(mb_id, w.consumers, producer_rows=int(ctx.num_rows))
                if ctx.device.type == "cuda":
                    w.mem_start = torch.cuda.memory_allocated(ctx.device)
                self.open[mb_id] = w
            yield mb
            if window is not None:
                window.stats.context_rows_read += int((~ctx.layout.computed).sum())
            if mb_id not in self.consumers:  # its backward ran: it is done
                yield from self._done(producer)
        self.open = {}

    def chain(self, producer: int) -> list[int]:
        """`producer` and every producer up its chain, nearest first: the stashes a
        consumer of `producer` reads."""
        out = [producer]
        while self.producer_of.get(out[-1]) is not None:
            out.append(self.producer_of[out[-1]])
        return out

    def _done(self, producer: int | None):
        """One consumer of `producer` is done (its backward ran). After the last one, the
        producer's backward runs; in a chain that makes the producer a done consumer of its
        own producer. Where the layout pauses a cascade (`PlanLayout.pause_cascades`) the
        run yields `PAUSE` before each backward after the first, so that an EP group's
        lockstep can run one producer backward per event."""
        tr = self.layout
        first = True
        while producer is not None:
            window = self.open[producer]
            window.done += 1
            if window.done < len(window.consumers):
                return
            if not first and tr.pause_cascades:
                yield PAUSE
            first = False
            tr._producer_backward(window)
            # what the window held (stash, leaves, their gradients) goes with it
            for c in window.consumer_ctxs:
                c.stash = None
            window.producer_ctx.release_record()
            window.consumer_ctxs = []
            del self.open[producer]
            producer = self.producer_of.get(producer)


def computing_microbatch(rows: np.ndarray, m, computed: dict[int, np.ndarray], mbs: dict) -> np.ndarray:
    """For `rows` on the paths of tree-mode microbatch `m`'s trajectories, the id of the
    microbatch whose computation of each row they use: `m` where it computes the row, else
    the nearest producer up its chain of windows that does."""
    out = np.full(rows.size, -1, np.int64)
    rest, p = np.arange(rows.size), m.id
    while rest.size:
        if p is None:
            raise ValueError(f"microbatch {m.id}: no producer up its chain computes rows of its trajectories")
        here = np.isin(rows[rest], computed[p])
        out[rest[here]] = p
        rest, p = rest[~here], mbs[p].producer
    return out


def serving_microbatch(targets, tree_mbs: Sequence, computed: dict[int, np.ndarray],
                       mbs: dict) -> np.ndarray:
    """For every target of `targets` (`RolloutForest.targets`), the id of the tree-mode
    microbatch that computes its loss term: the one whose computation of the target's
    hidden row its trajectory uses (`computing_microbatch`; -1 for targets of no tree-mode
    microbatch). Every target's loss term is a summand over the step's global
    denominators, so which microbatch adds it does not change the step; serving it where
    its row is computed forms each row's logits once, where the trajectories' own
    microbatches would each form them again for the shared rows they read from a producer."""
    served = np.full(targets.row.size, -1, np.int64)
    for m in tree_mbs:
        idx = np.flatnonzero(np.isin(targets.traj, np.asarray(m.trajectories, np.int64)))
        served[idx] = computing_microbatch(targets.row[idx], m, computed, mbs)
    return served


def order_from_schedule(schedule: Schedule) -> list[int]:
    """The microbatch ids in the order a pipeline schedule runs their forwards on its first
    stage, replica after replica (one device runs whole microbatches: every stage's layers
    at once, replicas' gradients adding up as a data-parallel all-reduce would)."""
    return [op.mbs[0] for r in range(schedule.num_replicas) for op in schedule.ops(r, 0) if op.kind == "F"]


class PlanLayout(LayoutBase):
    """The microbatches of a `Plan`; tree-mode plans with sharing windows exactly."""

    # a window run runs a cascade's producer backwards in one go (False), or yields `PAUSE`
    # before each after the first (an EP group's replica: one backward per joint event)
    pause_cascades = False

    def __init__(self, plan: Plan, *, order: Sequence[int] | None = None, schedule: Schedule | None = None,
                 offload_producers: bool | None = None, producer_recompute: bool = True):
        """`order`: the microbatch ids in execution order, as a pipeline schedule runs them
        (default: each replica's plan order, replicas one after another). Windows may
        overlap — a producer may run before the previous window's last consumer — as long
        as every consumer follows its producer; each producer's backward still runs right
        after its own last consumer. `schedule`: a simulator schedule (harts.plan.schedule)
        of this plan instead of `order`: its first stage's forward order (`order_from_schedule`).
        `offload_producers`: hold a window producer's large saved tensors (its blocks'
        checkpointed inputs) in host memory while its consumers run (`HostOffload`); the
        default does so on CUDA devices. `producer_recompute=False`: a producer's blocks run
        without activation checkpointing, so everything they save for backward passes
        through those hooks (to host memory where the offload is on) and its backward
        recomputes nothing: one forward's launches and kernels fewer per producer, and no
        checkpoint hooks on its saved tensors, for the host memory and the copies of all its
        saved activations (measured 51% slower on one H200's 8k window step: the copies cost
        more than the recomputation; docs/BENCHMARKS.md). Values are unchanged either way."""
        self.plan = plan
        if schedule is not None:
            if order is not None:
                raise ValueError("give an order or a schedule, not both")
            order = order_from_schedule(schedule)
        if order is None:
            order = [m.id for m in sorted(plan.microbatches, key=lambda m: (m.replica, m.order))]
        order = [int(i) for i in order]
        if sorted(order) != sorted(m.id for m in plan.microbatches):
            raise ValueError("order must list every microbatch of the plan exactly once")
        position = {mb: i for i, mb in enumerate(order)}
        for m in plan.microbatches:
            if m.producer is not None and position[m.producer] > position[m.id]:
                raise ValueError(f"order runs consumer {m.id} before its producer {m.producer}")
        self.execution_order = order
        self.offload_producers = offload_producers
        self.producer_recompute = bool(producer_recompute)
        # an expanded plan with chains of windows (trajectories longer than its budget):
        # its other microbatches run packed, between the chains' tree-mode microbatches
        self._chains = plan.mode == PlanMode.EXPANDED and any(m.pieces for m in plan.microbatches)
        # the last step's (plan, trajectories, forest): a step over the same trajectory
        # objects (immutable) with the same plan reuses the forest it was validated on
        self._forest_cache: tuple[Plan, tuple[Trajectory, ...], RolloutForest] | None = None
        self.windows: list[WindowStats] = []
        # the most producer state alive at once (overlapping windows add up)
        self.peak_retained_bytes = 0
        self._open_bytes = 0
        self._packed = PackedLayout()

    def copy_stream(self, device: torch.device):
        """The stream outer stashes move to and from host memory on (CUDA; None elsewhere)."""
        if device.type != "cuda":
            return None
        if getattr(self, "_copy_stream", None) is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        return self._copy_stream

    def bind(self, model: torch.nn.Module, kernels: KernelConfig, kernel_record: KernelRecord) -> PlanLayout:
        super().bind(model, kernels, kernel_record)
        self._packed.bind(model, kernels, kernel_record)  # an expanded-mode plan's microbatches
        return self

    def partition(self, trajectories: Sequence[Trajectory], microbatch_tokens: int | None) -> list[list[int]]:
        """The plan's microbatches' trajectories, in execution order (the budget is the plan's)."""
        return [list(self.plan.microbatches[i].trajectories) for i in self.execution_order]

    def microbatches(self, trajectories: Sequence[Trajectory],
                     partition: Sequence[Sequence[int]]) -> Iterator[Microbatch]:
        if self.plan.mode == PlanMode.EXPANDED and not self._chains:
            return self._packed.microbatches(trajectories, partition)
        return iter(self.window_run(trajectories))

    def prepare(self, trajectories: Sequence[Trajectory], partition: Sequence[Sequence[int]]) -> Iterable[Microbatch]:
        """The step's data side built now: for a tree-mode plan every microbatch's layout,
        KDA schedule, index tensors and targets, consumers' contexts included (built from
        the rows their producer's stash will keep, the stash bound when they run); nothing
        of it waits for a producer's results."""
        if self.plan.mode == PlanMode.EXPANDED and not self._chains:
            return self._packed.prepare(trajectories, partition)
        return self.window_run(trajectories)

    def window_run(self, trajectories: Sequence[Trajectory]) -> _WindowRun:
        """A tree-mode plan's microbatches in execution order, with their windows' bookkeeping."""
        model, plan, device, dtype = self.model, self.plan, self.device, self.dtype
        forest = self._plan_forest(trajectories)
        mbs = {m.id: m for m in plan.microbatches}
        consumers = plan.consumers()
        targets = forest.targets()
        rows_of = forest.traj_rows
        off = forest.traj_offsets
        # tree-mode microbatches: every one of a tree plan, an expanded plan's chain pieces
        tree_mbs = [m for m in plan.microbatches if plan.mode == PlanMode.TREE or m.pieces]
        computed = {m.id: piece_rows(forest, m.pieces) for m in tree_mbs}
        # row weights: the trajectories that use each computation
        weights = {i: np.zeros(r.size, np.float64) for i, r in computed.items()}
        for m in tree_mbs:
            for t in m.trajectories:
                path = rows_of[off[t] : off[t + 1]]
                at = computing_microbatch(path, m, computed, mbs)
                for p in np.unique(at).tolist():
                    np.add.at(weights[p], np.searchsorted(computed[p], path[at == p]), 1.0)
        B = model.config.chunk_size
        layouts = {m.id: LocalLayout.of_rows(forest, computed[m.id], piece_rows(forest, m.context))
                   for m in tree_mbs}
        # the plan's KDA call plans, made once per plan (the simulator prices the same ones)
        kda = plan_kda_calls_of(plan, forest, B)
        schedules = {i: plan_replay_schedule(lay, forest, kda[i]) for i, lay in layouts.items()}
        # each target is served by the microbatch whose computation of its hidden row the
        # target's trajectory uses (as the row weights count), so a row's logits are formed
        # once however many microbatches' trajectories read it
        served = serving_microbatch(targets, tree_mbs, computed, mbs)
        owned = {m.id: served == m.id for m in tree_mbs}
        # what each producer's stash keeps: the rows it computed that a microbatch below it
        # reads (in a chain of windows each row is read from the nearest producer up the
        # reader's chain that computed it, as the row weights above count it)
        def chain_of(i: int) -> list[int]:
            out = []
            p = mbs[i].producer
            while p is not None:
                out.append(p)
                p = mbs[p].producer
            return out

        parts: dict[int, list[StashNeeds]] = {p: [] for p in consumers}
        for m in tree_mbs:
            if m.producer is None:
                continue
            rest = consumer_needs(layouts[m.id], schedules[m.id], model.config.conv_window)
            for p in chain_of(m.id):
                if p not in parts:
                    raise ValueError(f"microbatch {m.id} names producer {p}, which has no consumers")
                here, rest = rest.split(computed[p])
                parts[p].append(here)
            if not rest.empty:
                raise ValueError(f"microbatch {m.id} reads rows no producer up its chain computes")
        needs = {p: StashNeeds.union(ps) for p, ps in parts.items()}
        run = _WindowRun(self, {p: sorted(cs, key=lambda c: (mbs[c].replica, mbs[c].order))
                                for p, cs in consumers.items()})
        run_ref = weakref.ref(run)
        for m in (mbs[i] for i in self.execution_order):
            if m.id not in computed:  # an expanded plan's packed microbatch
                (packed,) = self._packed.microbatches(trajectories, [list(m.trajectories)])
                run.items.append((m.id, None, None, packed))
                continue
            comp = computed[m.id]
            layout = layouts[m.id]
            ctx_rows = layout.rows[~layout.computed]
            if m.producer is not None and m.producer not in needs:
                raise ValueError(f"microbatch {m.id} names producer {m.producer}, which has no consumers")
            is_producer = m.id in needs
            # a producer's KDA rounds return only the states its consumers start from, and
            # its stash keeps only the rows they read, cut as they are recorded
            ctx = TreeContext(forest, chunk_size=B, device=device, layout=layout, row_weight=weights[m.id],
                              stash_needs=StashNeeds.chain([needs[p] for p in chain_of(m.id)])
                              if m.producer is not None else None,
                              record=is_producer, schedule=schedules[m.id],
                              record_needs=needs[m.id] if is_producer else None,
                              kernels=self.kernels, kernel_record=self.kernel_record)
            if is_producer and not self.producer_recompute:
                ctx.recompute = False
            if model.config.num_kda_layers:
                ctx.prepare_kda(model.config.conv_window)
            # the targets it serves, each by the index of its row among the computed rows
            # (the model's output rows): a served target's row is computed here
            sel = owned[m.id]
            t_rows = targets.row[sel]
            hidden_index = np.searchsorted(comp, t_rows)
            if t_rows.size and (hidden_index.max() >= comp.size or not np.array_equal(comp[hidden_index], t_rows)):
                raise ValueError(f"microbatch {m.id} serves targets on rows it does not compute "
                                 "(serving_microbatch serves every target where its row is computed)")
            table = target_table(targets, select=sel, row=hidden_index).to(device, dtype)
            keep_forward = run.keep_forward(m.id, ctx) if is_producer else None
            saved_tensor_hooks = None
            if is_producer and (self.offload_producers if self.offload_producers is not None
                                else device.type == "cuda"):
                def saved_tensor_hooks(run=run_ref, producer=m.id):  # the run held weakly, as keep_forward does
                    return run().offload(producer)
            ids_T = to_device(forest.token_ids[comp], device)
            info = {"kda_rounds": ctx.kda_rounds, "replay_tokens": ctx.replay_tokens,
                    "context_rows": int(ctx_rows.size), "role": "producer" if is_producer else
                    ("consumer" if m.producer is not None else "standalone")}
            run.items.append((m.id, m.producer, ctx, Microbatch(
                list(m.trajectories), ids_T, ctx, table, int(round(weights[m.id].sum())), info,
                keep_forward=keep_forward, saved_tensor_hooks=saved_tensor_hooks)))
        return run

    def _plan_forest(self, trajectories: Sequence[Trajectory]) -> RolloutForest:
        """The step's forest, checked against the plan (`Plan.validate`): built and checked
        once per plan and trajectories (the same trajectory objects, in the same order);
        later steps over them reuse it."""
        cached = self._forest_cache
        if (cached is not None and cached[0] is self.plan and len(cached[1]) == len(trajectories)
                and all(a is b for a, b in zip(cached[1], trajectories, strict=True))):
            return cached[2]
        forest = build_forest(trajectories)
        self.plan.validate(forest)
        self._forest_cache = (self.plan, tuple(trajectories), forest)
        return forest

    def _producer_backward(self, window: _Window) -> None:
        stash = window.stash
        if stash is None or window.loss is None:
            return
        outs, grads = stash.producer_backward_pairs()
        if window.loss.requires_grad:
            outs = [window.loss, *outs]
            grads = [torch.ones_like(window.loss), *grads]
        if outs and torch.is_grad_enabled():
            torch.autograd.backward(outs, grads)
        self.windows.append(window.stats)
        self._open_bytes -= window.stats.retained_bytes
        window.stash = None  # release the retained producer state
        window.loss = None
