"""Heddle's posterior length predictor (`harts.sim.rollout.posterior`) and the
`heddle-count-homes` options: the predictor's estimates against hand-computed cases, what
it may read, and runs under it that lose nothing."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.config.rollout import rollout_preset
from harts.sim.rollout import TrajectorySpec, TurnSpec, get_policy, simulate_rollout
from harts.sim.rollout.cost import make_rollout_cost
from harts.sim.rollout.engine import _Sim
from harts.sim.rollout.posterior import (
    PosteriorPredictor,
    truncated_log_mean,
    truncated_mean,
    turn_posteriors,
)
from tests.sim.rollout.test_engine import FAST, _check_conservation, _check_gpus, _check_kv
from tests.strategies import rollout_workloads

CFG = rollout_preset("agentic-reasoning")


def _specs(hints, groups, turns=3, action=1000):
    return tuple(TrajectorySpec(i, g, tuple(TurnSpec(100, action, 1.0) for _ in range(turns)), hint_turns=h)
                 for i, (h, g) in enumerate(zip(hints, groups, strict=True)))


def test_truncated_means_against_sampling():
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 0.7, 2_000_000)
    for cut in (0.0, 1.0, 2.5):
        tail = x[x > cut]
        assert truncated_log_mean(1.0, 0.7, cut) == pytest.approx(tail.mean(), rel=2e-3)
        assert truncated_mean(1.0, 0.7, cut) == pytest.approx(np.exp(tail).mean(), rel=5e-3)
    # far in the tail (where the sampled tail is empty) it stays above the cut and finite
    assert 12.0 < truncated_log_mean(1.0, 0.7, 12.0) < 12.1


def test_turn_posterior_follows_the_hint_and_conditions_on_turns_done():
    post = turn_posteriors(CFG, np.array([1.0, 3.0, 10.0, 30.0]))
    assert post.shape == (4, CFG.turns_range[1]) and np.allclose(post.sum(axis=1), 1.0)
    T = np.arange(1, CFG.turns_range[1] + 1)
    mean = post @ T
    assert list(np.argsort(mean)) == [0, 1, 2, 3]
    # shrunk towards the prior (median 3 turns): a hint of 30 is believed less than 30
    assert 10.0 < mean[3] < 30.0
    p = PosteriorPredictor(CFG, _specs([3.0], [0]))
    _, turns0 = p.remaining(0, 0, 0, math.inf, (0.0, CFG.action_group_sigma ** 2))
    _, turns5 = p.remaining(0, 5, 0, math.inf, (0.0, CFG.action_group_sigma ** 2))
    assert turns0 == pytest.approx(post[1] @ T)
    # after five turns done the trajectory has at least six: more turns in all than expected at
    # the start, and at least one left
    assert turns5 >= 1.0 and 5 + turns5 > turns0


def test_running_group_members_raise_the_group_scale_before_any_turn_ends():
    """A prompt whose samples all still run their first turns at 5,000 tokens (the median
    turn is 1,200) is estimated as long; finished short turns pull it down; the group
    posterior's variance shrinks with members observed."""
    specs = _specs([3.0] * 16, [0] * 16)
    p = PosteriorPredictor(CFG, specs)
    members = list(range(16))
    none = p.group_scale(members, {})
    assert none == (0.0, pytest.approx(CFG.action_group_sigma ** 2))
    running = p.group_scale(members, dict.fromkeys(members, 5000))
    assert running[0] > math.log(5000 / CFG.action_median) * 0.5 and running[1] < none[1]
    for j in members:
        p.observe(j, 300)
    short = p.group_scale(members, {})
    assert short[0] < 0.0
    # and the trajectory's own prediction follows its group
    g0 = (0.0, CFG.action_group_sigma ** 2)
    assert p.remaining(0, 1, 0, math.inf, short)[0] < p.remaining(0, 1, 0, math.inf, g0)[0]


def test_remaining_respects_the_context_cap_and_grows_with_a_running_turn():
    p = PosteriorPredictor(CFG, _specs([5.0], [0]))
    g = (0.0, CFG.action_group_sigma ** 2)
    x0, _ = p.remaining(0, 0, 0, math.inf, g)
    x1, _ = p.remaining(0, 0, 8000, math.inf, g)
    assert x1 > x0  # a turn already 8,000 tokens long predicts a longer trajectory
    assert p.remaining(0, 0, 8000, 3000.0, g)[0] == 3000.0
    assert p.remaining(0, 0, 0, 0.0, g)[0] == 1.0


def test_the_predictor_reads_no_true_length():
    """Two steps with the same hints and groups but other true turns: the same start-of-step
    predictions under Heddle with the posterior predictor (and none without it)."""
    cfg = rollout_preset("tiny", model="qwen3-8b", baseline_mp=2, mp_degrees=(2, 4), action_group_sigma=0.6)
    cost = make_rollout_cost(cfg)
    pol = get_policy("heddle-posterior")
    a = _Sim(cfg, pol, 8, _specs([2.0, 4.0, 1.0], [0, 0, 1], turns=3, action=50), cost)
    b = _Sim(cfg, pol, 8, _specs([2.0, 4.0, 1.0], [0, 0, 1], turns=1, action=400), cost)
    assert a.post is not None and [t.pred for t in a.tr] == [t.pred for t in b.tr]
    assert _Sim(cfg, get_policy("heddle"), 8, _specs([2.0], [0]), cost).post is None


def test_count_homes_options():
    p = get_policy("heddle-count-homes")
    assert p.makespan_moves == frozenset({"tool"}) and not p.placement and not p.preempt and p.priority
    assert not p.posterior and get_policy("heddle-count-homes-posterior").posterior
    assert not get_policy("heddle").posterior


@FAST
@given(rollout_workloads(), st.sampled_from((0.0, 0.6)),
       st.sampled_from(("heddle-posterior", "heddle-count-homes", "heddle-count-homes-posterior")))
def test_posterior_and_count_homes_lose_nothing_and_fit(cfg, group_sigma, name):
    """Under the posterior predictor (with and without a shared prompt scale) and with homes
    by count: nothing lost or run twice, each turn decoded once, KV under capacity, workers
    on their GPUs."""
    cfg = dataclasses.replace(cfg, action_group_sigma=group_sigma)
    res = simulate_rollout(cfg, name, 8)
    _check_conservation(cfg, res)
    _check_kv(res)
    _check_gpus(res, 8)
