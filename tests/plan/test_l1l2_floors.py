"""l1l2 with microbatch floors: windows only where they pay (PlanConfig.microbatch_floor,
consumer_floor; harts.sim.executor.window_floors)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.plan.planners import make_plan
from harts.plan.planners.l1l2.pipeline import floored_load
from harts.tree import build_forest, shapes

MODEL = get_model_config("tiny-h200")


def _forest(family: str, seed: int, budget: int):
    return build_forest(shapes.draw(family, seed, budget, vocab_size=MODEL.vocab_size))


def _plans(forest, budget: int, floor: float, consumer: float):
    base = dict(microbatch_tokens=budget, chunk_size=MODEL.chunk_size)
    return (make_plan(forest, "l1l2", PlanConfig(**base)),
            make_plan(forest, "l1l2", PlanConfig(**base, microbatch_floor=floor, consumer_floor=consumer)),
            make_plan(forest, "l1", PlanConfig(**base)))


def test_floors_above_every_load_keep_the_plan_without_consumers():
    """bushy/3@2048: the windowed plan has no fewer microbatches than L1's, and consumers;
    with floors above every microbatch's load each costs its floor (a consumer more), so
    L1's plan is kept, valid and windowless, and the floored loads are recorded."""
    forest = _forest("bushy", 3, 2048)
    plain, floored, l1 = _plans(forest, 2048, 1e9, 1e9)
    assert any(m.producer is not None for m in plain.microbatches)
    assert len(l1.microbatches) <= len(plain.microbatches)
    assert all(m.producer is None for m in floored.microbatches)
    assert len(floored.microbatches) == len(l1.microbatches)
    floored.validate(forest, budget=2048)
    assert floored.info["chosen"] == "l1" and set(floored.info["floored_load"]) == {"l1", "windows"}


@settings(max_examples=12, deadline=None)
@given(family=st.sampled_from(sorted(shapes.FAMILIES)), seed=st.integers(0, 50),
       floor=st.floats(0.0, 20000.0), consumer=st.floats(0.0, 5000.0))
def test_floors_keep_the_cheaper_of_the_two_plans(family, seed, floor, consumer):
    """Whatever the floors, l1l2 returns a valid plan whose floored load is the smaller of
    its windowed plan's and L1's (each as l1l2 alone would make it)."""
    budget = 2048
    forest = _forest(family, seed, budget)
    plain, floored, l1 = _plans(forest, budget, floor, consumer)
    floored.validate(forest, budget=budget)
    config = PlanConfig(microbatch_tokens=budget, chunk_size=MODEL.chunk_size, microbatch_floor=floor,
                        consumer_floor=consumer)
    got = floored_load(floored.microbatches, config)
    windowed = plain if any(m.producer is not None for m in plain.microbatches) else None
    candidates = [floored_load(l1.microbatches, config)]
    if windowed is not None:
        candidates.append(floored_load(windowed.microbatches, config))
    assert got == pytest.approx(min(candidates), rel=1e-9)


def test_zero_floors_change_nothing():
    forest = _forest("grpo", 2, 2048)
    plain, floored, _ = _plans(forest, 2048, 0.0, 0.0)
    assert [m.to_dict() for m in plain.microbatches] == [m.to_dict() for m in floored.microbatches]


def test_negative_floors_are_refused():
    with pytest.raises(ValueError, match="microbatch_floor"):
        PlanConfig(microbatch_floor=-1.0)
    with pytest.raises(ValueError, match="consumer_floor"):
        PlanConfig(consumer_floor=-0.5)


def test_window_floors_are_host_time_over_device_time_per_token():
    """A profile whose host takes twice as long per launch doubles both floors; a model
    with more work per token (tiny-h200 against tiny-cpu) has lower floors in tokens."""
    from harts.sim.executor import window_floors
    from harts.sim.hardware import load_hardware

    hw = load_hardware("h100")
    a = window_floors(MODEL, hw, 16384)
    b = window_floors(MODEL, hw, 16384, rates=hw.executor.with_values(host_s_per_launch=2 * hw.executor.host_s_per_launch))
    assert a[0] > 0 and a[1] > 0
    assert b[0] == pytest.approx(2 * a[0]) and b[1] == pytest.approx(2 * a[1])
    assert window_floors(get_model_config("tiny-cpu"), hw, 16384)[0] > a[0]
