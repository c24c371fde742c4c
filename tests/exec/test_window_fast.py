"""The window path's gathers and its prepared execution against their references.

`RowPlace` (a consumer's local rows from its producer's stash and its own rows) against
the concatenate-and-index construction it replaced, in float64, values and every gradient;
a `PlanTrainer` step prepared ahead (`prepare`, `run_steps`) against the step built inline
and against the expanded baseline; a step leaves no window state behind; and the window
step's backward has no scatter-add from advanced indexing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import build_model
from harts.exec.offload import HostOffload
from harts.exec.ops.gather import RowPlace
from harts.exec.trainer import ExpandedTrainer, run_steps
from harts.exec.window import PlanTrainer
from harts.plan.planners import PlanConfig, make_plan
from harts.tree import build_forest
from harts.tree.workload import generate_trajectories
from harts.verify.equivalence import compare_steps
from tests.strategies import row_placements

TOL = 1e-10
LOSS = PolicyLossConfig(kl_coef=0.1)


def _reference(L, own_at, src_at, src_rows, src, own):
    """The construction RowPlace replaces: [src | zero row][pick] then own, put in place."""
    rest = np.setdiff1d(np.arange(L), np.concatenate([own_at, src_at]))
    pick = np.concatenate([src_rows, np.full(rest.size, src.shape[0])])
    order = np.concatenate([src_at, rest, own_at])
    inverse = np.empty(L, np.int64)
    inverse[order] = np.arange(L)
    padded = torch.cat([src, src.new_zeros(1, *src.shape[1:])])
    dev = src.device
    return torch.cat([padded[torch.as_tensor(pick, device=dev)], own])[torch.as_tensor(inverse, device=dev)]


@settings(max_examples=60)
@given(row_placements(), st.integers(0, 2**16))
def test_row_place_matches_the_indexing_it_replaces(case, seed):
    L, own_at, src_at, src_rows, num_src = case
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(num_src, 3, 2, dtype=torch.float64, generator=gen, requires_grad=True),
            torch.randn(num_src, 4, dtype=torch.float64, generator=gen)]  # the second: no grad
    owns = [torch.randn(own_at.size, 3, 2, dtype=torch.float64, generator=gen, requires_grad=True),
            torch.randn(own_at.size, 4, dtype=torch.float64, generator=gen, requires_grad=True)]
    place = RowPlace(L, own_at, src_at, src_rows, num_src, "cpu")
    got = place(tuple(srcs), tuple(owns))
    want = [_reference(L, own_at, src_at, src_rows, s, o) for s, o in zip(srcs, owns, strict=True)]
    weights = [torch.randn(w.shape, dtype=torch.float64, generator=gen) for w in want]
    leaves = [srcs[0], *owns]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    g_got = torch.autograd.grad(sum((x * w).sum() for x, w in zip(got, weights, strict=True)), leaves,
                                allow_unused=True)
    g_want = torch.autograd.grad(sum((x * w).sum() for x, w in zip(want, weights, strict=True)), leaves,
                                 allow_unused=True)
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.equal(a, b)


@settings(max_examples=40)
@given(row_placements(), st.lists(st.integers(0, 24), max_size=3), st.integers(0, 2**16))
def test_row_place_source_in_parts_equals_the_joined_source(case, cuts, seed):
    """A source given as parts (a chain piece's producers' stashes, farthest first) places
    and differentiates as the joined source does, bit for bit, each part's gradient its
    rows of the joined one's."""
    L, own_at, src_at, src_rows, num_src = case
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(num_src, 3, dtype=torch.float64, generator=gen)
    own = torch.randn(own_at.size, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    bounds = [0, *sorted(min(c, num_src) for c in cuts), num_src]
    parts = [src[a:b].clone().requires_grad_(True) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    joined = src.clone().requires_grad_(True)
    place = RowPlace(L, own_at, src_at, src_rows, num_src, "cpu")
    (got,), (want,) = place((tuple(parts),), (own,)), place((joined,), (own,))
    assert torch.equal(got, want)
    w = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    g_parts = torch.autograd.grad((got * w).sum(), [*parts, own], allow_unused=True)
    g_joined = torch.autograd.grad((want * w).sum(), [joined, own], allow_unused=True)
    assert torch.equal(g_parts[-1], g_joined[1])
    for (a, b), g in zip(zip(bounds[:-1], bounds[1:], strict=True), g_parts[:-1], strict=True):
        want_g = g_joined[0][a:b] if g_joined[0] is not None else torch.zeros(b - a, 3, dtype=torch.float64)
        assert torch.equal(g if g is not None else torch.zeros_like(want_g), want_g)


def test_row_place_refuses_overlapping_or_out_of_range_positions():
    with pytest.raises(ValueError, match="one row"):
        RowPlace(4, np.array([0, 1]), np.array([1]), np.array([0]), 1, "cpu")
    with pytest.raises(ValueError, match="out of range"):
        RowPlace(4, np.array([0, 4]), np.array([], np.int64), np.array([], np.int64), 0, "cpu")
    with pytest.raises(ValueError, match="distinct"):
        RowPlace(4, np.array([0]), np.array([1, 2]), np.array([0, 0]), 2, "cpu")


def _setup(chunk_size: int = 8):
    """A window plan over tiny-treestep; fla's KDA kernels on a GPU take chunk 32 or 64."""
    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    budget = max(int(forest.traj_length.max()) + 5, forest.compact_tokens // 3)
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=chunk_size))
    assert plan.consumers(), "the budget must force a sharing window"
    cfg = get_model_config("tiny-cpu").replace(chunk_size=chunk_size, aux_scope="global")
    return trajs, plan, cfg


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_a_prepared_window_step_is_the_inline_step_and_the_expanded_one():
    trajs, plan, cfg = _setup()
    runs = {}
    for name in ("inline", "prepared"):
        model = build_model(cfg, seed=3, dtype=torch.float64)
        trainer = PlanTrainer(model, plan, loss=LOSS)
        prepared = trainer.prepare(trajs, 1 << 20) if name == "prepared" else None
        # the global aux scope iterates the prepared microbatches twice (statistics, then training)
        runs[name] = (model, trainer, trainer.forward_backward(trajs, 1 << 20, prepared=prepared))
    for a, b in zip(_grads(runs["inline"][0]), _grads(runs["prepared"][0]), strict=True):
        assert torch.equal(a, b)
    assert [w.retained_bytes for w in runs["inline"][1].windows] == \
        [w.retained_bytes for w in runs["prepared"][1].windows]
    ref_model = build_model(cfg, seed=3, dtype=torch.float64)
    ref = ExpandedTrainer(ref_model, loss=LOSS).forward_backward(trajs, 1 << 20)
    rep = compare_steps(ref, ref_model, runs["prepared"][2], runs["prepared"][0])
    assert rep["max_rel_logprob_err"] <= TOL and rep["max_rel_grad_err"] <= TOL


def test_prefetched_window_steps_are_the_plain_steps():
    trajs, plan, cfg = _setup()
    results = {}
    for prefetch in (False, True):
        model = build_model(cfg, seed=3, dtype=torch.float64)
        trainer = PlanTrainer(model, plan, loss=LOSS)
        assert trainer.preparable
        steps = list(run_steps(trainer, [trajs, trajs], 1 << 20, prefetch=prefetch))
        results[prefetch] = ([s.losses["loss"] for s in steps], [p.detach().clone() for p in model.parameters()])
    assert results[False][0] == results[True][0]
    for a, b in zip(results[False][1], results[True][1], strict=True):
        assert torch.equal(a, b)


def test_a_step_leaves_no_window_state_behind():
    trajs, plan, cfg = _setup()
    model = build_model(cfg, seed=3, dtype=torch.float64)
    trainer = PlanTrainer(model, plan, loss=LOSS)
    prepared = trainer.prepare(trajs, 1 << 20)
    trainer.forward_backward(trajs, 1 << 20, prepared=prepared)
    # (iterating prepared.microbatches would run the windows' bookkeeping again)
    ctxs = [ctx for _, _, ctx, _ in prepared.microbatches.items]
    assert any(c.record is not None for c in ctxs) and any(c._places is not None for c in ctxs)
    for c in ctxs:
        assert c.stash is None  # consumers: the producer's leaves (and their .grad) released
        if c.record is not None:  # producers: an empty stash, its gathers kept for the next pass
            assert not c.record.inputs and not c.record.kda_states
    assert trainer.windows and all(w.retained_bytes > 0 for w in trainer.windows)


def test_a_dropped_window_step_is_freed_without_the_garbage_collector():
    """The prepared microbatches of a window step (their contexts' device index arrays,
    tables and token ids) go when the step is dropped, by reference counting: no producer
    hook holds its run in a cycle that only a garbage collection would break (which a
    training loop would meet as memory held into the next step)."""
    import gc
    import weakref

    trajs, plan, cfg = _setup()
    model = build_model(cfg, seed=3, dtype=torch.float32)
    trainer = PlanTrainer(model, plan, loss=LOSS)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        prepared = trainer.prepare(trajs, 1 << 20)
        assert any(mb.keep_forward is not None for mb in prepared.microbatches)
        trainer.step(trajs, 1 << 20, prepared=prepared)
        run, ctx = weakref.ref(prepared.microbatches), weakref.ref(prepared.microbatches.items[0][2])
        del prepared
        assert run() is None and ctx() is None
    finally:
        if enabled:
            gc.enable()


def test_stash_leaf_gradients_hold_only_their_own_rows():
    """Before the producer's backward, every stashed leaf's accumulated gradient owns a
    storage of exactly its size: no slice of a consumer's wider gradient (a conv input's over
    all its rows) is kept alive through it."""
    trajs, plan, cfg = _setup()
    model = build_model(cfg, seed=3, dtype=torch.float64)
    trainer = PlanTrainer(model, plan, loss=LOSS)
    seen = []
    backward = trainer.layout._producer_backward

    def check_then_backward(window):
        for leaf in window.stash._leaves.values():
            for t in (leaf if isinstance(leaf, tuple) else (leaf,)):
                if t.grad is not None:
                    seen.append(t.grad.shape)
                    assert t.grad._base is None
                    assert t.grad.untyped_storage().nbytes() == t.grad.numel() * t.grad.element_size()
        backward(window)

    trainer.layout._producer_backward = check_then_backward
    trainer.forward_backward(trajs, 1 << 20)
    assert len(seen) > 3  # conv, KDA and attention inputs


def test_prepared_contexts_build_the_fused_kda_pieces_ahead():
    """`prepare` builds the consumers' conv windows and placements and the producers' cut
    of their rounds' inputs, so the step does none of that host work."""
    trajs, plan, cfg = _setup()
    trainer = PlanTrainer(build_model(cfg, seed=3, dtype=torch.float64), plan, loss=LOSS)
    ctxs = [ctx for _, _, ctx, _ in trainer.prepare(trajs, 1 << 20).microbatches.items]
    consumers = [c for c in ctxs if c._places is not None and c.record is None]
    producers = [c for c in ctxs if c.record is not None and c._places is None]
    assert consumers and producers
    assert all(cfg.conv_window in c._consumer_pieces for c in consumers)
    assert all("kda@rounds" in c._record_template._cuts for c in producers)


def test_window_backward_has_no_advanced_indexing_scatter():
    """Advanced-indexing backwards (`index_put_` with accumulate) in the window step are no
    more than in the single-microbatch tree step, per microbatch: the stash cuts, the
    consumers' local rows and their conv outputs are gathers with gather backwards."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from harts.exec.tree_trainer import TreeTrainer

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "index_put" in func.__name__:
                self.n += 1
            return func(*args, **(kwargs or {}))

    trajs, plan, cfg = _setup()
    counts = {}
    for name in ("tree", "windows"):
        model = build_model(cfg, seed=3, dtype=torch.float64)
        trainer = PlanTrainer(model, plan, loss=LOSS) if name == "windows" else TreeTrainer(model, loss=LOSS)
        prepared = trainer.prepare(trajs, 1 << 20)
        with Count() as c:
            trainer.forward_backward(trajs, 1 << 20, prepared=prepared)
        counts[name] = (c.n, len(prepared.microbatches))
    (tree_n, tree_mbs), (win_n, win_mbs) = counts["tree"], counts["windows"]
    assert win_n <= tree_n * win_mbs / tree_mbs, counts


def test_offloaded_producer_state_gives_the_same_step(monkeypatch):
    """A window producer's saved tensors held in host memory (`HostOffload`, every size
    here) give the step of the same plan with them left in place, bit for bit; what is
    moved includes every block's checkpointed input (`recompute=True`), never a parameter."""
    import harts.exec.offload as offload

    monkeypatch.setattr(offload, "DEFAULT_MIN_BYTES", 0)
    trajs, plan, cfg = _setup()
    runs = {}
    for moved in (False, True):
        model = build_model(cfg, seed=3, dtype=torch.float64, recompute=True)
        trainer = PlanTrainer(model, plan, loss=LOSS, offload_producers=moved)
        res = trainer.forward_backward(trajs, 1 << 20)
        runs[moved] = (res, _grads(model), trainer.windows)
    assert runs[False][0].losses == runs[True][0].losses
    for a, b in zip(runs[False][1], runs[True][1], strict=True):
        assert torch.equal(a, b)
    assert all(w.offloaded_bytes == 0 for w in runs[False][2])
    assert runs[True][2]
    for w in runs[True][2]:  # at least every block's input over the producer's rows
        assert w.offloaded_bytes >= cfg.num_layers * w.producer_rows * cfg.d_model * 8


