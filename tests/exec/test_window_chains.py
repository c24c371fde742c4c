"""Chains of sharing windows: trajectories 2-4x the microbatch budget, cut into
chunk-aligned pieces (harts.plan.planners.chains), equal the expanded step at a budget that
fits them (float64: every log-prob, loss term, expert load and gradient within 1e-10;
float32 as the window tests' float32 bound), for every planner; forks inside a piece's
first chunk, on a cut, one past a cut and deep; drawn fork positions too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import build_model
from harts.exec.trainer import ExpandedTrainer
from harts.exec.window import PlanTrainer
from harts.plan.planners import make_plan
from harts.plan.planners.chains import piece_tokens
from harts.plan.step import step_from_plan
from harts.tree import build_forest
from harts.verify.equivalence import compare_steps
from tests.strategies import long_chain_forests, long_chain_trajectories

TOL = 1e-10
TOL32 = 1e-5  # tests/distributed/cases.py's float32 bound (relative RMS error)
LOSS = PolicyLossConfig(kl_coef=0.1)
CHUNK = 8
BUDGET = 24  # pieces of 16 rows: cuts at depths 16, 32, 48, ...
PLANNERS = ("l1", "l1l2", "expanded-ffd")


def _config():
    return get_model_config("tiny-cpu").replace(num_layers=2, kda_per_mla=1, chunk_size=CHUNK, aux_scope="global")


def _run(cfg, trajs, plan=None, dtype=torch.float64, loss=LOSS):
    model = build_model(cfg, seed=3, dtype=dtype)
    trainer = ExpandedTrainer(model, loss=loss) if plan is None else PlanTrainer(model, plan, loss=loss)
    return model, trainer, trainer.forward_backward(trajs, 1 << 20)


def _plan(trajs, planner, budget=BUDGET, **fields):
    return make_plan(build_forest(trajs), planner, PlanConfig(microbatch_tokens=budget, chunk_size=CHUNK, **fields))


def _check(ref, ref_model, got, got_model):
    rep = compare_steps(ref, ref_model, got, got_model)
    assert rep["max_rel_logprob_err"] <= TOL, rep["max_rel_logprob_err"]
    assert rep["max_rel_entropy_err"] <= TOL
    assert rep["max_rel_grad_err"] <= TOL, rep["worst_grad_params"]
    assert rep["max_rel_expert_load_err"] <= TOL
    for name, err in rep["loss_abs_err"].items():
        assert err <= TOL * max(1.0, abs(ref.losses[name])), name


# a trunk of 3.5 budgets; forks inside the first chunk of the second piece (19), on a cut
# (32), one past it (33) and deep (70), two of the branches longer than the budget
FORKS = [(19, 12), (32, 20), (33, 5), (70, 10)]


@pytest.fixture(scope="module")
def explicit():
    trajs = long_chain_trajectories(84, FORKS, seed=1)
    ref_model, _, ref = _run(_config(), trajs)
    return trajs, ref_model, ref


@pytest.mark.parametrize("planner", PLANNERS)
def test_explicit_forks_match_expanded(explicit, planner):
    trajs, ref_model, ref = explicit
    plan = _plan(trajs, planner)
    assert plan.info["chains"] >= 1
    assert any(m.producer is not None and plan.microbatches[m.producer].producer is not None
               for m in plan.microbatches), "the plan must hold a chain of windows"
    assert max(plan.memory_tokens()) <= BUDGET
    model, trainer, got = _run(_config(), trajs, plan)
    _check(ref, ref_model, got, model)
    assert trainer.windows and all(w.retained_bytes > 0 for w in trainer.windows)
    assert trainer.peak_retained_bytes > 0


@pytest.mark.parametrize("planner", PLANNERS)
def test_pieces_sized_by_their_context_match_expanded(explicit, planner):
    # `chain_retention`: a piece cut inside a node pays the smaller of its producer's charge
    # and chain_retention x its context rows, so the first pieces run longer than
    # `piece_tokens`, the later ones shorter as their context grows
    trajs, ref_model, ref = explicit
    forest = build_forest(trajs)
    config = PlanConfig(microbatch_tokens=BUDGET, chunk_size=CHUNK, chain_retention=0.1)
    plan = make_plan(forest, planner, config)
    assert plan.chain_retention == 0.1
    base = make_plan(forest, planner, PlanConfig(microbatch_tokens=BUDGET, chunk_size=CHUNK, chain_retention=None))
    assert plan.num_microbatches < base.num_microbatches
    assert max(m.executed_tokens for m in plan.microbatches) > piece_tokens(config)
    assert max(plan.memory_tokens()) <= BUDGET
    plan.validate(forest)
    model, _, got = _run(_config(), trajs, plan)
    _check(ref, ref_model, got, model)


def test_a_chain_charge_leaving_no_chunk_falls_back_to_the_producer_charge():
    # at two chunks a budget and retention 0.9, a first piece of the whole budget (the
    # fork at its end) leaves the stems below it less than a chunk: the chain is built
    # under the producer charge
    trajs = long_chain_trajectories(40, [(16, 9)], seed=2)
    forest = build_forest(trajs)
    kw = dict(microbatch_tokens=2 * CHUNK, chunk_size=CHUNK, producer_retention=0.9)
    for planner in PLANNERS:
        plan = make_plan(forest, planner, PlanConfig(**kw, chain_retention=0.05))
        plan.validate(forest)
        assert max(plan.memory_tokens()) <= 2 * CHUNK


@pytest.mark.parametrize("forks", ([(28, 6), (30, 7), (60, 5)], [(27, 6), (29, 5), (31, 4), (62, 3)]))
def test_a_piece_going_on_through_several_forks_matches_expanded(forks):
    # forks two rows apart whose branches do not fit beside the piece: the piece goes on
    # through them along the trunk, and one leaf holds branches of two forks (its context
    # the longer root path)
    from harts.plan.planners.chains import chain_windows
    from harts.plan.planners.common import ForestIndex

    trajs = long_chain_trajectories(84, forks, seed=4)
    forest = build_forest(trajs)
    # pieces of `piece_tokens` rows throughout (the producer charge alone)
    config = PlanConfig(microbatch_tokens=BUDGET, chunk_size=CHUNK, chain_retention=None)
    idx = ForestIndex(forest, config.cost_model)
    mbs, _ = chain_windows(idx, int(forest.roots[0]), config, go_on=True, through=True)
    trunk_nodes = [len([v for v in m.rows if len(idx.children[v]) > 1]) for m in mbs]
    assert max(trunk_nodes) >= 2, "a piece spanning two forks"
    assert any(len({idx.parent[v] for v in m.rows if idx.parent[v] not in m.rows}) > 1 for m in mbs), \
        "a leaf holding branches of two forks"
    plan = make_plan(forest, "l1l2", config)
    assert plan.num_microbatches == len(mbs)
    ref_model, _, ref = _run(_config(), trajs)
    model, _, got = _run(_config(), trajs, plan)
    _check(ref, ref_model, got, model)


@pytest.mark.parametrize("planner", ("l1", "l1l2"))
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_fork_branches_sunk_into_a_later_leaf_match_expanded(planner, dtype):
    # a 200-token trunk at a 64-token budget with branches at four depths: the branches
    # leave their own pieces' windows for one leaf under a later piece
    # (`harts.plan.planners.leaves.sink_leaves`), which reads them through the chain's
    # stashes (the fork rows, the states and replayed inputs where a branch starts)
    trajs = long_chain_trajectories(200, [(30, 6), (75, 9), (120, 7), (165, 8)], seed=1)
    config = PlanConfig(microbatch_tokens=64, chunk_size=CHUNK, microbatch_floor=40, consumer_floor=10,
                        chain_retention=None)
    plan = make_plan(build_forest(trajs), planner, config)
    assert plan.info["sunk_leaves"] == 2
    cfg = _config()
    ref_model, _, ref = _run(cfg, trajs, dtype=dtype)
    model, _, got = _run(cfg, trajs, plan, dtype=dtype)
    if dtype == torch.float64:
        _check(ref, ref_model, got, model)
    else:
        rep = compare_steps(ref, ref_model, got, model)
        assert rep["rms_rel_logprob_err"] <= TOL32
        assert rep["rms_rel_grad_err"] <= TOL32


@pytest.mark.parametrize("planner", ("l1", "l1l2"))
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_a_tree_split_over_replicas_matches_expanded(explicit, planner, dtype):
    # one long tree at dp=2: its trajectories in two groups, each group's paths a window
    # tree on its own replica, the rows they share computed once per group
    # (harts.plan.planners.tree_split); the replicas run one after the other here
    trajs, ref_model, ref = explicit
    forest = build_forest(trajs)
    plan = make_plan(forest, planner, PlanConfig(microbatch_tokens=BUDGET, chunk_size=CHUNK, dp=2))
    assert plan.info["split_trees"] == [2]
    assert {m.replica for m in plan.microbatches} == {0, 1}
    assert plan.executed_tokens > forest.compact_tokens
    if dtype == torch.float64:
        model, _, got = _run(_config(), trajs, plan)
        _check(ref, ref_model, got, model)
        return
    cfg = _config()
    ref_model, _, ref = _run(cfg, trajs, dtype=dtype)
    model, _, got = _run(cfg, trajs, plan, dtype=dtype)
    rep = compare_steps(ref, ref_model, got, model)
    assert rep["rms_rel_logprob_err"] <= TOL32
    assert rep["rms_rel_grad_err"] <= TOL32


def test_chain_pieces_are_chunk_aligned_and_priced():
    trajs = long_chain_trajectories(84, FORKS, seed=1)
    forest = build_forest(trajs)
    plan = _plan(trajs, "l1l2")
    start = forest.node_start
    for m in plan.microbatches:
        # a piece that continues its producer's node starts on the chunk grid
        if m.producer is not None:
            prod = {(v, e) for v, _, e in plan.microbatches[m.producer].pieces}
            for v, a, _ in m.pieces:
                if a > 0 and (v, a) in prod:
                    assert (int(start[v]) + a) % CHUNK == 0
    step = step_from_plan(plan, forest, CHUNK)
    chain = [w for r in range(plan.dp) for w in step.replica_windows(r) if w.chain]
    assert chain, "a chain window in the simulator's step structure"


def test_budget_below_two_chunks_is_refused():
    trajs = long_chain_trajectories(40, [(5, 3)])
    with pytest.raises(ValueError, match="below two KDA chunks"):
        _plan(trajs, "l1", budget=2 * CHUNK - 1)
    assert piece_tokens(PlanConfig(microbatch_tokens=2 * CHUNK, chunk_size=CHUNK)) == CHUNK


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(long_chain_forests(BUDGET))
def test_drawn_forks_match_expanded(trajs):
    cfg = _config()
    ref_model, _, ref = _run(cfg, trajs)
    for planner in PLANNERS:
        plan = _plan(trajs, planner)
        model, _, got = _run(cfg, trajs, plan)
        _check(ref, ref_model, got, model)


def test_float32_chain_matches_expanded(explicit):
    trajs = explicit[0]
    cfg = _config()
    ref_model, _, ref = _run(cfg, trajs, dtype=torch.float32)
    model, _, got = _run(cfg, trajs, _plan(trajs, "l1l2"), dtype=torch.float32)
    rep = compare_steps(ref, ref_model, got, model)
    assert rep["rms_rel_logprob_err"] <= TOL32
    assert rep["rms_rel_grad_err"] <= TOL32


@pytest.mark.parametrize("stored", [False, True])
def test_recomputed_and_stored_chain_pieces_match_expanded(explicit, stored, monkeypatch):
    # with recomputation, chain pieces that are producers (and consumers of the piece above)
    # checkpointed as the default does, or storing what they save in host memory (every
    # saved tensor moved, whatever its size)
    import harts.exec.offload as offload

    monkeypatch.setattr(offload, "DEFAULT_MIN_BYTES", 0)
    trajs, ref_model, ref = explicit
    plan = _plan(trajs, "l1l2")
    model = build_model(_config(), seed=3, dtype=torch.float64, recompute=True)
    trainer = PlanTrainer(model, plan, loss=LOSS, offload_producers=True, producer_recompute=not stored)
    _check(ref, ref_model, trainer.forward_backward(trajs, 1 << 20), model)
    assert all(w.offloaded_bytes > 0 for w in trainer.windows)


@pytest.mark.parametrize(("family", "seed"), [("long-agent", 0), ("long-agent", 3), ("long-group", 1)])
def test_long_family_instances_match_expanded(family, seed):
    # the benchmark suites' long families (harts.tree.shapes.LONG_FAMILIES) at a budget of
    # 256 rows: paths of 1.5-4 budgets with forks off them at drawn turns (no reference
    # log-probs drawn, so no KL term)
    from harts.tree import shapes

    cfg = _config()
    trajs = shapes.draw(family, seed, 256, vocab_size=cfg.vocab_size)
    loss = PolicyLossConfig()
    ref_model, _, ref = _run(cfg, trajs, loss=loss)
    for planner in ("l1l2", "expanded-ffd"):
        plan = make_plan(build_forest(trajs), planner, PlanConfig(microbatch_tokens=256, chunk_size=CHUNK))
        assert plan.info["chains"] >= 1
        model, _, got = _run(cfg, trajs, plan, loss=loss)
        _check(ref, ref_model, got, model)


@pytest.mark.parametrize(("family", "seed", "budget"), [("swe-tree", 5, 208), ("bushy", 3, 138)])
def test_nested_window_trees_match_expanded(family, seed, budget):
    # trees every trajectory of which fits the budget but no one-window cell holds, drawn
    # at 256 rows and planned at `budget`: l1l2 runs them as nested windows
    # (harts.plan.planners.l1l2.nested_trees), every row once
    from harts.tree import shapes

    cfg = _config()
    trajs = shapes.draw(family, seed, 256, vocab_size=cfg.vocab_size)
    forest = build_forest(trajs)
    assert int(forest.traj_length.max()) <= budget
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=CHUNK))
    assert plan.info["nested_trees"] >= 1 and plan.executed_tokens == forest.compact_tokens
    loss = PolicyLossConfig()
    ref_model, _, ref = _run(cfg, trajs, loss=loss)
    model, _, got = _run(cfg, trajs, plan, loss=loss)
    _check(ref, ref_model, got, model)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_outer_stashes_in_host_memory_match_expanded(explicit, dtype):
    # with no outer stash allowed on the device (`chain_stash_device_budgets=0`) every stash
    # above a reader's nearest producer moves to host memory once a deeper piece is kept:
    # the step equals the expanded reference, and the step that moves none bit for bit (the
    # same operations, in the same order, on tensors copied to and from host memory)
    from harts.config.kernels import KernelConfig

    trajs, ref_model, ref = explicit
    cfg = _config()
    if dtype == torch.float32:
        ref_model, _, ref = _run(cfg, trajs, dtype=dtype)
    plan = _plan(trajs, "l1l2")
    runs = {}
    for budgets in (0.0, 1e9):
        model = build_model(cfg, seed=3, dtype=dtype, recompute=True)
        trainer = PlanTrainer(model, plan, loss=LOSS, kernels=KernelConfig(chain_stash_device_budgets=budgets))
        runs[budgets] = (model, trainer, trainer.forward_backward(trajs, 1 << 20))
    model, trainer, got = runs[0.0]
    moved = [w for w in trainer.windows if w.stash_host_bytes]
    # pieces two or more below a producer read its stash as an outer one
    assert len(moved) >= 3 and all(w.stash_host_bytes <= w.retained_bytes for w in moved)
    assert not any(w.stash_host_bytes for w in runs[1e9][1].windows)
    if dtype == torch.float64:
        _check(ref, ref_model, got, model)
    else:
        rep = compare_steps(ref, ref_model, got, model)
        assert rep["rms_rel_logprob_err"] <= TOL32 and rep["rms_rel_grad_err"] <= TOL32
    kept = runs[1e9]
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got.logprobs, kept[2].logprobs, strict=True))
    for (name, p), q in zip(model.named_parameters(), kept[0].parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("budgets", (0.0, 1.0, 2.0))
def test_the_simulator_moves_the_stashes_the_executor_moves(explicit, budgets):
    # `harts.plan.step.outer_stashes_on_host` names the producers whose stash the executor
    # moves to host memory under the same rule, and the readers that read from there
    from harts.config.kernels import KernelConfig
    from harts.plan.step import outer_stashes_on_host

    trajs = explicit[0]
    plan = _plan(trajs, "l1l2", chain_retention=None)  # pieces of `piece_tokens` rows, eight deep
    model = build_model(_config(), seed=3, dtype=torch.float64, recompute=True)
    trainer = PlanTrainer(model, plan, loss=LOSS, kernels=KernelConfig(chain_stash_device_budgets=budgets))
    trainer.forward_backward(trajs, 1 << 20)
    moved, host_rows = outer_stashes_on_host(plan, budgets)
    assert {w.producer for w in trainer.windows if w.stash_host_bytes} == moved
    # the chain is eight pieces deep: at two budgets of 24 rows only its first stash moves
    assert len(moved) >= (4 if budgets < 2 else 1)
    # only readers two or more pieces below a producer read from host memory
    mbs = plan.microbatches
    assert host_rows and all(mbs[mbs[r].producer].producer is not None for r in host_rows)
