"""A long trajectory's fork branches sunk into one later leaf
(`harts.plan.planners.leaves.sink_leaves`): the same rows in fewer microbatches, every
plan valid and within the memory rule, and no plan longer than without sinking (where no
tree is split over replicas, whose groupings are chosen by step load)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.plan.planners import make_plan
from harts.sim.executor import plan_floors
from harts.tree import build_forest, shapes
from tests.strategies import long_chain_trajectories, long_family_plan_cases


def _unsunk(forest, planner, config):
    return make_plan(forest, planner, dataclasses.replace(config, sink_leaves=False))


def _leaves(plan):
    producers = {m.producer for m in plan.microbatches if m.producer is not None}
    return [m for m in plan.microbatches if m.producer is not None and m.id not in producers]


@pytest.mark.parametrize("planner", ["l1", "l1l2"])
def test_branches_of_four_forks_share_a_leaf(planner):
    # a 200-token trunk at a 64-token budget (pieces of 40), branches of 6-9 tokens at
    # four depths: each fork's branch was a consumer of its own; sunk, they share a later
    # leaf, and the short tree beside the trunk fills the room one of them left
    forest = build_forest(long_chain_trajectories(200, [(30, 6), (75, 9), (120, 7), (165, 8)], seed=1))
    # floors (token equivalents of the host's time a microbatch) under which a leaf moves
    config = PlanConfig(microbatch_tokens=64, chunk_size=8, microbatch_floor=40, consumer_floor=10,
                        chain_retention=None)
    plan = make_plan(forest, planner, config)
    before = _unsunk(forest, planner, config)
    plan.validate(forest, budget=64)
    assert len(plan.microbatches) == len(before.microbatches) - 2 == 6 and plan.info["sunk_leaves"] == 2
    assert plan.executed_tokens == before.executed_tokens == forest.compact_tokens
    assert max(plan.memory_tokens()) <= 64
    # one leaf holds branches of several forks and reads the longest of their root paths
    widest = max(_leaves(plan), key=lambda m: len(m.trajectories))
    assert len(widest.trajectories) >= 3
    assert plan.microbatches[widest.producer].producer is not None


def test_long_agent_12_at_16k():
    # three branch consumers of 2.8-4.6k rows under three pieces become one under the last
    forest = build_forest(shapes.draw("long-agent", 12, 16384, vocab_size=1024))
    floors = plan_floors(get_model_config("tiny-h200"), "h100", 16384)  # `harts train`'s on an H100
    config = PlanConfig(microbatch_tokens=16384, chunk_size=64, **floors, chain_retention=None)
    plan = make_plan(forest, "l1l2", config)
    plan.validate(forest, budget=16384)
    assert len(plan.microbatches) == 5 and len(_unsunk(forest, "l1l2", config).microbatches) == 7
    # pieces sized by their context (the default chain charge) reach 5 without sinking
    charged = dataclasses.replace(config, chain_retention=0.076)
    assert len(_unsunk(forest, "l1l2", charged).microbatches) == 5
    # over replicas or pipeline stages (which the floors do not price) none moves either
    for spread in ({"dp": 2}, {"pp": 2}):
        assert "sunk_leaves" not in make_plan(forest, "l1l2", dataclasses.replace(config, **spread)).info
    # without floors no leaf is known to be host-paced, and none moves
    bare = PlanConfig(microbatch_tokens=16384, chunk_size=64, chain_retention=None)
    assert make_plan(forest, "l1l2", bare).microbatches == _unsunk(forest, "l1l2", bare).microbatches


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(long_family_plan_cases())
def test_sinking_never_lengthens_a_plan(case):
    forest, config = case
    B = config.microbatch_tokens
    config = dataclasses.replace(config, microbatch_floor=0.4 * B, consumer_floor=0.1 * B)
    for planner in ("l1", "l1l2"):
        plan = make_plan(forest, planner, config)
        plan.validate(forest, cost_model=config.cost_model)
        assert max(m.executed_tokens for m in plan.microbatches) <= config.microbatch_tokens
        before = _unsunk(forest, planner, config)
        if "split_trees" in plan.info or "split_trees" in before.info:
            continue  # trees split over replicas are chosen by step load, not by count
        assert len(plan.microbatches) <= len(before.microbatches)
        # with a chain charge the plan without it competes, sunk and unsunk alike, so the
        # leaves sunk are counted against the unsunk plan under the same charge only
        if plan.info.get("sunk_leaves") and config.chain_retention is None:
            assert len(plan.microbatches) < len(before.microbatches)


def test_the_benchmark_prices_both_plans(tmp_path):
    """benchmarks/bench_chain_sink.py: the sunk and the kept plan of each instance priced
    by the executor model, the changed ones counted, written with provenance."""
    import json

    from benchmarks import bench_chain_sink

    out = tmp_path / "sink.json"
    assert bench_chain_sink.main(["--families", "long-agent", "--seeds", "12", "--budgets", "16384",
                                  "--chain-retention", "off", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert "git_revision" in got["provenance"] and got["hardware"] == "h100"
    (row,) = got["rows"]
    assert (row["kept"]["microbatches"], row["sunk"]["microbatches"]) == (7, 5)
    assert row["change"] == row["sunk"]["step_s"] / row["kept"]["step_s"] - 1 < 0
    assert got["summary"]["changed"] == got["summary"]["faster_1pct"] == 1
