"""Whole-step properties: for random steps, layouts and schedules the lowered program's
trace respects every dependency, is no shorter than the critical-path and busiest-lane
bounds, never holds negative memory, and is identical on identical inputs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.config.parallel import ParallelConfig
from harts.plan.schedule import build_schedule
from harts.plan.work import KDARound, MicrobatchWork, StepWork
from harts.sim.costs import make_cost_model
from harts.sim.engine import lower_bound
from harts.sim.hardware import load_hardware
from harts.sim.ops import Phase
from harts.sim.simulate import lower, simulate, simulate_step
from tests.strategies import sim_steps

SCHEDULES = ("non-overlap", "overlap-bwd-first", "consumer-1f1b")
HW = load_hardware("h200")
TINY = get_model_config("tiny")
EPS = 1e-9


@given(sim_steps(), st.integers(1, 3), st.sampled_from(SCHEDULES), st.booleans(), st.booleans(), st.booleans())
def test_step_properties(step, pp, schedule, ep, recompute, lockstep):
    par = ParallelConfig(dp=step.num_replicas, pp=pp, ep=step.num_replicas if ep else 1)
    cost = make_cost_model("roofline", TINY, par, HW, recompute=recompute)
    res = simulate_step(step, build_schedule(schedule, step, pp), cost, ep_lockstep=lockstep)
    if res.ep_lockstep:
        # gang members start together and last as long as the slowest
        by_gang: dict[str, list[int]] = {}
        for a in res.program.actions:
            if a.gang:
                by_gang.setdefault(a.gang, []).append(a.idx)
        for members in by_gang.values():
            assert len({res.trace.events[m].start for m in members}) == 1
    prog, tr = res.program, res.trace
    for a in prog.actions:
        for d in a.deps:
            assert tr.events[a.idx].start >= tr.events[d].end - EPS
    for order in prog.lane_order.values():
        for i, j in zip(order, order[1:], strict=False):
            assert tr.events[j].start >= tr.events[i].end - EPS
    assert res.step_seconds >= res.critical_path_seconds - EPS
    assert res.step_seconds >= res.busiest_lane_seconds - EPS
    for rank, low in tr.min_memory.items():
        assert low >= prog.static_memory[rank] - EPS > 0
        assert tr.memory_timeline[rank][-1][1] == pytest.approx(prog.static_memory[rank])
    assert 0.0 <= res.bubble_fraction < 1.0
    assert res.throughput == pytest.approx(step.expanded_tokens / res.step_seconds)
    again = simulate_step(step, build_schedule(schedule, step, pp), cost, ep_lockstep=lockstep)
    assert again.trace == tr


def test_single_microbatch_single_gpu_is_the_sum_of_its_actions():
    w = MicrobatchWork(mb=0, replica=0, tokens=4096, kda_rounds=(KDARound(4096, 64, 1),),
                       attn_pairs_causal=4096 * 4097 // 2, expanded_tokens=4096)
    step = StepWork((w,), 1, expanded_tokens=4096)
    par = ParallelConfig()
    cost = make_cost_model("roofline", TINY, par, HW)
    res = simulate(step, "consumer-1f1b", TINY, par, HW)
    want = cost.forward(0, [w]).seconds + cost.backward(0, [w]).seconds + cost.grad_sync(0) + cost.optimizer(0)
    assert res.step_seconds == pytest.approx(want, rel=1e-12)
    assert cost.grad_sync(0) == 0.0  # nothing to reduce on one GPU
    assert res.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    # peak: static + activations + the backward's working set (one layer, recomputed)
    peak = cost.static_bytes(0) + cost.activation_bytes(0, w) + cost.transient_bytes(0, [w], Phase.BWD)
    assert res.peak_memory_bytes == pytest.approx(peak)


def test_pipeline_of_equal_microbatches_matches_1f1b_formula():
    # P stages with identical stage times: 1F1B makespan = (M + P - 1) * (f + b) when
    # sends are free; here sends are tiny, so the pipeline bubble is (P - 1) / (M + P - 1)
    model = get_model_config("tiny").replace(num_layers=8, kda_per_mla=3, num_dense_layers=0,
                                               vocab_size=8, tie_embeddings=False)
    ws = tuple(MicrobatchWork(mb=i, replica=0, tokens=2048, kda_rounds=(KDARound(2048, 32),),
                              attn_pairs_causal=2048 * 2049 // 2, slot=i, order=i, expanded_tokens=2048)
               for i in range(6))
    step = StepWork(ws, 1, expanded_tokens=6 * 2048)
    par = ParallelConfig(pp=2)
    res = simulate(step, "consumer-1f1b", model, par, HW)
    cost = make_cost_model("roofline", model, par, HW)
    f = [cost.forward(s, [ws[0]]).seconds for s in range(2)]
    b = [cost.backward(s, [ws[0]]).seconds for s in range(2)]
    assert f[0] == pytest.approx(f[1], rel=0.05) and b[0] == pytest.approx(b[1], rel=0.05)
    compute = res.trace.busy("compute")
    passes = max(compute.values()) - cost.optimizer(0)
    ideal = passes + (f[0] + b[0] + f[1] + b[1]) / 2  # (M + P - 1) slots of f + b
    assert res.step_seconds == pytest.approx(ideal + cost.optimizer(0) + cost.grad_sync(0), rel=0.03)


def test_producer_memory_is_retained_until_its_backward():
    p = MicrobatchWork(mb=0, replica=0, tokens=8000, kda_rounds=(KDARound(8000, 125),),
                       attn_pairs_causal=8000 * 8001 // 2, slot=0, order=0)
    cs = tuple(MicrobatchWork(mb=i, replica=0, tokens=1000, kda_rounds=(KDARound(1000, 16),),
                              attn_pairs_causal=1000 * 9000, producer=0, slot=i - 1, order=i,
                              expanded_tokens=9000) for i in (1, 2, 3))
    step = StepWork((p,) + cs, 1, expanded_tokens=27000)
    par = ParallelConfig()
    res = simulate(step, "consumer-1f1b", TINY, par, HW)
    cost = make_cost_model("roofline", TINY, par, HW)
    # one stage: the producer's saved tensors wait in host memory, its stash stays
    held = cost.producer_held_bytes(0, p, 3)
    assert held == cost.stages[0].stash_bytes(p, 3) < cost.activation_bytes(0, p)
    ev = {e.name.split(":")[1]: e for e in res.trace.events}
    assert list(ev) [:8] == ["F0", "F1", "B1", "F2", "B2", "F3", "B3+B0", "grad-sync"]
    timeline = res.trace.memory_timeline[(0, 0)]
    static = cost.static_bytes(0)
    # when B1 has freed its rows and F2 has not started, only the producer is held
    after_b1 = [v for t, v in timeline if t == ev["B1"].end]
    assert after_b1[0] == pytest.approx(static + held)
    assert max(v for t, v in timeline if ev["F0"].end <= t <= ev["B3+B0"].start) >= static + held
    assert res.trace.memory_timeline[(0, 0)][-1][1] == pytest.approx(static)


def test_a_consumers_workspace_grows_with_the_context_it_reads():
    """Per context row, one attention layer's keys and values over [context | own] rows:
    1 copy in the forward, 2 with their gradient in the backward (where the blocks'
    workspace, not the LM head's, sets the transient)."""
    import dataclasses

    cost = make_cost_model("roofline", TINY, ParallelConfig(), HW)
    own = MicrobatchWork(mb=1, replica=0, tokens=60000, kda_rounds=(KDARound(60000, 938),),
                         attn_pairs_causal=60000 * 60001 // 2, producer=0, slot=0, order=1)
    reading = dataclasses.replace(own, context_rows=7000)
    m = TINY
    kv = m.mla_num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
    for phase, copies in ((Phase.FWD, 1), (Phase.BWD, 2)):
        grown = cost.transient_bytes(0, [reading], phase) - cost.transient_bytes(0, [own], phase)
        assert grown == pytest.approx(copies * 7000 * kv)


def test_a_pipeline_stages_producer_keeps_its_activations():
    p = MicrobatchWork(mb=0, replica=0, tokens=8000, kda_rounds=(KDARound(8000, 125),),
                       attn_pairs_causal=8000 * 8001 // 2, slot=0, order=0)
    cost = make_cost_model("roofline", TINY, ParallelConfig(pp=2), HW)
    assert cost.producer_held_bytes(0, p, 3) == cost.activation_bytes(0, p) + cost.producer_extra_bytes(0, p)


def test_lower_checks_layout():
    w = MicrobatchWork(mb=0, replica=0, tokens=10, kda_rounds=(), attn_pairs_causal=55, expanded_tokens=10)
    step = StepWork((w,), 1, expanded_tokens=10)
    cost = make_cost_model("roofline", TINY, ParallelConfig(pp=2), HW)
    with pytest.raises(ValueError, match="stages"):
        lower(step, build_schedule("non-overlap", step, 1), cost)
    cp, lane = lower_bound(lower(step, build_schedule("non-overlap", step, 2), cost))
    assert cp > 0 and lane > 0


def test_a_long_chains_outer_stashes_in_host_memory_lower_its_peak_not_its_rows(monkeypatch):
    """One trajectory of 20 budgets: under the executor's rule for outer stashes
    (`harts.plan.step.outer_stashes_on_host`) the farther producers' keys and values are
    not charged on the device, and the readers below them pay the copies in."""
    import dataclasses

    from harts.config import env

    monkeypatch.delenv(env.CHAIN_STASH_BUDGETS, raising=False)  # the rule at its default

    import numpy as np

    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.plan.step import outer_stashes_on_host, step_from_plan
    from harts.tree import build_forest
    from harts.tree.trajectory import Trajectory

    budget, chunk = 2048, TINY.chunk_size
    tokens = np.random.default_rng(0).integers(1, 100, 20 * budget)
    mask = np.ones(tokens.size, bool)
    mask[0] = False
    forest = build_forest([Trajectory.make("t", "t", tokens, loss_mask=mask, advantage=1.0)])
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=chunk))
    step = step_from_plan(plan, forest, chunk)
    moved, host_rows = outer_stashes_on_host(plan)
    assert moved and {w.mb for w in step.microbatches if w.stash_on_host} == moved
    assert {w.mb: w.host_context_rows for w in step.microbatches if w.host_context_rows} == host_rows
    # a reader reads from host memory at most the rows above its four budgets on the device
    for w in step.microbatches:
        assert w.host_context_rows <= max(0, w.context_rows - 4 * budget + plan.microbatch_tokens)
    kept = StepWork(tuple(dataclasses.replace(w, stash_on_host=False, host_context_rows=0)
                          for w in step.microbatches), 1, expanded_tokens=step.expanded_tokens)
    par = ParallelConfig()
    cost = make_cost_model("executor", TINY, par, HW)
    p = next(w for w in step.microbatches if w.stash_on_host)
    assert cost.stages[0].stash_bytes(p, 1) < cost.stages[0].stash_bytes(dataclasses.replace(p, stash_on_host=False), 1)
    on_host = simulate(step, "consumer-1f1b", TINY, par, HW, cost_model="executor")
    on_device = simulate(kept, "consumer-1f1b", TINY, par, HW, cost_model="executor")
    assert on_host.peak_memory_bytes < on_device.peak_memory_bytes
    assert on_host.step_seconds >= on_device.step_seconds


def test_the_chain_memory_benchmark_compares_the_rules(tmp_path, monkeypatch):
    """benchmarks/sim_chain_memory.py: each plan simulated under the outer stashes' rule at
    its default, off, moving every outer stash and at `--rules`, written with provenance;
    moving more never raises the peak."""
    import json

    from benchmarks import sim_chain_memory
    from harts.config import env

    monkeypatch.delenv(env.CHAIN_STASH_BUDGETS, raising=False)  # the rule at its default

    out = tmp_path / "mem.json"
    assert sim_chain_memory.main(["--budgets", "4096", "--lengths", "8", "--shapes", "single,forks",
                                  "--rules", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert list(got)[:2] == ["annotation", "provenance"] and got["default_device_budgets"] == 4.0
    for row in got["rows"]:
        peaks = [row[k]["peak_bytes"] for k in ("off", "default", "1", "all")]
        assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
        assert row["off"]["moved_producers"] == 0 < row["all"]["moved_producers"]
    assert sim_chain_memory.main(["--families", "long-agent", "--seeds", "12", "--budgets", "16384",
                                  "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["instance"] == "long-agent/12@16384" and row["all"]["peak_over_expanded"] < row["off"]["peak_over_expanded"]


def test_the_chain_retention_benchmark_prices_both_charges(tmp_path):
    """benchmarks/sim_chain_retention.py: each instance's floored window plan and expanded
    plan simulated with the producer charge alone and with a chain charge, written with
    provenance; the 64k chain at 16k takes a piece fewer under the charge, no slower."""
    import json

    from benchmarks import sim_chain_retention

    out = tmp_path / "cr.json"
    assert sim_chain_retention.main(["--families", "long-agent", "--seeds", "12", "--budgets", "16384",
                                     "--chains", "chain64k@16384", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert list(got)[:2] == ["annotation", "provenance"] and got["retentions"] == [None, 0.076]
    agent, chain = got["rows"]
    assert agent["instance"] == "long-agent/12@16384" and "ordinary_peak_bytes" not in agent
    by = chain["by_retention"]
    assert (by["None"]["windows"]["microbatches"], by["0.076"]["windows"]["microbatches"]) == (6, 5)
    assert by["0.076"]["over_unsplit"] < by["None"]["over_unsplit"]
    assert by["0.076"]["peak_over_ordinary"] > 0 and by["0.076"]["peak_over_expanded"] > 0
