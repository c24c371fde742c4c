"""Shape families (harts.tree.shapes): every instance fits its budget, has a tree larger
than it and at most four budgets of compact rows, shares tokens the way its family says,
and needs more than one microbatch under l1l2; the same seed draws the same instance. A long
family's longest path is past the budget (at most four budgets), and every planner cuts it
into microbatches within the budget."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.planners import PlanConfig, make_plan
from harts.tree import build_forest, shapes

BUDGETS = (1024, 8192, 16384, 32768)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(shapes.FAMILIES)), st.integers(0, 10_000), st.sampled_from(BUDGETS))
def test_instances_fit_the_budget_and_need_splitting(family, seed, budget):
    trajs = shapes.draw(family, seed, budget)
    forest = build_forest(trajs)
    assert max(t.tokens.size for t in trajs) <= budget
    assert budget < forest.compact_tokens <= shapes.MAX_COMPACT_BUDGETS * budget
    assert all(t.loss_mask.any() for t in trajs)
    assert forest.expanded_tokens > forest.compact_tokens  # something is shared
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=64))
    assert plan.num_microbatches >= 2  # one tree is larger than a microbatch


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(sorted(shapes.LONG_FAMILIES)), st.integers(0, 10_000), st.sampled_from(BUDGETS),
       st.sampled_from(["l1l2", "expanded-ffd"]))
def test_long_families_run_past_the_budget_and_plan_within_it(family, seed, budget, planner):
    trajs = shapes.draw(family, seed, budget)
    forest = build_forest(trajs)
    assert budget < max(t.tokens.size for t in trajs) <= shapes.LONG_MAX_PATH * budget
    assert forest.compact_tokens <= shapes.LONG_MAX_COMPACT_BUDGETS * budget
    assert forest.expanded_tokens > forest.compact_tokens
    assert all(t.loss_mask.any() for t in trajs)
    plan = make_plan(forest, planner, PlanConfig(microbatch_tokens=budget, chunk_size=64))
    assert plan.num_microbatches >= 2
    assert max(mb.executed_tokens for mb in plan.microbatches) <= budget


def test_same_seed_same_instance_and_families_differ():
    a, b = shapes.draw("grpo", 3, 16384), shapes.draw("grpo", 3, 16384)
    assert [t.id for t in a] == [t.id for t in b]
    assert all(np.array_equal(x.tokens, y.tokens) and np.array_equal(x.loss_mask, y.loss_mask)
               for x, y in zip(a, b, strict=True))
    c = shapes.draw("grpo", 4, 16384)
    assert [t.tokens.size for t in a] != [t.tokens.size for t in c]


def test_family_structure():
    grpo = build_forest(shapes.draw("grpo", 0, 16384))
    assert grpo.num_trajectories >= 8 and len({t.group for t in shapes.draw("grpo", 0, 16384)}) == 1
    fan = shapes.draw("fanout", 0, 16384)
    assert len(fan) >= 32
    fan_forest = build_forest(fan)
    assert fan_forest.expanded_tokens / fan_forest.compact_tokens > 10  # a long prompt under many short responses
    step = shapes.draw("stepwise", 0, 16384)
    # step-wise: each sequence trains its last action only, so trained tokens form one run
    for t in step:
        idx = np.flatnonzero(t.loss_mask)
        assert idx[-1] == t.tokens.size - 1 and np.all(np.diff(idx) == 1)
    chain = shapes.draw("long-chain", 0, 16384)
    assert max(t.tokens.size for t in chain) >= 0.7 * 16384 * 0.9


def test_unknown_family_and_tiny_budget_refused():
    with pytest.raises(KeyError, match="unknown shape family.*long-agent"):
        shapes.draw("nope", 0, 16384)
    with pytest.raises(ValueError, match="at least 256"):
        shapes.draw("grpo", 0, 128)