def test_host_offload_moves_saved_activations_and_keeps_parameters():
    lin = torch.nn.Linear(6, 6, dtype=torch.float64)
    x0 = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    ref = torch.autograd.grad(torch.tanh(lin(x0 * 2)).sum(), [x0, lin.weight])
    hooks = HostOffload(min_bytes=0)
    with hooks:
        y = torch.tanh(lin(x0 * 2)).sum()  # linear saves its input and (a view of) its weight
    got = torch.autograd.grad(y, [x0, lin.weight])
    assert hooks.tensors == 2 and hooks.bytes == 2 * 5 * 6 * 8  # the input and tanh's output
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    small = HostOffload(min_bytes=10**6)
    with small:
        torch.tanh(lin(x0 * 2)).sum()
    assert small.tensors == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_window_step_checkpoints_bit_identical_whichever_kind(monkeypatch, dtype):
    """With recomputation a window step checkpoints its producer with the non-reentrant
    checkpoint (its stash needs the forward's graph) and its consumers with the reentrant
    one; losses and every gradient equal those of the all-non-reentrant step and of the
    step without recomputation, bit for bit. One thread: float32 on the CPU with several
    is not run-to-run deterministic (docs/LOG.md, 2026-12-05)."""
    import harts.exec.model.model as model_module

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = _runs_by_checkpoint(monkeypatch, model_module, dtype)
    finally:
        torch.set_num_threads(threads)
    _, plan, _ = _setup()
    producers = len(plan.consumers())
    assert runs["none"][2] == []
    assert sorted(runs["auto"][2]) == sorted([(True, "hooks")] * producers + [(False, "reentrant")] * (
        len(plan.microbatches) - producers))
    for name in ("hooks", "auto"):
        assert runs[name][0] == runs["none"][0], name
        for a, b in zip(runs[name][1], runs["none"][1], strict=True):
            assert torch.equal(a, b), name


