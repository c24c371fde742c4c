"""Schedules as data: validity of every builder, the text round trip, and the structure
that distinguishes the three PP schedules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.plan.schedule import PassOp, Schedule, build_schedule, known_schedules
from harts.plan.work import KDARound, MicrobatchWork, StepWork
from tests.strategies import sim_steps

SCHEDULES = ("non-overlap", "overlap-bwd-first", "consumer-1f1b")


def test_registry_names_and_unknown():
    assert set(known_schedules()) == set(SCHEDULES)
    step = _window_step()
    with pytest.raises(KeyError, match="unknown schedule"):
        build_schedule("gpipe", step, 2)


@given(sim_steps(), st.integers(1, 4), st.sampled_from(SCHEDULES))
def test_builders_are_valid_and_round_trip(step, stages, name):
    sched = build_schedule(name, step, stages)
    sched.validate(step)
    text = sched.to_text()
    again = Schedule.from_text(text)
    assert again == sched
    assert again.to_text() == text


def _mb(i, producer=None, slot=0):
    return MicrobatchWork(mb=i, replica=0, tokens=100, kda_rounds=(KDARound(100, 2),),
                          attn_pairs_causal=5050, producer=producer, slot=slot, order=i,
                          expanded_tokens=0 if producer is None and i in (0, 3) else 100)


def _window_step():
    # window A: producer 0, consumers 1, 2; window B: producer 3, consumers 4, 5
    mbs = [_mb(0, None, 0), _mb(1, 0, 0), _mb(2, 0, 1), _mb(3, None, 2), _mb(4, 3, 2), _mb(5, 3, 3)]
    return StepWork(tuple(mbs), 1, expanded_tokens=400)


def ops(name, stage, stages=2):
    return " ".join(op.text() for op in build_schedule(name, _window_step(), stages).ops(0, stage))


def test_figure3_structure():
    # non-overlap: each window drains (PB before the next PF on every stage)
    assert ops("non-overlap", 0) == "F0 F1 F2 B1 B2 B0 F3 F4 F5 B4 B5 B3"
    assert ops("non-overlap", 1) == "F0 F1 B1 F2 B2 B0 F3 F4 B4 F5 B5 B3"
    # overlap + backward-first: the next window's PF runs before this window's backwards
    # end on stage 0; PB is its own pass right after the last consumer backward
    assert ops("overlap-bwd-first", 0) == "F0 F1 F2 B1 F3 F4 B2 B0 F5 B4 B5 B3"
    assert ops("overlap-bwd-first", 1) == "F0 F1 B1 F2 B2 B0 F3 F4 B4 F5 B5 B3"
    # consumer 1F1B: PB runs inside the last consumer backward; only stage 0 holds both
    # windows' producers at once (F3 before B2+B0), as in the paper's Figure 3
    assert ops("consumer-1f1b", 0) == "F0 F1 F2 B1 F3 F4 B2+B0 F5 B4 B5+B3"
    assert ops("consumer-1f1b", 1) == "F0 F1 B1 F2 B2+B0 F3 F4 B4 F5 B5+B3"


def test_text_errors():
    with pytest.raises(ValueError, match="must start with"):
        Schedule.from_text("name x\n")
    with pytest.raises(ValueError, match="bad schedule token"):
        PassOp.parse("F1+B2")
    with pytest.raises(ValueError, match="lacks"):
        Schedule.from_text("# harts-schedule v1\nname x\nstages 1\n")


def test_validate_catches_bad_orders():
    step = _window_step()
    good = build_schedule("consumer-1f1b", step, 1)
    (rank, seq), = good.ranks
    # the fused B2+B0 before consumer B1: the producer backward would miss B1's gradient
    bad = tuple(PassOp.parse(t) for t in "F0 F1 F2 B2+B0 B1 F3 F4 B4 F5 B5+B3".split())
    with pytest.raises(ValueError, match="before consumer B1"):
        Schedule(good.name, 1, 1, ((rank, bad),)).validate(step)
    with pytest.raises(ValueError, match="3 is not 1.s producer"):
        Schedule(good.name, 1, 1, ((rank, tuple(PassOp.parse(t) for t in
                 "F0 F1 F2 F3 B1+B3 B2+B0 F4 B4 F5 B5".split())),)).validate(step)
    missing = tuple(op for op in seq if op.text() != "F5")
    with pytest.raises(ValueError):
        Schedule(good.name, 1, 1, ((rank, missing),)).validate(step)
