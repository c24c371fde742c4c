"""The executor cost model (harts/sim/executor.py): its profiles, its structure, its fits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.config.parallel import ParallelConfig
from harts.plan.schedule import build_schedule
from harts.sim.costs import CostModel
from harts.sim.executor import (
    CATEGORIES,
    ExecutorCostModel,
    action_seconds,
    executor_passes,
    microbatch_features,
    step_seconds_1gpu,
)
from harts.sim.executor_rates import BASE_EXECUTOR, RATE_NAMES, SOURCES
from harts.sim.fit_executor import case_of, fit_launches, fit_rates, predict, step_of
from harts.sim.hardware import HARDWARE_DIR, load_hardware, profile_from_dict
from harts.sim.ops import Phase
from harts.sim.simulate import simulate_step
from harts.tree import build_forest, shapes
from tests.strategies import executor_rates
from tests.strategies import microbatch_features as features_strategy

MODEL = get_model_config("tiny-h200")
ONE = ParallelConfig(dp=1, pp=1, ep=1)


def _forest(family="grpo", budget=4096):
    return build_forest(shapes.draw(family, 0, budget, vocab_size=32768))


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_shipped_profiles_label_every_executor_rate(name):
    data = json.loads((HARDWARE_DIR / f"{name}.json").read_text())
    hw = load_hardware(name)
    assert hw.executor is not None
    for rate in RATE_NAMES:
        entry = data["executor"][rate]
        assert entry["source"] in SOURCES
        assert entry["value"] == pytest.approx(getattr(hw.executor, rate))
        if entry["source"] != "assumption":  # measured or fitted: it names where from
            assert "benchmarks/results/" in entry["what"] or "harts/" in entry["what"], rate
    # the GPU-specific terms are this GPU's fit
    for rate in ("host_s_per_launch", "device_scale"):
        assert data["executor"][rate]["source"] == "fitted"


def test_an_unlabelled_rate_is_refused():
    data = json.loads((HARDWARE_DIR / "h100.json").read_text())
    data["executor"]["device_scale"] = 1.2
    with pytest.raises(ValueError, match="device_scale"):
        profile_from_dict(data)
    data["executor"]["device_scale"] = {"value": 1.2, "source": "guessed"}
    with pytest.raises(ValueError, match="source"):
        profile_from_dict(data)


def test_a_profile_without_executor_rates_cannot_price_the_executor():
    with pytest.raises(ValueError, match="no executor rates"):
        ExecutorCostModel(MODEL, ONE, load_hardware("h200-harts"))


@pytest.mark.parametrize(("family", "seed", "budget"), [("grpo", 0, 4096), ("long-agent", 1, 16384),
                                                        ("long-group", 2, 16384)])
@pytest.mark.parametrize("kind", ["tree", "windows", "expanded", "l1"])
def test_the_engine_and_the_closed_form_agree_on_one_gpu(kind, family, seed, budget):
    # the long families' window plans are chains: every forward of a chain runs before its
    # backwards, so the host's lead over device-bound backwards cannot cover host-bound
    # forwards (the closed form in per-microbatch order priced long-agent/1's windows at
    # 16k 10% under the engine)
    hw = load_hardware("h100")
    step = step_of(build_forest(shapes.draw(family, seed, budget, vocab_size=32768)), kind, budget,
                   MODEL.chunk_size)
    cost = ExecutorCostModel(MODEL, ONE, hw)
    res = simulate_step(step, build_schedule("consumer-1f1b", step, 1), cost)
    closed = step_seconds_1gpu(hw.executor, microbatch_features(cost, step),
                               cost.optimizer(0) - hw.executor.launches_per_step * hw.executor.host_s_per_launch
                               - hw.executor.step_fixed_s, executor_passes(step))
    assert res.step_seconds == pytest.approx(closed, rel=1e-9)
    assert predict(hw.executor, case_of("c", kind, step, MODEL, hw)) == pytest.approx(closed, rel=1e-12)
    assert res.cost_model == "executor"


@settings(max_examples=60, deadline=None)
@given(executor_rates(), features_strategy(), st.integers(2, 8))
def test_splitting_a_microbatch_never_makes_the_step_cheaper(rates, f, k):
    part = replace(f, fwd_s=f.fwd_s / k, bwd_s=f.bwd_s / k, rows=max(1, f.rows // k))
    assert step_seconds_1gpu(rates, [part] * k, 0.0) >= step_seconds_1gpu(rates, [f], 0.0) * (1 - 1e-12)


def test_host_bound_windows_cost_more_than_the_unsplit_tree_as_measured():
    # grpo/0@16384 on the H100: tree 0.80 s, windows 0.98 s, expanded 1.41 s (window suite)
    hw = load_hardware("h100")
    forest = _forest("grpo", 16384)
    t = {k: predict(hw.executor, case_of("g", k, step_of(forest, k, 16384, MODEL.chunk_size), MODEL, hw))
         for k in ("tree", "windows", "expanded")}
    assert t["tree"] < t["windows"] < t["expanded"]


def test_the_l1_step_has_no_consumers_and_recomputes_shared_rows():
    # l1: the windowless split l1l2 with floors runs where a window plan would not pay
    forest = _forest("bushy", 4096)
    l1, win = (step_of(forest, k, 4096, MODEL.chunk_size) for k in ("l1", "windows"))
    hw = load_hardware("h100")
    f1, fw = (case_of("b", k, s, MODEL, hw).features for k, s in (("l1", l1), ("windows", win)))
    assert not any(f.consumer or f.producer for f in f1)
    assert any(f.consumer for f in fw)
    assert sum(f.rows for f in f1) >= sum(f.rows for f in fw) == forest.compact_tokens


def test_more_host_time_per_launch_never_lowers_a_step():
    hw = load_hardware("h100")
    case = case_of("g", "windows", step_of(_forest(), "windows", 4096, MODEL.chunk_size), MODEL, hw)
    r = hw.executor
    assert predict(r.with_values(host_s_per_launch=2 * r.host_s_per_launch), case) > predict(r, case)


@pytest.mark.parametrize("scale", [0.5, 1.7, 4.0])
def test_the_host_rate_a_measured_step_implies(scale):
    """`host_rate_to_match` prices the step at the measurement; none where the device side
    alone prices above it or the host would be more than 10x slower."""
    from harts.sim.fit_executor import host_rate_to_match

    hw = load_hardware("h100")
    r = hw.executor
    case = case_of("g", "windows", step_of(_forest(), "windows", 4096, MODEL.chunk_size), MODEL, hw)
    measured = predict(r.with_values(host_s_per_launch=scale * r.host_s_per_launch), case)
    h = host_rate_to_match(r, case, measured)
    assert h is not None and predict(r.with_values(host_s_per_launch=h), case) == pytest.approx(measured, rel=1e-9)
    assert host_rate_to_match(r, case, 0.5 * predict(r.with_values(host_s_per_launch=0.0), case)) is None
    assert host_rate_to_match(r, case, 2 * predict(r.with_values(host_s_per_launch=10 * r.host_s_per_launch),
                                                   case)) is None


def test_fits_recover_the_rates_that_made_the_data():
    hw = load_hardware("h100")
    truth_rates = hw.executor.with_values(device_scale=1.7, host_s_per_launch=3.1e-5, launches_per_consumer=700.0,
                                          launches_per_sequence=40.0)
    cases = []
    for family in ("grpo", "long-chain", "bushy", "fanout"):
        forest = _forest(family, 4096)
        for kind in ("tree", "windows", "expanded"):
            c = case_of(family, kind, step_of(forest, kind, 4096, MODEL.chunk_size), MODEL, hw)
            launches = (truth_rates.launches_per_step + sum(
                truth_rates.launches_per_microbatch + truth_rates.launches_per_extra_kda_round * (f.kda_rounds - 1)
                + (truth_rates.launches_per_consumer if f.consumer else 0)
                + truth_rates.launches_per_sequence * f.sequences for f in c.features))
            cases.append(replace(c, measured_s=predict(truth_rates, c), launches=launches))
    got, info = fit_launches(hw.executor, cases)
    assert got.launches_per_consumer == pytest.approx(700.0, rel=1e-6)
    assert got.launches_per_sequence == pytest.approx(40.0, rel=1e-6)
    got, info = fit_rates(got, cases, ["device_scale", "host_s_per_launch"])
    assert got.device_scale == pytest.approx(1.7, rel=1e-3)
    assert got.host_s_per_launch == pytest.approx(3.1e-5, rel=1e-3)
    assert info["rms_log_error"] < 1e-6


def test_the_category_fit_recovers_the_scales_that_made_the_kernel_times():
    """Kernel totals and attention/KDA seconds made by known category scales: the device
    fit (what `harts sim calibrate` runs on profiled steps) finds those scales again."""
    from harts.sim.fit_executor import category_seconds, device_seconds

    hw = load_hardware("h100")
    truth_rates = hw.executor.with_values(device_scale=1.6, attention_tree_scale=0.3, attention_causal_scale=0.7,
                                          kda_scale=0.55)
    start = hw.executor.with_values(attention_tree_scale=1.0, attention_causal_scale=1.0, kda_scale=1.0)
    cases = []
    for family in ("grpo", "long-chain", "bushy", "fanout"):
        forest = _forest(family, 4096)
        for kind in ("tree", "windows", "expanded"):
            c = case_of(family, kind, step_of(forest, kind, 4096, MODEL.chunk_size), MODEL, hw)
            cats = tuple(category_seconds(truth_rates, c).items())
            cases.append(replace(c, device_s=device_seconds(truth_rates, c), device_by_category=cats))
    names = ["device_scale", "attention_tree_scale", "attention_causal_scale", "kda_scale"]
    got, info = fit_rates(start, cases, names, target="device")
    for n in names:
        assert getattr(got, n) == pytest.approx(getattr(truth_rates, n), rel=1e-3), n
    assert info["category_rms_log_error"] < 1e-6
    # without the category truths the totals alone are fitted and the residual records none
    _, info = fit_rates(start, [replace(c, device_by_category=None) for c in cases], ["device_scale"], target="device")
    assert "category_rms_log_error" not in info


def test_the_base_executor_section_loads():
    data = json.loads((HARDWARE_DIR / "h200.json").read_text())
    data["executor"] = BASE_EXECUTOR
    assert profile_from_dict(data).executor.launches_per_microbatch == BASE_EXECUTOR["launches_per_microbatch"]["value"]


def test_the_forward_action_runs_the_statistics_forward_only_with_the_global_aux_scope():
    from harts.sim.executor import statistics_forwards

    hw = load_hardware("h100")
    step = step_of(_forest(), "expanded", 4096, MODEL.chunk_size)
    scopes = {scope: MODEL.replace(aux_scope=scope) for scope in ("microbatch", "global")}
    assert statistics_forwards(scopes["microbatch"]) == 1 and statistics_forwards(scopes["global"]) == 2
    assert statistics_forwards(scopes["global"].replace(aux_loss_coef=0.0)) == 1
    one, two = (microbatch_features(ExecutorCostModel(scopes[s], ONE, hw), step)[0] for s in ("microbatch", "global"))
    assert (one.forward_passes, two.forward_passes) == (1.0, 2.0)
    d1, d2 = (action_seconds(hw.executor, Phase.FWD, f)[0] for f in (one, two))
    r = hw.executor
    per_forward = (one.fwd_s + (r.attention_tree_scale - 1) * one.fwd_parts[0]
                   + (r.attention_causal_scale - 1) * one.fwd_parts[1] + (r.kda_scale - 1) * one.fwd_parts[2])
    assert d2 - d1 == pytest.approx(per_forward * r.device_scale * (1 + r.half_efficiency_rows / one.rows))


def test_category_scales_price_their_ops_alone():
    """Each category scale multiplies its own ops' device seconds and nothing else: the
    device totals of two rates differing in one scale differ by (scale change) x that
    category's priced seconds, which `harts sim validate`'s categories report."""
    hw = load_hardware("h100")
    step = step_of(_forest(), "tree", 4096, MODEL.chunk_size)
    cm = ExecutorCostModel(MODEL, ONE, hw)
    base = cm.device_by_category(step)
    for name, cat in (("attention_tree_scale", "attention"), ("kda_scale", "kda")):
        old = getattr(hw.executor, name)
        cm2 = ExecutorCostModel(MODEL, ONE, hw, rates=hw.executor.with_values(**{name: 2 * old}))
        moved = cm2.device_by_category(step)
        assert moved[cat] == pytest.approx(2 * base[cat], rel=1e-12) and base[cat] > 0
        for other in ("token-wise", "window", "optimizer"):
            assert moved[other] == pytest.approx(base[other], rel=1e-12)
        feats = microbatch_features(cm2, step)
        total2 = sum(action_seconds(cm2.rates, ph, f)[0] for f in feats for ph in (Phase.FWD, Phase.BWD))
        feats = microbatch_features(cm, step)
        total1 = sum(action_seconds(cm.rates, ph, f)[0] for f in feats for ph in (Phase.FWD, Phase.BWD))
        assert total2 - total1 == pytest.approx(base[cat], rel=1e-9)


def test_device_categories_add_up_to_the_modelled_device_time():
    hw = load_hardware("h100")
    cost = ExecutorCostModel(MODEL, ONE, hw)
    step = step_of(_forest(), "windows", 4096, MODEL.chunk_size)
    by = cost.device_by_category(step)
    device = sum(action_seconds(hw.executor, ph, f)[0] for f in microbatch_features(cost, step)
                 for ph in (Phase.FWD, Phase.BWD))
    assert sum(by.values()) == pytest.approx(device + CostModel.optimizer(cost, 0), rel=1e-9)
    assert set(by) == set(CATEGORIES)
    assert by["window"] > 0 and by["attention"] > 0 and by["kda"] > 0 and by["collectives"] == 0


def test_launches_scale_with_the_layers_of_a_stage():
    hw = load_hardware("h100")
    step = step_of(_forest(), "expanded", 4096, MODEL.chunk_size)
    tiny = get_model_config("tiny")  # 24 layers against tiny-h200's 8
    one = microbatch_features(ExecutorCostModel(MODEL, ONE, hw), step)[0]
    deep = microbatch_features(ExecutorCostModel(tiny, ONE, hw), step)[0]
    two_stages = ExecutorCostModel(tiny, ParallelConfig(dp=1, pp=2, ep=1), hw)
    assert one.layer_ratio == 1.0 and deep.layer_ratio == 3.0
    assert two_stages.features(0, step.microbatches[0]).layer_ratio == 1.5
    assert action_seconds(hw.executor, Phase.BWD, deep)[1] == pytest.approx(
        3 * action_seconds(hw.executor, Phase.BWD, one)[1])


def test_the_floored_step_is_the_plan_train_makes_and_prices_no_higher():
    """Kind `floored`: l1l2 with the profile's floors (what `harts train` plans on that GPU).
    On stepwise/11 at 16k the h100 floors keep L1's windowless plan, which the executor
    model prices below the window plan's step; without floors the kind is refused."""
    from harts.sim.executor import plan_floors

    hw = load_hardware("h100")
    forest = build_forest(shapes.draw("stepwise", 11, 16384, vocab_size=32768))
    floors = plan_floors(MODEL, hw, 16384)
    steps = {k: step_of(forest, k, 16384, MODEL.chunk_size, floors=floors) for k in ("windows", "floored")}
    t = {k: predict(hw.executor, case_of("s", k, s, MODEL, hw)) for k, s in steps.items()}
    assert t["floored"] < t["windows"]
    with pytest.raises(ValueError, match="floors"):
        step_of(forest, "floored", 16384, MODEL.chunk_size)
