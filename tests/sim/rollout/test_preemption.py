"""Paged KV with preemption, the verl-style balancer and the known-lengths reference:
KV never over capacity, a preempted turn resumes where it stopped, its rebuilt context
is counted and priced, swaps are priced, references never claim to be policies."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from harts.config.rollout import rollout_preset
from harts.sim.rollout import (
    SegmentKind,
    TrajectorySpec,
    TurnSpec,
    generate_trajectories,
    get_policy,
    known_policies,
    simulate_rollout,
)
from harts.sim.rollout.compare import known_lengths_schedule
from harts.sim.rollout.cost import make_rollout_cost
from harts.sim.rollout.workload import twin_trajectories
from tests.strategies import rollout_workloads

# qwen3-8b on one MP1 worker at hbm_utilization 0.1189: weights 16.4 GB, ~10.5k tokens of
# KV (144 KiB each): two 7k-token sequences cannot both finish
_TIGHT = rollout_preset("tiny", model="qwen3-8b", hbm_utilization=0.1189, mp_degrees=(1,), baseline_mp=1,
                        max_context=8192, max_batch=8)


def _two_long() -> tuple[TrajectorySpec, ...]:
    return (TrajectorySpec(0, 0, (TurnSpec(500, 6500, 0.0),), hint_turns=1.0),
            TrajectorySpec(1, 0, (TurnSpec(600, 6400, 0.0),), hint_turns=1.0))


def _resumes(res, specs) -> int:
    """Checks every turn is decoded once, continuing from where a preemption stopped it;
    returns how many resumptions after a recomputing prefill it saw."""
    seen = 0
    for tl in res.timelines:
        spec = specs[tl.tid]
        decoded = [0] * len(spec.turns)
        last = None
        for s in tl.segments:
            if s.kind == SegmentKind.DECODE:
                if last is not None and last.turn == s.turn:
                    assert s.tokens_before == last.tokens_after  # no token lost or decoded twice
                decoded[s.turn] += s.tokens_after - s.tokens_before
                last = s
            elif s.kind == SegmentKind.PREFILL and s.recomputed and last is not None and last.turn == s.turn:
                seen += 1
        assert decoded == [t.action_tokens for t in spec.turns]
    return seen


@pytest.mark.parametrize("how", ["recompute", "swap"])
def test_preempted_turn_resumes_and_its_rebuild_is_counted_and_priced(how):
    cfg = dataclasses.replace(_TIGHT, preemption=how)
    specs, cost = _two_long(), make_rollout_cost(_TIGHT)
    assert cost.kv_bytes(13000) > cost.kv_capacity(1) > cost.kv_bytes(8192)
    res = simulate_rollout(cfg, "cache-aware", 1, specs=specs, cost=cost)
    assert res.preemptions >= 1
    assert res.generated_tokens == 12900
    w = res.workers[0]
    assert all(used <= w.kv_capacity_bytes * (1 + 1e-9) for _, used in res.kv_samples[0])
    victim = next(tl for tl in res.timelines if any(s.kind == SegmentKind.QUEUE and s.turn == 0 and s.start > 0
                                                    for s in tl.segments))
    q = next(s for s in victim.segments if s.kind == SegmentKind.QUEUE and s.start > 0)
    before = q.tokens_before  # decoded when it was preempted
    context = specs[victim.tid].turns[0].input_tokens + before
    assert res.preemptions == 1
    if how == "recompute":
        assert _resumes(res, specs) == 1
        # its whole context so far (prompt + the turn's tokens before it stopped) is
        # prefilled again: counted, and priced as a prefill of that many tokens
        assert res.recomputed_tokens == context
        pre = next(s for s in victim.segments if s.kind == SegmentKind.PREFILL and s.recomputed)
        assert pre.end - pre.start == pytest.approx(cost.prefill(context, context * (context + 1) / 2, 1), rel=1e-9)
        assert res.prefill_tokens == 1100 + res.recomputed_tokens
    else:
        assert res.recomputed_tokens == 0 and res.prefill_tokens == 1100
        assert res.swapped_bytes == pytest.approx(cost.kv_bytes(context))
        _resumes(res, specs)
        # the copy out stalls the worker before its next iteration, the copy back before the
        # victim's next one: each takes the KV's bytes over the host link
        copy = cost.swap(res.swapped_bytes)
        back = [s for s in victim.segments if s.kind == SegmentKind.DECODE][-1]
        assert back.start - q.end == pytest.approx(copy, rel=1e-6)
        other = next(tl for tl in res.timelines if tl is not victim)
        gaps = [b.start - a.end for a, b in zip(other.segments, other.segments[1:], strict=False)
                if a.kind == b.kind == SegmentKind.DECODE]
        assert any(g == pytest.approx(copy, rel=1e-6) for g in gaps)


def test_reserve_never_preempts_and_paged_admits_more():
    cfg = rollout_preset("agentic-reasoning-dense", num_prompts=4, rollouts_per_prompt=8, hbm_utilization=0.6)
    paged = simulate_rollout(dataclasses.replace(cfg, baseline_mp=1), "cache-aware", 4)
    reserve = simulate_rollout(dataclasses.replace(cfg, baseline_mp=1, kv_alloc="reserve"), "cache-aware", 4)
    assert reserve.preemptions == 0
    assert paged.generated_tokens == reserve.generated_tokens


FAST = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(rollout_workloads(max_trajectories=8))
def test_paged_policies_conserve_and_fit(cfg):
    specs = generate_trajectories(cfg)
    for name in ("verl", "cache-aware", "heddle", "heddle-no-isolation"):
        res = simulate_rollout(cfg, name, 8, specs=specs)
        assert sorted(t.tid for t in res.timelines) == [s.tid for s in specs]
        _resumes(res, specs)
        for w, samples in zip(res.workers, res.kv_samples, strict=True):
            assert all(used <= w.kv_capacity_bytes * (1 + 1e-9) for _, used in samples)
            if samples:
                assert samples[-1][1] == pytest.approx(0.0, abs=1.0)
        if cfg.preemption == "recompute":
            assert res.swapped_bytes == 0


def test_references_are_not_policies_and_twin_reads_no_lengths():
    assert "oracle-pools" not in known_policies() and "oracle-pools" in known_policies(reference=True)
    assert get_policy("oracle-pools").reference and not get_policy("heddle").reference
    cfg = rollout_preset("tiny", seed=3)
    specs = generate_trajectories(cfg)
    # the twin depends on hints and prompts only: other lengths give the same twin
    other = tuple(dataclasses.replace(s, turns=(dataclasses.replace(s.turns[0], action_tokens=7),) + s.turns[1:])
                  for s in specs)
    assert twin_trajectories(cfg, specs) == twin_trajectories(cfg, other)
    res, info = known_lengths_schedule(cfg, specs, make_rollout_cost(cfg), 8)
    assert res.generated_tokens == sum(s.generated_tokens for s in specs) and "layout" in info
