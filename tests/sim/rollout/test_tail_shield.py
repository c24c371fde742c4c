"""Heddle's tail shield (`harts.sim.rollout.tail`): a worker holding one of the
predicted-longest trajectories caps its batch for short work while other workers have room."""

from __future__ import annotations

import dataclasses

from harts.config.rollout import rollout_preset
from harts.sim.rollout import TrajectorySpec, TurnSpec, get_policy, simulate_rollout
from harts.sim.rollout.cost import make_rollout_cost
from harts.sim.rollout.engine import _Sim
from harts.sim.rollout.tail import SHIELD_BATCH, SHIELD_K

CFG = rollout_preset("tiny", model="qwen3-8b", baseline_mp=2, mp_degrees=(2,), max_context=65536)
LONG, SHORT = SHIELD_K, 40  # trajectories predicted long (8 turns) and short (1 turn)


def _specs():
    long_ = [TrajectorySpec(i, 0, tuple(TurnSpec(200, 400, 0.5) for _ in range(8)), hint_turns=8.0)
             for i in range(LONG)]
    short = [TrajectorySpec(i, 1, (TurnSpec(200, 100, 0.0),), hint_turns=1.0) for i in range(LONG, LONG + SHORT)]
    return tuple(long_ + short)


def _queued_on_worker0(policy: str, long_on: int = 0):
    """Two MP2 workers; every short trajectory and (on worker `long_on`) the long ones
    queued on worker 0 at time 0, except that with `long_on` = 1 one long trajectory is
    planned on worker 1. Returns the simulator after worker 0 starts its first chunk."""
    specs = _specs()
    homes = [long_on if i == 0 else 0 for i in range(len(specs))]
    pol = dataclasses.replace(get_policy(policy), adaptive_mp=False)
    sim = _Sim(CFG, pol, 4, specs, make_rollout_cost(CFG), plan=([2, 2], homes))
    w0 = sim.ws[0]
    for t in sim.tr:
        if t.assigned == 0:
            t.queued_on = 0
            w0.queue.append(t.spec.tid)
    sim.start_chunk(w0, 0.0)
    return sim


def test_shield_caps_a_protected_workers_batch_for_short_work():
    """Eight trajectories predicted 8x longer than forty others, all on worker 0, worker 1
    empty: with the shield worker 0 admits the long ones first and short ones only up to
    `SHIELD_BATCH`; the rest wait in its queue. Without it all 48 decode together."""
    plain = _queued_on_worker0("heddle")
    assert len(plain.ws[0].running) == LONG + SHORT
    sim = _queued_on_worker0("heddle-tail-shield")
    assert sim.batch_cap(sim.ws[0], 0.0) == SHIELD_BATCH
    running = sim.ws[0].running
    assert len(running) == SHIELD_BATCH
    assert set(range(LONG)) <= set(running)
    assert all(sim.short_work(sim.tr[i]) for i in sim.ws[0].queue)
    assert len(sim.ws[0].queue) == LONG + SHORT - SHIELD_BATCH


def test_shield_does_not_act_without_room_elsewhere_or_short_work():
    """The shield leaves the batch alone where turning work away would only idle it: when
    every other worker holds a protected trajectory too (no free slots outside the
    protected workers), and when no waiting sequence is short next to the protected ones
    (all trajectories predicted alike)."""
    sim = _queued_on_worker0("heddle-tail-shield", long_on=1)
    assert sim.holds_protected(sim.ws[1])
    assert len(sim.ws[0].running) == LONG + SHORT - 1  # every sequence on worker 0 admitted
    alike = tuple(dataclasses.replace(s, hint_turns=1.0) for s in _specs())
    pol = dataclasses.replace(get_policy("heddle-tail-shield"), adaptive_mp=False)
    sim = _Sim(CFG, pol, 4, alike, make_rollout_cost(CFG), plan=([2, 2], [0] * len(alike)))
    sim.ws[0].queue.extend(range(len(alike)))
    for t in sim.tr:
        t.queued_on = 0
    sim.start_chunk(sim.ws[0], 0.0)
    assert len(sim.ws[0].running) == len(alike)


def test_shielded_run_decodes_everything_once():
    """End to end on the first case (short work turned away waits in the queue and is
    admitted as the batch drains): every token decoded, none recomputed, and the short
    trajectories wait longer than without the shield."""
    specs = _specs()
    homes = [0] * len(specs)
    runs = {}
    for name in ("heddle", "heddle-tail-shield"):
        pol = dataclasses.replace(get_policy(name), adaptive_mp=False)
        runs[name] = simulate_rollout(CFG, pol, 4, specs=specs, plan=([2, 2], homes))
    plain, shield = runs["heddle"], runs["heddle-tail-shield"]
    assert shield.generated_tokens == plain.generated_tokens == sum(s.generated_tokens for s in specs)
    assert shield.recomputed_tokens == 0
    assert max(t.finish_s for t in shield.timelines[LONG:]) > max(t.finish_s for t in plain.timelines[LONG:])


def test_shield_is_off_in_heddle():
    assert not get_policy("heddle").tail_shield and get_policy("heddle-tail-shield").tail_shield
