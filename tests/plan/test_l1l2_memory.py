"""l1l2 on one replica without a pipeline: the slots run one after another, so a cell's
fill is chosen for the lowest peak memory (`CellSolver.peak_tokens`), not for level slot
loads. Against the same planner choosing by slot loads (`sequential` off): every row
computed once whenever that choice does so, no more total load, never a higher peak;
and on a bushy tree, where
levelling shaves prefixes into the producer, strictly lower."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.planners import PlanConfig, make_plan
from harts.plan.planners.l1l2 import CellSolver, pipeline
from harts.tree.workload import generate, preset
from tests.strategies import plan_forests, tight_plan_configs


def _plans(forest, config, monkeypatch):
    """(chosen for memory, chosen for level slots) plans of `forest` under `config`, as the
    cells are filled (no window repacked with its producer taking items whole afterwards,
    which raises a producer's rows toward the budget in either: tests/plan/test_l1l2_absorb.py)."""
    init = CellSolver.__init__

    def levelling(self, idx, cfg):
        init(self, idx, cfg)
        self.sequential = False

    # nested window trees with pieces of `piece_tokens` rows (the producer charge alone):
    # the cells' fill is what differs
    config = dataclasses.replace(config, chain_retention=None)
    with monkeypatch.context() as m:
        m.setattr(pipeline, "take_into_producers", lambda cells, cfg, solver=None: (cells, 0))
        by_memory = make_plan(forest, "l1l2", config)
        m.setattr(CellSolver, "__init__", levelling)
        by_load = make_plan(forest, "l1l2", config)
    return by_memory, by_load


def _executed(plan) -> int:
    return sum(m.executed_tokens for m in plan.microbatches)


def _check(forest, config, by_memory, by_load):
    for p in (by_memory, by_load):
        p.validate(forest, cost_model=config.cost_model)
    # where the budget leaves l1l2 no plan computing every row once, it keeps l1's (which
    # recomputes shared rows): never more often for the memory choice
    assert _executed(by_memory) <= _executed(by_load)
    if _executed(by_load) == forest.compact_tokens:
        assert _executed(by_memory) == forest.compact_tokens
        cost = [sum(m.cost for m in p.microbatches) for p in (by_memory, by_load)]
        assert cost[0] <= cost[1] * (1 + 1e-9)
        assert max(by_memory.memory_tokens()) <= max(by_load.memory_tokens()) + 1e-9


@settings(max_examples=25, deadline=None)
@given(plan_forests().flatmap(lambda f: st.tuples(st.just(f), tight_plan_configs(f))))
def test_one_replica_never_peaks_above_the_levelled_choice(forest_config):
    import pytest

    forest, config = forest_config
    config = dataclasses.replace(config, dp=1, pp=1)
    with pytest.MonkeyPatch.context() as mp:
        by_memory, by_load = _plans(forest, config, mp)
    _check(forest, config, by_memory, by_load)


def test_a_bushy_tree_peaks_lower_than_when_levelled(monkeypatch):
    # one tree of 198,322 rows and 16 leaves (branching 4): one producer and 4 consumers
    forest = generate(preset("swe-treestep-1", vocab_size=1024, branching=4, rollouts_per_group=16)).forest()
    config = PlanConfig(microbatch_tokens=65536, chunk_size=64)
    by_memory, by_load = _plans(forest, config, monkeypatch)
    _check(forest, config, by_memory, by_load)
    assert by_memory.consumers() and by_load.consumers()
    assert max(by_memory.memory_tokens()) < 0.9 * max(by_load.memory_tokens())
