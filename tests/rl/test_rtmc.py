"""RTMC advantages: the zero-sum identity of a state's advantages (exactly which weighted
sum vanishes, with and without prior smoothing), the per-token layout, invariance to
argument formatting, GRPO as the mix = 0 limit, and errors naming trajectory and turn."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.rl.rtmc import (
    episode_advantages,
    grpo_advantages,
    rtmc_advantages,
    rtmc_table,
    with_advantages,
)
from harts.rl.signatures import states_and_actions, trajectory_signatures
from harts.tree.trajectory import Trajectory, Turn, TurnError
from tests.strategies import rtmc_groups

TOL = 1e-12


def _turn(start, end, tool="search", args="x", outcome="ok"):
    return {"start": start, "end": end, "tool": tool, "args": args, "outcome": outcome}


windows = st.sampled_from((None, 0, 1, 2))


@given(rtmc_groups(), windows)
def test_visit_weighted_advantages_of_a_state_sum_to_zero_without_smoothing(case, window):
    table = rtmc_table(case.trajectories, case.rewards, prior_strength=0.0, window=window)
    for state, steps in table.by_state().items():
        assert sum(s.visits for s in steps) == steps[0].state_visits
        total = sum(s.visits * s.advantage for s in steps)
        assert abs(total) <= TOL * steps[0].state_visits, (state, total)
        # unsmoothed V is the plain mean return of the rollouts through the state
        assert abs(steps[0].v - sum(s.visits * s.q for s in steps) / steps[0].state_visits) <= TOL


@given(rtmc_groups(), st.floats(0.01, 10.0), windows)
def test_with_smoothing_the_pseudo_visit_weighted_sum_is_zero(case, k, window):
    table = rtmc_table(case.trajectories, case.rewards, prior_strength=k, window=window)
    for steps in table.by_state().values():
        assert abs(sum((s.visits + k) * s.advantage for s in steps)) <= TOL * (steps[0].state_visits + k * len(steps))
        # the visit-weighted sum is then -k times the plain sum of the state's advantages
        visit_weighted = sum(s.visits * s.advantage for s in steps)
        assert abs(visit_weighted + k * sum(s.advantage for s in steps)) <= 1e-11
        if len(steps) == 1:  # one action: no contrast
            assert steps[0].advantage == 0.0


def test_smoothing_breaks_the_visit_weighted_sum_where_visits_differ():
    # root: action A taken by 3 rollouts (rewards 1, 1, 1), action B by 1 (reward 0)
    t = [Trajectory.make(f"r{i}", "g", [0, 1, 2], turns=[_turn(1, 2, args="A" if i < 3 else "B")]) for i in range(4)]
    r = [1.0, 1.0, 1.0, 0.0]
    plain = rtmc_table(t, r, prior_strength=0.0)
    smooth = rtmc_table(t, r, prior_strength=1.0)
    assert [s.advantage for s in plain.steps] == pytest.approx([0.25, -0.75], abs=TOL)
    b = 0.75
    qa, qb = (3 + b) / 4, (0 + b) / 2
    v = (4 * qa + 2 * qb) / 6
    assert [s.advantage for s in smooth.steps] == pytest.approx([qa - v, qb - v], abs=TOL)
    assert abs(sum(s.visits * s.advantage for s in smooth.steps)) > 0.1  # visits 3 vs 1: not zero
    assert sum(s.pseudo_visits * s.advantage for s in smooth.steps) == pytest.approx(0.0, abs=TOL)


@given(rtmc_groups(), st.floats(0.0, 4.0), st.floats(0.0, 1.0), windows)
def test_per_token_layout(case, k, mix, window):
    eps = 1e-6
    adv = rtmc_advantages(case.trajectories, case.rewards, prior_strength=k, mix=mix, eps=eps, window=window)
    table = rtmc_table(case.trajectories, case.rewards, prior_strength=k, window=window)
    r = np.asarray(case.rewards)
    scale = r.std() + eps
    for traj, a, ri in zip(case.trajectories, adv, r, strict=True):
        assert a.dtype == np.float64 and a.shape == (len(traj),)
        ep = (ri - r.mean()) / scale
        expected = np.full(len(traj), ep)
        for turn, (s, act) in zip(traj.turns, states_and_actions(trajectory_signatures(traj), window), strict=True):
            expected[turn.start:turn.end] = (1 - mix) * ep + mix * table.lookup(s, act).advantage / scale
        np.testing.assert_allclose(a, expected, rtol=0, atol=1e-12)


@given(rtmc_groups())
def test_mix_zero_is_grpo_and_grpo_is_the_episode_advantage(case):
    grpo = grpo_advantages(case.trajectories, case.rewards)
    ep = episode_advantages(case.rewards)
    for g, a, traj, e in zip(grpo, rtmc_advantages(case.trajectories, case.rewards, mix=0.0), case.trajectories, ep,
                             strict=True):
        assert g.shape == (len(traj),) and (g == e).all()
        np.testing.assert_array_equal(a, g)


@given(rtmc_groups(formatted=True), st.data())
def test_advantages_do_not_depend_on_argument_formatting(case, data):
    # the same group with every turn's fields in their normal form (formatting removed)
    plain = [dataclasses.replace(t, turns=tuple(Turn(u.start, u.end, sig.tool, sig.args, sig.outcome)
                                                for u, sig in zip(t.turns, trajectory_signatures(t), strict=True)))
             for t in case.trajectories]
    k = data.draw(st.floats(0.0, 3.0))
    for a, b in zip(rtmc_advantages(case.trajectories, case.rewards, prior_strength=k),
                    rtmc_advantages(plain, case.rewards, prior_strength=k), strict=True):
        np.testing.assert_array_equal(a, b)


def test_shared_steps_share_advantages_and_distinct_roots_match_grpo():
    # r0 and r1 share their first step; r2 differs at the root
    t = [
        Trajectory.make("r0", "g", list(range(8)), turns=[_turn(1, 3, args={"q": "a"}), _turn(4, 6, "answer", "1")]),
        Trajectory.make("r1", "g", list(range(9)), turns=[_turn(1, 3, args='{"q":"a"}'), _turn(4, 7, "answer", "2")]),
        Trajectory.make("r2", "g", list(range(6)), turns=[_turn(1, 3, args={"q": "b"})]),
    ]
    r = [1.0, 0.0, 0.5]
    a = rtmc_advantages(t, r, prior_strength=0.0, mix=1.0)
    assert a[0][1] == a[1][1]  # same state and action at the root
    # second steps: state (search a), actions answer 1 / 2 -> Q = 1 / 0, V = 0.5
    scale = np.std(r) + 1e-6
    assert a[0][4] == pytest.approx(0.5 / scale) and a[1][4] == pytest.approx(-0.5 / scale)
    # root: Q(a) = 0.5, Q(b) = 0.5, V = 0.5 -> zero step advantage
    assert a[0][1] == pytest.approx(0.0, abs=TOL) and a[2][1] == pytest.approx(0.0, abs=TOL)
    # tokens outside actions keep the episode advantage
    ep = episode_advantages(r)
    assert a[0][0] == ep[0] and a[2][5] == ep[2]
    # one rollout per first action, k = 0, mix = 1: the root step advantage is GRPO's
    solo = [Trajectory.make(f"s{i}", "g", [0, 1, 2], turns=[_turn(1, 2, args=str(i))]) for i in range(4)]
    rs = [0.0, 1.0, 0.25, 0.75]
    np.testing.assert_allclose([x[1] for x in rtmc_advantages(solo, rs, prior_strength=0.0, mix=1.0)],
                               episode_advantages(rs), atol=1e-12)


def test_first_visit_counts_a_revisited_state_once():
    # with a one-step window, r0 is in state (search x) twice, taking the same action both times
    t = [
        Trajectory.make("r0", "g", list(range(8)), turns=[_turn(1, 2), _turn(3, 4), _turn(5, 6)]),
        Trajectory.make("r1", "g", list(range(8)), turns=[_turn(1, 2), _turn(3, 4, "answer")]),
    ]
    table = rtmc_table(t, [1.0, 0.0], prior_strength=0.0, window=1)
    sigs = trajectory_signatures(t[0])
    again = table.lookup((sigs[0],), sigs[1])
    assert again.visits == 1 and again.q == 1.0  # r0's second visit is not counted
    other = table.lookup((sigs[0],), trajectory_signatures(t[1])[1])
    assert other.visits == 1 and again.state_visits == 2 and again.advantage == pytest.approx(0.5)
    adv = rtmc_advantages(t, [1.0, 0.0], prior_strength=0.0, mix=1.0, window=1)
    assert adv[0][3] == adv[0][5]  # both visits' tokens carry the (state, action)'s advantage
    with pytest.raises(ValueError, match="window"):
        rtmc_table(t, [1.0, 0.0], window=-1)


def test_unreadable_step_structure_is_an_error_not_grpo():
    good = Trajectory.make("ok-1", "g", [0, 1, 2], turns=[_turn(1, 2)])
    plain = Trajectory.make("plain-2", "g", [0, 1, 2])
    with pytest.raises(TurnError, match="trajectory 'plain-2'") as err:
        rtmc_advantages([good, plain], [1.0, 0.0])
    assert err.value.trajectory == "plain-2"
    past_end = dataclasses.replace(good, id="bad-3", turns=(Turn(1, 2, "a", "x", "ok"), Turn(2, 9, "a", "x", "ok")))
    with pytest.raises(TurnError, match=r"trajectory 'bad-3' turn 1 field 'end'") as err:
        rtmc_advantages([good, past_end], [1.0, 0.0])
    assert (err.value.turn, err.value.turn_field) == (1, "end")
    bad_args = dataclasses.replace(good, id="bad-4", turns=(Turn(1, 2, "a", {"x": float("inf")}, "ok"),))
    with pytest.raises(TurnError, match=r"trajectory 'bad-4' turn 0 field 'args'"):
        rtmc_advantages([bad_args], [1.0])
    # a rollout that took no action is readable: it keeps its episode advantage
    idle = Trajectory.make("idle", "g", [0, 1], turns=[])
    out = rtmc_advantages([good, idle], [1.0, 0.0])
    assert (out[1] == episode_advantages([1.0, 0.0])[1]).all()


def test_bad_groups_and_arguments():
    t = Trajectory.make("a", "g", [0, 1], turns=[_turn(1, 2)])
    u = Trajectory.make("b", "h", [0, 1], turns=[_turn(1, 2)])
    with pytest.raises(ValueError, match="several groups"):
        rtmc_advantages([t, u], [0.0, 1.0])
    with pytest.raises(ValueError, match="duplicate trajectory id 'a'"):
        rtmc_advantages([t, t], [0.0, 1.0])
    with pytest.raises(ValueError, match="1 rewards for 2"):
        rtmc_advantages([t, dataclasses.replace(t, id="c")], [0.0])
    with pytest.raises(ValueError, match="NaN"):
        rtmc_advantages([t], [float("nan")])
    with pytest.raises(ValueError, match="mix"):
        rtmc_advantages([t], [1.0], mix=1.5)
    with pytest.raises(ValueError, match="prior_strength"):
        rtmc_advantages([t], [1.0], prior_strength=-1.0)


@given(rtmc_groups())
def test_with_advantages_writes_the_rollout_format(case):
    adv = rtmc_advantages(case.trajectories, case.rewards)
    out = with_advantages(case.trajectories, adv)
    for t, o, a in zip(case.trajectories, out, adv, strict=True):
        assert (o.advantage == a).all() and o.turns == t.turns and (o.tokens == t.tokens).all()
    with pytest.raises(ValueError, match="shape"):
        with_advantages(case.trajectories[:1], [np.zeros(len(case.trajectories[0]) + 1)])