def _runs_by_checkpoint(monkeypatch, model_module, dtype) -> dict:
    """(losses, gradients, [(records a stash, checkpoint kind)]) of one window step per
    way of checkpointing: none, all non-reentrant, and `checkpoint_kind`'s choice."""
    trajs, plan, cfg = _setup()
    real = model_module.checkpoint_kind
    runs = {}
    for name in ("none", "hooks", "auto"):
        kinds = []

        def kind_of(ctx, x_TD, name=name, kinds=kinds):
            k = "hooks" if name == "hooks" else real(ctx, x_TD)
            kinds.append((getattr(ctx, "record", None) is not None, k))
            return k

        monkeypatch.setattr(model_module, "checkpoint_kind", kind_of)
        model = build_model(cfg, seed=3, dtype=dtype, recompute=name != "none")
        res = PlanTrainer(model, plan, loss=LOSS).forward_backward(trajs, 1 << 20)
        runs[name] = (res.losses, _grads(model), kinds)
    return runs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_producers_that_store_rather_than_recompute_give_the_same_step(monkeypatch, dtype):
    """`producer_recompute=False`: a producer's blocks run without checkpointing, so its
    backward recomputes nothing and all it saved passes through the offload hooks; the
    consumers still checkpoint. Losses and every gradient equal the default step's, bit
    for bit (one thread, as above), and the producers' forwards run once, not twice."""
    import harts.exec.model.model as model_module
    import harts.exec.offload as offload

    monkeypatch.setattr(offload, "DEFAULT_MIN_BYTES", 0)
    trajs, plan, cfg = _setup()
    real, block_run = model_module.checkpoint_kind, model_module.Block.forward
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {}
    try:
        for stored in (False, True):
            kinds, calls = [], []

            def kind_of(ctx, x_TD, kinds=kinds):
                kinds.append(getattr(ctx, "record", None) is not None)
                return real(ctx, x_TD)

            def block_forward(block, x_TD, ctx, calls=calls):
                calls.append(getattr(ctx, "record", None) is not None)
                return block_run(block, x_TD, ctx)

            monkeypatch.setattr(model_module, "checkpoint_kind", kind_of)
            monkeypatch.setattr(model_module.Block, "forward", block_forward)
            model = build_model(cfg, seed=3, dtype=dtype, recompute=True)
            trainer = PlanTrainer(model, plan, loss=LOSS, offload_producers=True, producer_recompute=not stored)
            res = trainer.forward_backward(trajs, 1 << 20)
            runs[stored] = (res.losses, _grads(model), kinds, sum(calls), trainer.windows)
    finally:
        torch.set_num_threads(threads)
    producers, n = len(plan.consumers()), len(plan.microbatches)
    assert runs[False][0] == runs[True][0]
    for a, b in zip(runs[False][1], runs[True][1], strict=True):
        assert torch.equal(a, b)
    # checkpointed microbatches: every one by default, the consumers alone when stored
    assert sorted(runs[False][2]) == sorted([True] * producers + [False] * (n - producers))
    assert runs[True][2] == [False] * (n - producers)
    # a producer's blocks run once less, with no recomputation in its backward (block
    # calls of producers: the statistics pass, the forward and, by default, the recompute)
    assert runs[False][3] - runs[True][3] == producers * cfg.num_layers
    # what the hooks moved: every saved activation of the producer's blocks, more than
    # their checkpointed inputs alone
    for w_def, w_st in zip(runs[False][4], runs[True][4], strict=True):
        assert w_st.offloaded_bytes > w_def.offloaded_bytes


def test_producer_recompute_is_the_plan_kinds_option():
    from harts.exec.factory import make_trainer

    with pytest.raises(ValueError, match="producer_recompute"):
        make_trainer("tree", build_model(get_model_config("tiny-cpu")), producer_recompute=False)
