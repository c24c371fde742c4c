"""l1l2 with microbatch floors: windows only where they pay (PlanConfig.microbatch_floor,
consumer_floor; harts.sim.executor.window_floors)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.plan.planners import make_plan
from harts.plan.planners.common import floored_load
from harts.tree import build_forest, shapes

MODEL = get_model_config("tiny-h200")


def _forest(family: str, seed: int, budget: int):
    return build_forest(shapes.draw(family, seed, budget, vocab_size=MODEL.vocab_size))


def _plans(forest, budget: int, floor: float, consumer: float, per_row: float = 0.0):
    base = dict(microbatch_tokens=budget, chunk_size=MODEL.chunk_size)
    return (make_plan(forest, "l1l2", PlanConfig(**base)),
            make_plan(forest, "l1l2", PlanConfig(**base, microbatch_floor=floor, consumer_floor=consumer,
                                                 consumer_row_cost=per_row)),
            make_plan(forest, "l1", PlanConfig(**base)))


def test_floors_above_every_load_keep_the_plan_without_consumers():
    """bushy/3@2048: the windowed plan has consumers; with floors above every
    microbatch's load each costs its floor (a consumer one more), which makes L1's plan
    the cheaper here, so it is kept, valid and windowless, and the floored loads are
    recorded."""
    forest = _forest("bushy", 3, 2048)
    plain, floored, l1 = _plans(forest, 2048, 1e9, 1e9)
    consumers = sum(m.producer is not None for m in plain.microbatches)
    assert consumers
    assert len(l1.microbatches) < len(plain.microbatches) + consumers
    assert all(m.producer is None for m in floored.microbatches)
    assert len(floored.microbatches) == len(l1.microbatches)
    floored.validate(forest, budget=2048)
    assert floored.info["chosen"] == "l1" and set(floored.info["floored_load"]) == {"l1", "windows"}


@settings(max_examples=12, deadline=None)
@given(family=st.sampled_from(sorted(shapes.FAMILIES)), seed=st.integers(0, 50),
       floor=st.floats(0.0, 20000.0), consumer=st.floats(0.0, 5000.0), per_row=st.floats(0.0, 1.0))
def test_floors_keep_the_cheaper_of_the_two_plans(family, seed, floor, consumer, per_row):
    """Whatever the floors, l1l2 returns a valid plan whose floored load is the smaller of
    its windowed plan's and L1's (each as l1l2 alone would make it)."""
    budget = 2048
    forest = _forest(family, seed, budget)
    plain, floored, l1 = _plans(forest, budget, floor, consumer, per_row)
    floored.validate(forest, budget=budget)
    config = PlanConfig(microbatch_tokens=budget, chunk_size=MODEL.chunk_size, microbatch_floor=floor,
                        consumer_floor=consumer, consumer_row_cost=per_row)
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
    with pytest.raises(ValueError, match="consumer_row_cost"):
        PlanConfig(consumer_row_cost=-0.1)


def test_window_floors_are_host_time_over_device_time_per_token():
    """A profile whose host takes twice as long per launch doubles both floors and leaves
    the consumer's per-row cost (device time) alone; twice the consumer's device seconds
    per producer row doubles that cost; a model with more work per token (tiny-h200
    against tiny-cpu) has lower floors in tokens."""
    from harts.sim.executor import window_floors
    from harts.sim.hardware import load_hardware

    hw = load_hardware("h100")
    r = hw.executor
    a = window_floors(MODEL, hw, 16384)
    b = window_floors(MODEL, hw, 16384, rates=r.with_values(host_s_per_launch=2 * r.host_s_per_launch))
    c = window_floors(MODEL, hw, 16384, rates=r.with_values(
        consumer_device_s_per_producer_row=2 * r.consumer_device_s_per_producer_row))
    assert min(a) > 0
    assert b[0] == pytest.approx(2 * a[0]) and b[1] == pytest.approx(2 * a[1]) and b[2] == pytest.approx(a[2])
    assert c[2] == pytest.approx(2 * a[2]) and c[:2] == pytest.approx(a[:2])
    assert window_floors(get_model_config("tiny-cpu"), hw, 16384)[0] > a[0]


def test_a_consumer_row_cost_is_charged_per_producer_row():
    """floored_load adds consumer_row_cost x the producer's executed rows to each
    consumer's load (and nothing to producers or standalone microbatches)."""
    forest = _forest("grpo", 2, 2048)
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=2048, chunk_size=MODEL.chunk_size))
    consumers = [m for m in plan.microbatches if m.producer is not None]
    assert consumers
    rows = {m.id: m.executed_tokens for m in plan.microbatches}
    base = PlanConfig(microbatch_tokens=2048, chunk_size=MODEL.chunk_size)
    charged = PlanConfig(microbatch_tokens=2048, chunk_size=MODEL.chunk_size, consumer_row_cost=0.5)
    extra = 0.5 * sum(rows[m.producer] for m in consumers)
    assert floored_load(plan.microbatches, charged) == pytest.approx(floored_load(plan.microbatches, base) + extra)
