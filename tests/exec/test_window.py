"""Plans with sharing windows execute exactly: producer + consumers == expanded == one tree."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import build_model
from harts.exec.trainer import ExpandedTrainer
from harts.exec.tree_trainer import TreeTrainer
from harts.exec.window import PlanTrainer
from harts.plan.planners import make_plan
from harts.tree import build_forest
from harts.tree.workload import generate_trajectories
from harts.verify.equivalence import compare_steps
from tests.strategies import trajectory_sets

TOL = 1e-10
LOSS = PolicyLossConfig(kl_coef=0.1)


def _config(chunk: int):
    return get_model_config("tiny-cpu").replace(chunk_size=chunk, aux_scope="global")


def _run(trainer_cls, cfg, trajs, *args, **kw):
    model = build_model(cfg, seed=3, dtype=torch.float64)
    trainer = trainer_cls(model, *args, loss=LOSS, **kw)
    return model, trainer, trainer.forward_backward(trajs, 1 << 20)


def _check(ref, ref_model, got, got_model):
    rep = compare_steps(ref, ref_model, got, got_model)
    assert rep["max_rel_logprob_err"] <= TOL, rep["max_rel_logprob_err"]
    assert rep["max_rel_grad_err"] <= TOL, rep["worst_grad_params"]
    assert rep["max_rel_expert_load_err"] <= TOL
    for name, err in rep["loss_abs_err"].items():
        assert err <= TOL, name
    return rep


def _tight_budget(forest) -> int:
    # every trajectory fits, whole trees do not: the planners must split at forks
    return max(int(forest.traj_length.max()) + 5, forest.compact_tokens // 3)


def _windowed(trajs, chunk, planner, budget):
    forest = build_forest(trajs)
    plan = make_plan(forest, planner, PlanConfig(microbatch_tokens=budget, chunk_size=chunk))
    return plan


@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("workload,seed", [("tiny-treestep", 1), ("tiny-stepwise", 2)])
def test_split_plans_match_expanded_and_single_tree(workload, seed, chunk):
    trajs = generate_trajectories(workload, seed=seed)
    forest = build_forest(trajs)
    budget = _tight_budget(forest)
    cfg = _config(chunk)
    ref_model, _, ref = _run(ExpandedTrainer, cfg, trajs)
    tree_model, _, tree = _run(TreeTrainer, cfg, trajs)
    for planner in ("l1l2", "l1", "ortools-ffd", "expanded-ffd"):
        plan = _windowed(trajs, chunk, planner, budget)
        model, trainer, got = _run(PlanTrainer, cfg, trajs, plan)
        _check(ref, ref_model, got, model)
        _check(tree, tree_model, got, model)
        if planner == "l1l2" and plan.consumers():
            assert trainer.windows and all(w.retained_bytes > 0 for w in trainer.windows)


@settings(max_examples=12)
@given(trajectory_sets(max_groups=2, max_per_group=5, max_len=24, alphabet=2, with_ref=True),
       st.sampled_from([2, 4, 8]),
       st.floats(0.3, 0.9))
def test_drawn_forests_and_budgets(trajs, chunk, frac):
    forest = build_forest(trajs)
    longest = int(forest.traj_length.max())
    budget = max(longest, int(forest.compact_tokens * frac))
    plan = _windowed(trajs, chunk, "l1l2", budget)
    cfg = _config(chunk)
    ref_model, _, ref = _run(ExpandedTrainer, cfg, trajs)
    model, _, got = _run(PlanTrainer, cfg, trajs, plan)
    _check(ref, ref_model, got, model)


def test_recomputation_inside_windows_is_bit_identical():
    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    plan = _windowed(trajs, 8, "l1l2", _tight_budget(forest))
    assert plan.consumers(), "the budget must force a sharing window"
    grads = []
    for recompute in (False, True):
        model = build_model(_config(8), seed=3, dtype=torch.float64, recompute=recompute)
        PlanTrainer(model, plan, loss=LOSS).forward_backward(trajs, 1 << 20)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_microbatch_scope_is_refused_only_where_it_breaks_equivalence():
    # row weights still sum to the expanded batch's counts, so expert loads are exact
    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    plan = _windowed(trajs, 8, "l1l2", _tight_budget(forest))
    cfg = get_model_config("tiny-cpu").replace(chunk_size=8)
    _, _, ref = _run(ExpandedTrainer, cfg, trajs)
    _, _, got = _run(PlanTrainer, cfg, trajs, plan)
    assert np.allclose(got.expert_load, ref.expert_load, rtol=0, atol=1e-9)


def test_cli_train_and_verify_with_a_planner(capsys):
    import json

    from harts.cli.main import main

    # tiny-treestep seed 0: trees of 180 and 283 compact rows, longest trajectory 161 tokens
    args = ["--workload", "tiny-treestep", "--microbatch-tokens", "170"]
    assert main(["train", "--mode", "tree", "--planner", "l1l2", "--steps", "1", "--json", *args]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert steps[0]["microbatches"] > 2 and np.isfinite(steps[0]["loss"])
    assert main(["verify", "--planner", "l1l2", "--json", *args]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["sharing_windows"] >= 1 and rep["aux_scope"] == "global"
    assert rep["max_rel_logprob_err"] <= TOL and rep["max_rel_grad_err"] <= TOL
    assert rep["vs_single_microbatch"]["max_rel_grad_err"] <= TOL
    assert all(b > 0 for b in rep["window_retained_bytes"])
    assert main(["verify", "--planner", "nope"]) == 2
    assert main(["train", "--mode", "tree", "--planner", "l1l2", "--microbatch-tokens", "50"]) == 2
    # longer trajectories are chained; a budget below two KDA chunks (chunk 64) is refused
    assert "raise --microbatch-tokens to >= 128" in capsys.readouterr().err


def test_overlapping_windows_give_the_same_step_and_add_up_their_memory():
    # the shape with two windows at its tight budget: the generator's copies and last-turn forks
    trajs = generate_trajectories("tiny-treestep", seed=1, allow_duplicates=True, last_turn_branching=True)
    forest = build_forest(trajs)
    plan = _windowed(trajs, 8, "l1l2", _tight_budget(forest))
    windows = plan.consumers()
    assert len(windows) >= 2, "needs two sharing windows"
    (p1, c1), (p2, c2) = sorted(windows.items())[:2]
    default = [m.id for m in sorted(plan.microbatches, key=lambda m: (m.replica, m.order))]
    # the second producer runs before the first window's last consumer
    overlapped = [i for i in default if i != p2]
    overlapped.insert(overlapped.index(c1[-1]), p2)
    runs = {}
    for name, order in (("default", default), ("overlapped", overlapped)):
        model = build_model(_config(8), seed=3, dtype=torch.float64)
        trainer = PlanTrainer(model, plan, loss=LOSS, order=order)
        runs[name] = (model, trainer, trainer.forward_backward(trajs, 1 << 20))
    _check(runs["default"][2], runs["default"][0], runs["overlapped"][2], runs["overlapped"][0])
    sizes = {w.producer: w.retained_bytes for w in runs["default"][1].windows}
    assert runs["default"][1].peak_retained_bytes == max(sizes[p1], sizes[p2])
    assert runs["overlapped"][1].peak_retained_bytes == sizes[p1] + sizes[p2]
    with pytest.raises(ValueError, match="before its producer"):
        PlanTrainer(build_model(_config(8), dtype=torch.float64), plan, order=[c1[0], *[i for i in default if i != c1[0]]])


def test_producers_request_only_the_states_their_rounds_and_consumers_read():
    import harts.exec.layouts.plan as window_module
    from harts.exec.tree import TreeContext

    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    plan = _windowed(trajs, 8, "l1l2", _tight_budget(forest))
    made = []

    class Recording(TreeContext):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

        def release_record(self):
            # a producer drops its stash after its backward; keep the last one to inspect
            self.last_record = self.record
            super().release_record()

    model = build_model(_config(8), seed=3, dtype=torch.float64)
    with mock.patch.object(window_module, "TreeContext", Recording):
        PlanTrainer(model, plan, loss=LOSS).forward_backward(trajs, 1 << 20)
    producers = [ctx for ctx in made if ctx.record is not None]
    # (the global aux scope runs every microbatch twice: a statistics pass, then the step)
    assert len(plan.consumers()) >= 1 and len(producers) % len(plan.consumers()) == 0
    assert all(hasattr(ctx, "last_record") for ctx in producers)
    assert any(ctx.last_record.state_keys for ctx in producers), "no consumer starts from a producer state"
    requested = boundary_states = 0
    for ctx in producers:
        sch = ctx.schedule
        B = sch.chunk_size
        # states later rounds start from, and S(a) at each consumer start, in the numbering
        # of the round that computed the row at depth a-1
        reads = {(int(r), int(i)) for rnd in sch.rounds
                 for r, i in zip(rnd.init_round, rnd.init_index, strict=True) if r >= 0}
        for row, a in ctx.last_record.state_keys:
            local = int(np.searchsorted(ctx.layout.rows, row))
            reads.add((int(sch.row_round[local]),
                       int(sch.row_state_base[local]) + (a - int(sch.row_seq_start[local])) // B - 1))
        for r, index in enumerate(ctx.chunk_state_index):
            assert index.tolist() == sorted(i for rr, i in reads if rr == r)
        requested += len(reads)
        boundary_states += sum(int((np.diff(rnd.cu_seqlens) // B).sum()) for rnd in sch.rounds)
    assert requested < boundary_states


def test_the_executor_runs_a_simulator_schedule():
    """A `Schedule` from harts.sim drives the execution order (its first stage's forwards),
    with the same step as the plan's own order."""
    from harts.config.models import get_model_config
    from harts.exec.window import order_from_schedule
    from harts.plan.schedule import build_schedule
    from harts.plan.step import step_from_plan

    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    plan = _windowed(trajs, 8, "l1l2", _tight_budget(forest))
    assert plan.consumers(), "needs a sharing window"
    step = step_from_plan(plan, forest, get_model_config("tiny-cpu").chunk_size)
    runs = {}
    for name in ("plan order", "overlap-bwd-first"):
        model = build_model(_config(8), seed=3, dtype=torch.float64)
        kw = {} if name == "plan order" else {"schedule": build_schedule(name, step, 2)}
        trainer = PlanTrainer(model, plan, loss=LOSS, **kw)
        runs[name] = (model, trainer.forward_backward(trajs, 1 << 20))
    _check(runs["plan order"][1], runs["plan order"][0], runs["overlap-bwd-first"][1], runs["overlap-bwd-first"][0])
    sched = build_schedule("consumer-1f1b", step, 2)
    assert sorted(order_from_schedule(sched)) == sorted(m.id for m in plan.microbatches)
    with pytest.raises(ValueError, match="not both"):
        PlanTrainer(build_model(_config(8), dtype=torch.float64), plan, order=[0], schedule=sched)


# ---- the default aux scope ("microbatch"): each microbatch's aux loss weighs by its share
# of the step's expanded tokens, so the executor's per-microbatch `expanded_tokens` is part
# of the step (every test above forces the global scope, where it is not).

PLANNERS = ("l1l2", "l1", "ortools-ffd", "expanded-ffd")


def _microbatch_scope(chunk: int):
    cfg = get_model_config("tiny-cpu").replace(chunk_size=chunk)
    assert cfg.aux_scope == "microbatch" and cfg.aux_loss_coef > 0 and cfg.num_moe_layers
    return cfg


def _recording(trainer):
    """Keep every `Microbatch` the trainer's layout yields (the microbatch scope iterates
    them once per step)."""
    seen = []
    inner = trainer.layout.microbatches

    def recorded(*args, **kw):
        for mb in inner(*args, **kw):
            seen.append(mb)
            yield mb

    trainer.layout.microbatches = recorded
    return seen


def _plan_step_under_microbatch_scope(trajs, plan, chunk):
    """The plan's step under the microbatch scope; with no windows also TreeTrainer's step on
    the plan's partition, and the two compared: same rows per microbatch, so the same
    expert statistics and the same share of the step's tokens. The only difference is row
    order within a microbatch (GEMM and reduction order), a float64 rounding of ~1e-15
    relative; TOL = 1e-10 is this file's tolerance for equal steps, far below the effect of
    a wrong share (a microbatch's aux term scaled by compact / expanded tokens, tens of
    percent on these forests)."""
    forest = build_forest(trajs)
    cfg = _microbatch_scope(chunk)
    model = build_model(cfg, seed=3, dtype=torch.float64)
    trainer = PlanTrainer(model, plan, loss=LOSS)
    seen = _recording(trainer)
    got = trainer.forward_backward(trajs, 1 << 20)
    assert len(seen) == len(plan.microbatches)
    # every expanded token is counted once, whichever microbatch computes its row
    assert sum(mb.expanded_tokens for mb in seen) == forest.expanded_tokens
    if not plan.consumers():
        plan_tokens = {tuple(m.trajectories): m.expanded_tokens for m in plan.microbatches}
        assert [mb.expanded_tokens for mb in seen] == [plan_tokens[tuple(mb.members)] for mb in seen]
        ref_model = build_model(cfg, seed=3, dtype=torch.float64)
        partition = trainer.partition(trajs, 1 << 20)
        ref = TreeTrainer(ref_model, loss=LOSS).forward_backward(trajs, 1 << 20, partition)
        assert got.losses["aux_loss"] != 0
        _check(ref, ref_model, got, model)
    return plan


def test_windowless_plans_under_the_microbatch_scope_equal_the_tree_trainer():
    """Whole trees per microbatch (budget = the biggest tree: several microbatches, except
    for l1l2, which splits a tree into a window there and so gets the whole forest as one
    microbatch), on trees that share rows, so a microbatch's compact rows are fewer than
    its expanded tokens."""
    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    trees = [build_forest([t for t in trajs if t.group == g]) for g in sorted({t.group for t in trajs})]
    biggest = max(f.compact_tokens for f in trees)
    assert biggest < forest.compact_tokens and forest.compact_tokens < forest.expanded_tokens
    for planner in PLANNERS:
        budget = forest.compact_tokens if planner == "l1l2" else biggest
        plan = _windowed(trajs, 8, planner, budget)
        assert not plan.consumers(), planner
        assert len(plan.microbatches) >= (1 if planner == "l1l2" else 2), planner
        _plan_step_under_microbatch_scope(trajs, plan, 8)


def test_window_plans_under_the_microbatch_scope_count_every_expanded_token_once():
    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    for planner in PLANNERS:
        plan = _windowed(trajs, 8, planner, _tight_budget(forest))
        if planner == "l1l2":
            assert plan.consumers(), "the budget must force a sharing window"
        _plan_step_under_microbatch_scope(trajs, plan, 8)


@settings(max_examples=8)
@given(trajectory_sets(max_groups=2, max_per_group=5, max_len=24, alphabet=2, with_ref=True),
       st.sampled_from(PLANNERS), st.sampled_from([2, 4, 8]), st.floats(0.3, 1.0))
def test_drawn_plans_under_the_microbatch_scope(trajs, planner, chunk, frac):
    forest = build_forest(trajs)
    budget = max(int(forest.traj_length.max()), int(forest.compact_tokens * frac))
    config = PlanConfig(microbatch_tokens=budget, chunk_size=chunk, time_limit=0.05)
    _plan_step_under_microbatch_scope(trajs, make_plan(forest, planner, config), chunk)
