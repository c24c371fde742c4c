"""Pipeline-aware planning (`PlanConfig.pp`): plans made for a pipeline still validate and
keep l1l2's compression, l1l2 fills each replica with at least `min_microbatches_per_stage
x pp` microbatches when the trees allow it (splitting them into sharing windows, so no row
is computed twice), the baseline gets the same floor, and with pp = 1 the floor is ignored."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.cli.main import main
from harts.config.plan import PlanConfig
from harts.plan.planners import PlannerName, make_plan
from harts.plan.planners.common import pipeline_ends, pipelined_critical_path
from harts.tree.workload import generate, preset
from tests.strategies import pipeline_plan_configs, plan_forests

forest_and_pipeline_config = plan_forests().flatmap(lambda f: st.tuples(st.just(f), pipeline_plan_configs(f)))


def _consumers_per_replica(plan) -> list[int]:
    """Non-producer microbatches on each replica (producers share their consumers' slots)."""
    producers = {mb.producer for mb in plan.microbatches if mb.producer is not None}
    per = Counter(mb.replica for mb in plan.microbatches if mb.id not in producers)
    return [per.get(r, 0) for r in range(plan.dp)]


@given(forest_and_pipeline_config, st.sampled_from([PlannerName.EXPANDED_FFD, PlannerName.L1, PlannerName.L1L2]))
def test_pipeline_plans_validate(forest_config, name):
    forest, config = forest_config
    plan = make_plan(forest, name, config)
    plan.validate(forest, cost_model=config.cost_model)
    assert plan.dp == config.dp
    assert plan.expanded_tokens == forest.expanded_tokens
    assert sorted(t for mb in plan.microbatches for t in mb.trajectories) == list(range(forest.num_trajectories))


@given(forest_and_pipeline_config)
def test_pipeline_l1l2_compresses_at_least_like_l1(forest_config):
    forest, config = forest_config
    # every tree on one replica (a tree split over replicas recomputes its groups' shared rows)
    config = dataclasses.replace(config, split_trees=False)
    l1 = make_plan(forest, "l1", config)
    l1l2 = make_plan(forest, "l1l2", config)
    assert forest.compact_tokens <= l1l2.executed_tokens <= l1.executed_tokens


@settings(max_examples=10)
@given(forest_and_pipeline_config, st.sampled_from([PlannerName.EXPANDED_FFD, PlannerName.L1, PlannerName.L1L2]))
def test_pipeline_same_seed_same_plan(forest_config, name):
    forest, config = forest_config
    a = dataclasses.replace(make_plan(forest, name, config), plan_seconds=0.0)
    b = dataclasses.replace(make_plan(forest, name, config), plan_seconds=0.0)
    assert a.to_json() == b.to_json()


@pytest.mark.parametrize(("dp", "pp", "per_stage"), [(4, 2, 2), (2, 4, 2), (2, 2, 3)])
def test_l1l2_fills_the_pipeline_with_windows(dp, pp, per_stage):
    """swe-treestep-8 has two or four trees per replica here: without a pipeline l1l2 packs
    them into one microbatch per replica; for the pipeline it splits them into windows."""
    forest = generate(preset("swe-treestep-8")).forest()
    config = PlanConfig(dp=dp, pp=pp, min_microbatches_per_stage=per_stage)
    assert config.target_microbatches == pp * per_stage
    plan = make_plan(forest, "l1l2", config)
    assert min(_consumers_per_replica(plan)) >= pp * per_stage
    assert plan.executed_tokens == forest.compact_tokens  # split into windows, nothing recomputed
    assert any(mb.producer is not None for mb in plan.microbatches)
    assert plan.info["target_microbatches"] == pp * per_stage
    flat = make_plan(forest, "l1l2", PlanConfig(dp=dp))
    assert max(_consumers_per_replica(flat)) < pp * per_stage


def test_expanded_baseline_gets_the_same_floor():
    forest = generate(preset("small-treestep", seed=1)).forest()
    budget = 4 * int(forest.traj_length.max())
    flat = make_plan(forest, "expanded-ffd", PlanConfig(dp=2, microbatch_tokens=budget))
    assert max(_consumers_per_replica(flat)) < 6
    piped = make_plan(forest, "expanded-ffd", PlanConfig(dp=2, pp=3, microbatch_tokens=budget))
    assert min(_consumers_per_replica(piped)) >= 6


def test_floor_is_capped_by_the_work():
    """Fewer trajectories than the floor: one microbatch each, every plan still valid."""
    forest = generate(preset("tiny-treestep")).forest()
    config = PlanConfig(dp=1, pp=4, min_microbatches_per_stage=3 * forest.num_trajectories)
    for name in (PlannerName.EXPANDED_FFD, PlannerName.L1, PlannerName.L1L2):
        plan = make_plan(forest, name, config)
        assert plan.num_microbatches >= 1
    assert make_plan(forest, "expanded-ffd", config).num_microbatches == forest.num_trajectories


@pytest.mark.parametrize("name", [p.value for p in PlannerName if p != PlannerName.ORTOOLS_FFD])
def test_without_a_pipeline_the_floor_is_ignored(name):
    forest = generate(preset("swe-treestep-8")).forest()
    a = dataclasses.replace(make_plan(forest, name, PlanConfig(dp=3)), plan_seconds=0.0)
    b = dataclasses.replace(make_plan(forest, name, PlanConfig(dp=3, pp=1, min_microbatches_per_stage=7)),
                            plan_seconds=0.0)
    assert a.to_json() == b.to_json()
    assert PlanConfig(pp=1, min_microbatches_per_stage=7).target_microbatches == 1


def test_pipelined_critical_path():
    uniform = [[2.0] * 6, [2.0] * 6]
    ends = [pipeline_ends(row, 0.25) for row in uniform]
    assert ends == [2.0, 2.0]
    # (m + pp - 1) l / pp, the textbook 1F1B step of m equal microbatches
    assert pipelined_critical_path(uniform, 3, ends) == pytest.approx((6 + 3 - 1) * 2.0 / 3)
    # without a pipeline: sum over slots of the slowest replica, ends unused
    assert pipelined_critical_path([[1.0, 4.0], [3.0, 2.0]], 1) == 7.0
    assert pipeline_ends([0.0, 4.0, 8.0, 0.0], 0.5) == pytest.approx(0.5 * 4.0 + 0.5 * 8.0)
    with pytest.raises(ValueError, match="fill and drain"):
        pipelined_critical_path(uniform, 2)


@pytest.mark.parametrize(("changes", "message"), [({"pp": 0}, "pp"),
                                                  ({"min_microbatches_per_stage": 0}, "min_microbatches_per_stage")])
def test_pipeline_config_is_checked(changes, message):
    forest = generate(preset("tiny-treestep")).forest()
    with pytest.raises(ValueError, match=message):
        make_plan(forest, "l1l2", PlanConfig(**changes))


def test_sim_plans_for_the_simulated_pipeline(capsys):
    code = main(["sim", "--workload", "swe-treestep-8", "--planner", "l1l2", "--schedule", "consumer-1f1b",
                 "--model", "tiny", "--gpus", "8", "--json"])
    assert code == 0
    d = json.loads(capsys.readouterr().out)
    assert d["parallel"].startswith("DP4/PP2")
    # at least 2 x PP = 4 consumers on each of the 4 replicas, plus their producers
    assert d["microbatches"] > 16
