"""Roofline prices of a worker and Heddle's planners (DP placement against brute force)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.cost import DENSE_SERVED_MODELS, make_rollout_cost
from harts.sim.rollout.planning import (
    DecodePrice,
    dp_place,
    estimate_makespan,
    predict_remaining,
    worker_estimate,
)
from harts.sim.rollout.types import TrajectorySpec, TurnSpec

COST = make_rollout_cost(RolloutWorkload())


def test_decode_prices_grow_with_batch_and_context_and_shrink_with_degree():
    for d in (2, 4, 8):
        by_batch = [COST.decode_step(b, b * 8000, d) for b in (1, 4, 16, 64, 256)]
        assert by_batch == sorted(by_batch)
        by_ctx = [COST.decode_step(8, c, d) for c in (0, 10_000, 100_000, 1_000_000)]
        assert by_ctx == sorted(by_ctx) and by_ctx[0] < by_ctx[-1]
    lone = [COST.decode_step(1, 30_000, d) for d in (2, 4, 8)]
    assert lone == sorted(lone, reverse=True)
    # efficiency < 1: eight GPUs are less than 4x faster than two on the same batch
    assert COST.decode_step(64, 64 * 8000, 2) / COST.decode_step(64, 64 * 8000, 8) < 4.0


def test_kv_capacity_is_hbm_minus_weights():
    assert COST.kv_capacity(1) < 0  # 124B parameters in bf16 do not fit one H200
    assert COST.kv_capacity(4) == pytest.approx(4 * COST.hbm_capacity_bytes * 0.9 - COST.weight_bytes)
    assert COST.kv_bytes(1000) - COST.kv_bytes(0) == pytest.approx(1000 * COST.kv_bytes_per_token)
    assert COST.transfer(1e9, True) < COST.transfer(1e9, False)


def test_dense_served_models_have_their_published_sizes():
    # Qwen3-32B: 32.8B parameters; Qwen3-8B: 8.2B (model cards)
    assert DENSE_SERVED_MODELS["qwen3-32b"].params / 1e9 == pytest.approx(32.8, abs=0.05)
    assert DENSE_SERVED_MODELS["qwen3-8b"].params / 1e9 == pytest.approx(8.2, abs=0.05)
    dense = make_rollout_cost(RolloutWorkload(model="qwen3-32b"))
    # 64 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes
    assert dense.kv_bytes_per_token == 64 * 2 * 8 * 128 * 2
    assert dense.kv_bytes(0) == 0.0 and dense.routed_weight_bytes == 0.0
    assert dense.kv_capacity(1) > dense.kv_bytes(65536)  # one H200 serves it with room for a 64k context
    assert dense.touched_fraction(256) == 0.0


def test_dense_decode_is_bound_by_the_co_resident_kv():
    dense = make_rollout_cost(RolloutWorkload(model="qwen3-32b"))
    for d in (1, 2, 4, 8):
        by_ctx = [dense.decode_step(16, c, d) for c in (0, 100_000, 1_000_000)]
        assert by_ctx == sorted(by_ctx)
        # a million co-resident context tokens (262 GB) read per iteration outweigh the 65.5 GB of weights
        assert by_ctx[2] > 3 * by_ctx[0]
    # per context token the dense model reads ~30x the MLA latent of flash
    assert dense.kv_bytes_per_token > 25 * COST.kv_bytes_per_token


@pytest.mark.parametrize("model", ["flash", "qwen3-32b"])
def test_vectorised_decode_prices_are_the_scalar_ones(model):
    cost = make_rollout_cost(RolloutWorkload(model=model))
    batch = np.array([1, 3, 17, 256, 256])
    ctx = np.array([0.0, 9000.0, 2e5, 1e6, 4e6])
    for d in (2, 4, 8):
        want = [cost.decode_step(int(b), c, d) for b, c in zip(batch, ctx, strict=True)]
        assert cost.decode_steps(batch, ctx, d) == pytest.approx(want, rel=1e-12)


def test_planner_prices_long_contexts_on_dense_models():
    dense = make_rollout_cost(RolloutWorkload(model="qwen3-32b"))
    price = DecodePrice(dense, 8, 256)
    # ten 60k-token trajectories at a mean context of 32k, against ten with 2k
    x, tl = np.full(10, 60_000.0), np.zeros(10)
    long_ctx = worker_estimate(x, tl, np.full(10, 32_000.0), price)
    short_ctx = worker_estimate(x, tl, np.full(10, 2_000.0), price)
    assert long_ctx > 1.5 * short_ctx  # 10 x 32k x 256 KiB read per token: 84 GB against 5 GB
    # beyond the KV capacity sequences take turns: 200 sequences of 32k (1.7 TB) on one MP8 worker
    many = float(price.per_token(200.0, 200 * 32_000.0))
    fit = int(dense.kv_capacity(8) // (32_000 * dense.kv_bytes_per_token))
    assert many == pytest.approx(dense.decode_step(fit, fit * 32_000.0, 8) * 200 / fit, rel=1e-9)


def test_predictor_never_reads_the_truth_and_updates_per_turn():
    a = TrajectorySpec(0, 0, tuple(TurnSpec(10, 100, 1.0) for _ in range(3)), hint_turns=6.0)
    b = TrajectorySpec(1, 0, tuple(TurnSpec(10, 100, 1.0) for _ in range(9)), hint_turns=6.0)
    assert predict_remaining(a, 0, 0, 50.0) == predict_remaining(b, 0, 0, 50.0) == (300.0, 6.0)
    assert predict_remaining(a, 2, 400, 50.0) == (800.0, 4.0)  # observed 200 tokens per turn
    assert predict_remaining(a, 8, 800, 50.0) == (200.0, 2.0)  # outlived its hint


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=6), st.lists(st.sampled_from((2, 4, 8)), min_size=1,
                                                                       max_size=3))
def test_dp_placement_is_the_best_contiguous_split(lengths, degrees):
    x = np.array(lengths, dtype=float)
    tools = np.array([float(v % 7) for v in lengths])
    ctx = 500.0 + x / 2
    prices = {d: DecodePrice(COST, d, 256) for d in set(degrees)}
    assign, best = dp_place(x, tools, ctx, degrees, prices)
    assert best == pytest.approx(estimate_makespan(assign, x, tools, ctx, degrees, prices), rel=1e-9)
    order = np.argsort(-x, kind="stable")
    wo = sorted(range(len(degrees)), key=lambda w: (-degrees[w], w))
    brute = float("inf")
    for cuts in itertools.combinations_with_replacement(range(len(x) + 1), len(degrees) - 1):
        bounds = (0, *cuts, len(x))
        a = [0] * len(x)
        for j in range(len(degrees)):
            for i in order[bounds[j]:bounds[j + 1]]:
                a[i] = wo[j]
        brute = min(brute, estimate_makespan(a, x, tools, ctx, degrees, prices))
    assert best <= brute * (1 + 1e-3) + 1e-12


def test_context_counts_and_the_work_bound_scale():
    from harts.sim.rollout.compare import context_counts, work_bound

    spec = TrajectorySpec(0, 0, (TurnSpec(3, 4, 1.0), TurnSpec(2, 1, 0.0)), hint_turns=2.0)
    n = context_counts((spec,), 12)
    # decoded tokens see contexts 3, 4, 5, 6 (first turn), then 3 + 4 + 2 = 9
    assert n.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0]
    cfg = RolloutWorkload(model="qwen3-8b", max_context=4096)
    cost = make_rollout_cost(cfg)
    long = TrajectorySpec(1, 0, (TurnSpec(500, 3000, 0.0),), hint_turns=1.0)
    one, two = work_bound(cfg, (long,), cost, 8), work_bound(cfg, (long, long), cost, 8)
    assert 0 < one < two <= 2 * one * (1 + 1e-12)  # more work, and additive per trajectory
    assert work_bound(cfg, (long,), cost, 16) == pytest.approx(one / 2, rel=1e-12)
