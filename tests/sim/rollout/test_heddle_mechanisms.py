"""Heddle's mechanisms do what they are for: aggregate drain estimates equal the sorted
ones, DP placement on quantile cuts stays consistent, a freed worker steals queued
turns, progressive priority re-predicts after every turn and admits the longest
predicted first, the loaded preset queues, idle workers merge for the long tail."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.rollout import RolloutWorkload, rollout_preset
from harts.sim.rollout import (
    RolloutPolicy,
    RolloutPolicyName,
    Router,
    SegmentKind,
    TrajectorySpec,
    TurnSpec,
    generate_trajectories,
    get_policy,
    simulate_rollout,
)
from harts.sim.rollout.cost import make_rollout_cost
from harts.sim.rollout.engine import _Sim
from harts.sim.rollout.planning import (
    DecodePrice,
    aggregate_estimate,
    decode_fraction,
    dp_place,
    estimate_makespan,
    worker_estimate,
)

COST = make_rollout_cost(RolloutWorkload())
PRICE = DecodePrice(COST, 4, 256)


def _prices(degrees):
    return {d: DecodePrice(COST, d, 256) for d in set(degrees)}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 20000), st.floats(0, 60), st.floats(100, 60000)), min_size=1, max_size=40))
def test_aggregate_estimate_is_the_sorted_estimate(items):
    x, tl, c = (np.array(v) for v in zip(*items, strict=True))
    o = np.argsort(-x, kind="stable")
    want = worker_estimate(x[o], tl[o], c[o], PRICE)
    a = [float(decode_fraction(*item, PRICE)) for item in items]
    sac = sum(ai * ci for ai, ci in zip(a, c, strict=True))
    got = aggregate_estimate(float(x.sum()), sum(a), sac, (float(x[o[0]]), float(tl[o[0]]), float(c[o[0]])), PRICE)
    assert got == pytest.approx(want, rel=1e-9)


def test_dp_on_quantile_cuts_is_consistent_and_close_to_exact():
    rng = np.random.default_rng(0)
    x = np.exp(rng.normal(7, 1.2, 300))
    tools = rng.uniform(0, 20, 300)
    degrees = [8, 4, 4, 2, 2, 4, 8]
    ctx = 1000.0 + x / 2
    prices = _prices(degrees)
    exact_a, exact = dp_place(x, tools, ctx, degrees, prices)
    coarse_a, coarse = dp_place(x, tools, ctx, degrees, prices, max_cuts=50)
    for a, est in ((exact_a, exact), (coarse_a, coarse)):
        assert est == pytest.approx(estimate_makespan(a, x, tools, ctx, degrees, prices), rel=1e-9)
        # contiguous: every worker's trajectories form one run of the longest-first order
        order = list(np.argsort(-x, kind="stable"))
        seq = [a[i] for i in order]
        runs = [w for k, w in enumerate(seq) if k == 0 or seq[k - 1] != w]
        assert len(runs) == len(set(runs))
    assert exact <= coarse * (1 + 1e-3)  # coarser cuts can only lose
    cache: dict = {}
    again = dp_place(x, tools, ctx, degrees, prices, cache=cache)
    assert again == (exact_a, exact) and set(cache) == set(degrees)
    assert dp_place(x, tools, ctx, degrees, prices, cache=cache) == again  # reused grids give the same plan


def _forced_run(migration: bool):
    """Every trajectory planned on worker 0 of four, batch limit 2: only stealing spreads them."""
    cfg = rollout_preset("tiny", max_batch=2, num_prompts=4, seed=1)
    pol = RolloutPolicy(RolloutPolicyName.HEDDLE, Router.HOME, priority=True, migration=migration)
    sim = _Sim(cfg, pol, 16, generate_trajectories(cfg), make_rollout_cost(cfg))
    for t in sim.tr:
        sim.load_drop(t, sim.ws[t.assigned])
        t.assigned = 0
        sim.load_set(t)
    return cfg, sim.run()


def test_freed_workers_steal_queued_turns():
    cfg, stuck = _forced_run(migration=False)
    _, stolen = _forced_run(migration=True)
    assert {s.worker for tl in stuck.timelines for s in tl.segments if s.kind == SegmentKind.DECODE} == {0}
    decoders = {s.worker for tl in stolen.timelines for s in tl.segments if s.kind == SegmentKind.DECODE}
    assert len(decoders) > 1 and stolen.migrations > 0
    assert stolen.makespan_s < stuck.makespan_s
    assert sorted(t.tid for t in stolen.timelines) == list(range(cfg.num_trajectories))
    assert stolen.generated_tokens == stuck.generated_tokens
    for tl in stolen.timelines:  # a stolen turn runs where it was moved to
        for i, s in enumerate(tl.segments):
            if s.kind == SegmentKind.MIGRATE:
                nxt = [x for x in tl.segments[i + 1:] if x.kind in (SegmentKind.PREFILL, SegmentKind.DECODE)]
                assert nxt and nxt[0].worker == s.to_worker and nxt[0].start >= s.end - 1e-12


def test_priority_is_repredicted_every_turn_and_admits_longest_first():
    cfg = rollout_preset("tiny", seed=2)
    pol = RolloutPolicy(RolloutPolicyName.HEDDLE, Router.HOME, priority=True)
    sim = _Sim(cfg, pol, 8, generate_trajectories(cfg), make_rollout_cost(cfg))
    before = {t.spec.tid: t.pred for t in sim.tr}
    w = sim.ws[0]
    w.queue = [t.spec.tid for t in sim.tr]
    order = sim.admit_order(w)
    preds = [sim.tr[i].pred[0] for i in order]
    assert preds == sorted(preds, reverse=True)
    w.queue = []
    sim.run()
    multi = [t for t in sim.tr if len(t.spec.turns) > 1]
    assert multi and any(t.pred != before[t.spec.tid] for t in sim.tr if len(t.spec.turns) > 1)
    assert all(t.done for t in sim.tr)


def test_loaded_preset_only_adds_prompts():
    base, loaded = rollout_preset("agentic-longtail"), rollout_preset("agentic-longtail-loaded")
    assert loaded.num_trajectories == 4 * base.num_trajectories
    assert dataclasses.replace(loaded, num_prompts=base.num_prompts) == base


def test_predictor_respects_context_and_tool_budgets():
    from harts.sim.rollout.planning import predict_remaining
    from harts.sim.rollout.types import TrajectorySpec, TurnSpec

    a = TrajectorySpec(0, 0, tuple(TurnSpec(10, 100, 1.0) for _ in range(3)), hint_turns=40.0)
    assert predict_remaining(a, 0, 0, 500.0) == (20000.0, 40.0)
    assert predict_remaining(a, 0, 0, 500.0, budget_tokens=6000.0) == (6000.0, 40.0)  # context cap
    assert predict_remaining(a, 0, 0, 500.0, max_turns=8) == (4000.0, 8.0)  # tool-call budget
    assert predict_remaining(a, 7, 700, 500.0, max_turns=8) == (100.0, 1.0)  # never below one turn


def test_dp_balances_workers_below_the_bottleneck():
    # one long trajectory fixes the bottleneck; the many short ones must still be spread
    x = np.array([50_000.0] + [500.0] * 200)
    tools = np.array([100.0] + [5.0] * 200)
    degrees = [4, 4, 4, 4]
    ctx = np.full(len(x), 4000.0)
    prices = _prices(degrees)
    assign, est = dp_place(x, tools, ctx, degrees, prices)
    counts = sorted(np.bincount(np.asarray(assign[1:]), minlength=4).tolist())
    per = [estimate_makespan([0] * c, x[1:1 + c], tools[1:1 + c], ctx[1:1 + c], [4], prices) for c in counts if c]
    assert max(per) < est  # the short ones are not piled up to the bottleneck's estimate
    assert counts[-1] - counts[1] <= 0.5 * counts[-1]  # and spread over the other workers


def test_predictor_in_turn_and_group_shrinkage():
    from harts.sim.rollout.planning import predict_remaining
    from harts.sim.rollout.types import TrajectorySpec, TurnSpec

    a = TrajectorySpec(0, 0, tuple(TurnSpec(10, 100, 1.0) for _ in range(3)), hint_turns=3.0)
    # a running turn within its expected length: the rest of it, then the other turns
    assert predict_remaining(a, 0, 0, 500.0, elapsed=200) == (300.0 + 2 * 500.0, 3.0)
    # one that has outlived it runs as long again, and the later turns are at least as long
    assert predict_remaining(a, 0, 0, 500.0, elapsed=800) == (800.0 + 2 * 800.0, 3.0)
    assert predict_remaining(a, 0, 0, 500.0, budget_tokens=1000.0, elapsed=800) == (1000.0, 3.0)
    # shrinkage: one own turn of 100 tokens and a group mean of 500 weighted as one turn
    assert predict_remaining(a, 1, 100, 500.0, prior_weight=1.0) == (2 * 300.0, 2.0)
    assert predict_remaining(a, 1, 100, 500.0) == (2 * 100.0, 2.0)


def _forced_live(live: bool):
    """Every trajectory planned on worker 0 of four, no migration at tool calls nor
    stealing: only live migration moves running sequences away."""
    cfg = rollout_preset("small", seed=0)
    pol = RolloutPolicy(RolloutPolicyName.HEDDLE, Router.HOME, priority=True, live_migration=live)
    sim = _Sim(cfg, pol, 16, generate_trajectories(cfg), make_rollout_cost(cfg))
    for t in sim.tr:
        sim.load_drop(t, sim.ws[t.assigned])
        t.assigned = 0
        sim.load_set(t)
    return cfg, sim.run()


def test_live_migration_moves_running_sequences_and_resumes_without_prefill():
    cfg, stuck = _forced_live(False)
    _, moved = _forced_live(True)
    assert stuck.migrations == 0 and moved.migrations > 0
    assert moved.makespan_s < stuck.makespan_s
    assert moved.generated_tokens == stuck.generated_tokens
    assert moved.recomputed_tokens == 0  # a moved KV is never rebuilt
    live = 0
    for tl in moved.timelines:
        segs = tl.segments
        for i, s in enumerate(segs):
            if s.kind != SegmentKind.MIGRATE or segs[i - 1].kind != SegmentKind.DECODE:
                continue
            live += 1
            prev = segs[i - 1]
            assert prev.turn == s.turn and prev.tokens_after == s.tokens_before == s.tokens_after
            nxt = [x for x in segs[i + 1:] if x.kind in (SegmentKind.PREFILL, SegmentKind.DECODE)][0]
            # it resumes the same turn where it stopped, on the new worker, with no prefill
            assert nxt.kind == SegmentKind.DECODE and nxt.turn == s.turn
            assert nxt.tokens_before == s.tokens_after and nxt.worker == s.to_worker and nxt.start >= s.end - 1e-12
    assert live == moved.migrations


def test_group_predictor_learns_only_from_finished_turns():
    cfg = rollout_preset("small", seed=1, action_group_sigma=0.6)
    pol = RolloutPolicy(RolloutPolicyName.HEDDLE, Router.HOME, priority=True, placement=True, group_predictor=True)
    specs = generate_trajectories(cfg)
    sim = _Sim(cfg, pol, 16, specs, make_rollout_cost(cfg))
    assert sim.group_turns == [0] * cfg.num_prompts  # nothing is known before a turn ends
    first = {t.spec.tid: t.pred for t in sim.tr}
    assert len({p for p in first.values()}) <= len({s.hint_turns for s in specs})  # the hint and the prior only
    sim.run()
    for g in range(cfg.num_prompts):
        members = [s for s in specs if s.group == g]
        assert sim.group_turns[g] == sum(len(s.turns) for s in members)
        assert sim.group_tokens[g] == sum(s.generated_tokens for s in members)


def test_group_difficulty_is_shared_by_a_prompt_group():
    cfg = rollout_preset("small", action_sigma=0.0, action_traj_sigma=0.0, action_group_sigma=0.8,
                         turns_range=(1, 4), max_context=65536)
    specs = generate_trajectories(cfg)
    for g in range(cfg.num_prompts):
        firsts = {s.turns[0].action_tokens for s in specs if s.group == g}
        assert len(firsts) == 1  # one length per group when only the group's scale varies
    assert len({s.turns[0].action_tokens for s in specs}) > 1
    base = rollout_preset("small")
    assert generate_trajectories(dataclasses.replace(base, action_group_sigma=0.0)) == generate_trajectories(base)


def test_max_decode_rate_is_the_best_split():
    from harts.sim.rollout.compare import max_decode_rate

    cfg = rollout_preset("agentic-longtail")
    rate = max_decode_rate(cfg, COST, 16, 64)
    assert rate[0] == 0 and np.all(np.diff(rate) >= 0)
    assert rate[1] == pytest.approx(1.0 / min(COST.decode_step(1, 0.0, d) for d in (2, 4, 8)))
    two = max(2 / COST.decode_step(2, 0.0, 8), 1 / COST.decode_step(1, 0.0, 8) + 1 / COST.decode_step(1, 0.0, 8),
              1 / COST.decode_step(1, 0.0, 8) + 1 / COST.decode_step(1, 0.0, 4))
    assert rate[2] == pytest.approx(two)


def test_dynamic_mp_merges_idle_workers_for_the_long_tail():
    """Four MP2 workers of a dense model, one 20k-token trajectory and fifteen short ones:
    once the short ones are done their workers merge, and the long one moves to a
    higher degree and finishes sooner than on its MP2 worker."""
    cfg = rollout_preset("tiny", model="qwen3-8b", baseline_mp=2, mp_degrees=(2, 4, 8), max_context=65536)
    specs = (TrajectorySpec(0, 0, (TurnSpec(500, 20_000, 0.0),), hint_turns=1.0),
             *(TrajectorySpec(i, 0, (TurnSpec(500, 300, 1.0), TurnSpec(100, 300, 0.0)), hint_turns=2.0)
               for i in range(1, 16)))
    runs = {}
    for name in ("heddle", "heddle-no-dynamic-mp"):
        runs[name] = simulate_rollout(cfg, dataclasses.replace(get_policy(name), adaptive_mp=False), 8, specs=specs)
    dyn, static = runs["heddle"], runs["heddle-no-dynamic-mp"]
    assert static.merges == 0 and {w.degree for w in static.workers} == {2}
    assert dyn.merges >= 1 and dyn.initial_degrees == (2, 2, 2, 2)
    long_on = {dyn.workers[s.worker].degree for s in dyn.timelines[0].segments if s.kind == SegmentKind.DECODE}
    assert max(long_on) > 2
    assert dyn.makespan_s < 0.9 * static.makespan_s
    assert dyn.timelines[0].generated_tokens == 20_000


def _crowd(makespan_moves: frozenset[str], long_home: int):
    """Three MP2 workers of a dense model, every sequence put mid-turn by hand: a 60k-token
    trajectory (30k decoded) on worker `long_home`, 32 short ones with 8k-token prompts
    crowding worker 1, worker 2 empty."""
    cfg = rollout_preset("tiny", model="qwen3-8b", baseline_mp=2, mp_degrees=(2,), max_context=65536)
    specs = (TrajectorySpec(0, 0, (TurnSpec(500, 60_000, 0.0),), hint_turns=1.0),
             *(TrajectorySpec(i, 1, (TurnSpec(8_000, 4_000, 0.0),), hint_turns=1.0) for i in range(1, 33)))
    pol = RolloutPolicy(RolloutPolicyName.HEDDLE, Router.HOME, priority=True, migration=True, live_migration=True,
                        makespan_moves=makespan_moves)
    homes = [long_home] + [1] * 32
    cost = make_rollout_cost(cfg)
    sim = _Sim(cfg, pol, 6, specs, cost, plan=([2, 2, 2], homes))
    for t in sim.tr:
        done = 30_000 if t.spec.tid == 0 else 1_024
        t.generated = done
        t.context = t.spec.turns[0].input_tokens + done
        t.remaining = t.spec.turns[0].action_tokens - done
        t.home = t.assigned
        w = sim.ws[t.home]
        w.running.append(t.spec.tid)
        sim.set_kv(w, t.spec.tid, cost.kv_bytes(t.context), 0.0)
        sim.repredict(t)
    return sim


def test_makespan_moves_refuse_a_move_away_from_the_bottleneck():
    """Own-finish live migration moves a short sequence off the crowded worker (it decodes
    several times faster alone); decided on the step's predicted makespan it stays: the
    makespan is the long trajectory's worker's, which the move does not touch. The long
    trajectory itself, in the crowd, moves under both rules (the makespan drops)."""
    for makespan_moves, moves_short in ((frozenset(), True), (frozenset({"live"}), False)):
        sim = _crowd(makespan_moves, long_home=0)
        short = sim.tr[5]
        assert sim.longest_holder() == 0
        assert sim.maybe_move_running(short, sim.ws[1], 0.0) == moves_short
        if moves_short:
            assert short.assigned == 2 and short.migrating and short.resume
        else:
            assert short.assigned == 1 and not short.migrating
        sim = _crowd(makespan_moves, long_home=1)
        before = max(sim.estimate(w) for w in sim.ws)
        assert sim.maybe_move_running(sim.tr[0], sim.ws[1], 0.0)
        assert sim.tr[0].assigned in (0, 2)
        assert max(sim.estimate(w) for w in sim.ws) < before


def test_makespan_moves_keep_the_old_rule_available():
    assert not get_policy("heddle").makespan_moves and not get_policy("heddle").drain_merge
    assert get_policy("heddle-makespan-moves").makespan_moves == {"tool", "steal", "live"}
    assert get_policy("heddle-makespan-tool").makespan_moves == {"tool"}
    with pytest.raises(ValueError, match="unknown kinds"):
        dataclasses.replace(get_policy("heddle"), makespan_moves=frozenset({"teleport"}))
    assert get_policy("heddle-drain-merge").drain_merge
    assert get_policy("heddle-makespan-tool-steal").makespan_moves == {"tool", "steal"}
    both = get_policy("heddle-makespan-tool-drain")
    assert both.makespan_moves == {"tool"} and both.drain_merge


def _two_workers(drain: bool):
    cfg = rollout_preset("tiny", model="qwen3-8b", baseline_mp=2, mp_degrees=(2, 4), max_context=65536)
    specs = (TrajectorySpec(0, 0, (TurnSpec(500, 20_000, 0.0),), hint_turns=1.0),
             *(TrajectorySpec(i, 1, (TurnSpec(500, 300, 1.0), TurnSpec(100, 300, 0.0)), hint_turns=2.0)
               for i in range(1, 16)))
    pol = dataclasses.replace(get_policy("heddle-drain-merge" if drain else "heddle"), adaptive_mp=False)
    homes = [0] + [1] * 15
    return specs, _Sim(cfg, pol, 4, specs, make_rollout_cost(cfg), plan=([2, 2], homes)).run()


def test_drain_merge_merges_an_idle_worker_with_its_busy_buddy():
    """Two MP2 workers: the 20k-token trajectory alone on one, fifteen short ones on the
    other. Dynamic MP never merges (one of the two is never idle); with drain-and-merge
    the idle worker and the busy one become an MP4 worker once the short ones are done,
    and the long trajectory resumes its turn there, no token lost or redone, no prefill."""
    specs, static = _two_workers(False)
    _, merged = _two_workers(True)
    assert static.merges == 0
    assert merged.merges == 1 and merged.initial_degrees == (2, 2)
    assert merged.makespan_s < 0.8 * static.makespan_s
    assert merged.recomputed_tokens == 0 and merged.generated_tokens == static.generated_tokens
    segs = merged.timelines[0].segments
    mv = [i for i, s in enumerate(segs) if s.kind == SegmentKind.MIGRATE]
    assert len(mv) == 1
    s, prev, nxt = segs[mv[0]], segs[mv[0] - 1], segs[mv[0] + 1]
    assert merged.workers[s.to_worker].degree == 4 and merged.workers[s.to_worker].start_s == s.start
    assert prev.kind == nxt.kind == SegmentKind.DECODE and prev.turn == nxt.turn == 0
    assert prev.tokens_after == s.tokens_before == s.tokens_after == nxt.tokens_before
    assert nxt.worker == s.to_worker and nxt.start >= s.end - 1e-12
    assert merged.timelines[0].generated_tokens == 20_000


def _tool_case(makespan_moves: frozenset[str]):
    """Three MP2 workers of a dense model: a 60k-token trajectory 30k tokens in on worker 0,
    two short trajectories with 20k-token prompts on worker 1 between turns (one of them
    starting its tool call), worker 2 empty."""
    cfg = rollout_preset("tiny", model="qwen3-8b", baseline_mp=2, mp_degrees=(2,), max_context=65536)
    specs = (TrajectorySpec(0, 0, (TurnSpec(500, 60_000, 0.0),), hint_turns=1.0),
             *(TrajectorySpec(i, 1, (TurnSpec(20_000, 2_000, 1.0), TurnSpec(100, 2_000, 0.0)), hint_turns=2.0)
               for i in (1, 2)))
    pol = RolloutPolicy(RolloutPolicyName.HEDDLE, Router.HOME, priority=True, migration=True, live_migration=True,
                        makespan_moves=makespan_moves)  # (live: the running turn's decoded part is seen)
    cost = make_rollout_cost(cfg)
    sim = _Sim(cfg, pol, 6, specs, cost, plan=([2, 2, 2], [0, 1, 1]))
    for t in sim.tr:
        t.home = t.assigned
        if t.spec.tid == 0:
            t.generated, t.remaining = 30_000, 30_000
            sim.ws[0].running.append(0)
        else:
            t.generated, t.turn, t.turn_start_generated = 2_000, 1, 2_000
        t.context = t.spec.turns[0].input_tokens + t.generated
        sim.set_kv(sim.ws[t.home], t.spec.tid, cost.kv_bytes(t.context), 0.0)
        sim.repredict(t)
    return sim


def test_makespan_decided_tool_call_migration():
    """At a tool-call start the pair rule moves a short trajectory off its worker to the
    empty one (the pair's larger estimate halves); decided on the step's predicted
    makespan it stays: the long trajectory's worker sets the makespan either way."""
    for kinds, moves in ((frozenset(), True), (frozenset({"tool"}), False), (frozenset({"live"}), True)):
        sim = _tool_case(kinds)
        t = sim.tr[1]
        before = max(sim.estimate(w) for w in sim.ws)
        sim.maybe_migrate(t, 0.0)
        assert (t.assigned == 2 and t.migrating) == moves, kinds
        assert max(sim.estimate(w) for w in sim.ws) == pytest.approx(before)  # w0's, either way
