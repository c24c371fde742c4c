"""Heddle's predicted-tail pools (`harts.sim.rollout.pools`): a tail pool of the highest
degree holds at most K of the trajectories predicted longest, a bulk pool the rest."""

from __future__ import annotations

import dataclasses

from harts.config.rollout import rollout_preset
from harts.sim.rollout import SegmentKind, TrajectorySpec, TurnSpec, get_policy, simulate_rollout
from harts.sim.rollout.pools import pool_rule

CFG = rollout_preset("tiny", model="qwen3-8b", baseline_mp=2, mp_degrees=(2, 4), max_context=65536)
LAYOUT, K = [4, 2, 2], 1  # worker 0 (MP4) is the tail pool, for one trajectory


def _specs(pool_tool_s: float):
    """tid 0: predicted longest at the start (hint 3 turns), three 100-token turns with
    `pool_tool_s`-second tool calls; tid 1: hint 1 turn, but a 1000-token first turn and two
    more; tids 2-9: one 50-token turn each."""
    first = TrajectorySpec(0, 0, tuple(TurnSpec(200, 100, pool_tool_s) for _ in range(3)), hint_turns=3.0)
    late = TrajectorySpec(1, 1, (TurnSpec(200, 1000, 0.5), TurnSpec(50, 1000, 0.5), TurnSpec(50, 1000, 0.0)),
                          hint_turns=1.0)
    rest = [TrajectorySpec(i, 2, (TurnSpec(200, 50, 0.0),), hint_turns=1.0) for i in range(2, 10)]
    return (first, late, *rest)


def _run(policy: str, pool_tool_s: float):
    pol = dataclasses.replace(get_policy(policy), adaptive_mp=False)
    specs = _specs(pool_tool_s)
    return simulate_rollout(CFG, pol, 8, specs=specs, plan=(LAYOUT, None, K)), specs


def _decode_workers(res, tid: int, turn: int) -> set[int]:
    tl = next(t for t in res.timelines if t.tid == tid)
    return {s.worker for s in tl.segments if s.kind == SegmentKind.DECODE and s.turn == turn}


def test_a_trajectory_predicted_long_after_its_first_turn_enters_a_pool_with_room():
    """tid 0 starts in the tail pool (predicted longest) and is done within a second; tid 1,
    predicted short, starts in the bulk, and its 1000-token first turn makes it the
    predicted longest (at its 512-token re-prediction point): it moves into the pool, which
    has room, mid-turn, and decodes the rest of its turns there."""
    res, specs = _run("heddle-tail-pools", pool_tool_s=0.05)
    assert _decode_workers(res, 0, 0) == {0}
    tl = next(t for t in res.timelines if t.tid == 1)
    decode = [s for s in tl.segments if s.kind == SegmentKind.DECODE]
    assert decode[0].worker != 0 and decode[-1].worker == 0
    assert [s.to_worker for s in tl.segments if s.kind == SegmentKind.MIGRATE] == [0]
    assert _decode_workers(res, 1, 1) == _decode_workers(res, 1, 2) == {0}
    assert res.generated_tokens == sum(s.generated_tokens for s in specs)


def test_a_full_pool_admits_no_one_where_tail_isolation_would():
    """The same step with tid 0's tool calls of 30 s: tid 0 (its next turns predicted 100
    tokens each) holds the pool's one place while tid 1 becomes the predicted longest.
    Tail isolation (Heddle with the same pool) moves tid 1 in beside it; the pools keep it
    in the bulk, and no bulk trajectory ever decodes on the tail worker."""
    iso, _ = _run("heddle", pool_tool_s=30.0)
    assert 0 in _decode_workers(iso, 1, 1)
    res, specs = _run("heddle-tail-pools", pool_tool_s=30.0)
    assert all(0 not in _decode_workers(res, 1, turn) for turn in range(3))
    assert all(_decode_workers(res, tid, 0) <= {1, 2} for tid in range(2, 10))
    assert res.generated_tokens == sum(s.generated_tokens for s in specs)


def test_pool_rule_and_default():
    assert pool_rule([2, 4, 8], 32) == ([8, 8, 8, 4, 4], 192)
    assert pool_rule([8], 32) == ([8, 8, 8, 8], 0)  # no lower degree: one pool
    assert pool_rule([1, 2, 4, 8], 32, m=2, size=32) == ([8, 8, 4, 4, 4, 4], 64)
    assert not get_policy("heddle").tail_pools and get_policy("heddle-tail-pools").tail_pools
