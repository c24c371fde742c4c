"""The calibrated cost model: a synthetic profile written by the test, fitted back."""

from __future__ import annotations

import numpy as np
import pytest

from harts.config.models import get_model_config
from harts.config.parallel import ParallelConfig
from harts.plan.work import expanded_microbatch
from harts.sim.costs import make_cost_model
from harts.sim.hardware import load_hardware
from harts.sim.profile import (
    fit_profile,
    load_calibration,
    load_profile,
    measurement_features,
    save_profile,
)
from harts.testing import assert_close

# ground truth the synthetic device follows: per-call overhead, per FLOP, per byte, ...
TRUE = {
    ("gemm", "fwd"): {"calls": 6e-6, "flops": 1 / 6.1e14, "bytes": 1 / 3.9e12},
    ("gemm", "bwd"): {"calls": 7e-6, "flops": 1 / 5.5e14, "bytes": 1 / 3.7e12},
    ("kda_chunk", "fwd"): {"calls": 3e-5, "token_heads_kv": 2.1e-13, "chunk_steps": 1.5e-6},
    ("attention_tree", "bwd"): {"calls": 2e-5, "attn_flops": 1 / 1.3e14},
}


def synthetic_rows(seed: int = 0, noise: float = 0.02) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(40):
        m, k, n = (int(x) for x in rng.choice([256, 1024, 4096, 16384, 65536], 3))
        for phase in ("fwd", "bwd"):
            c = TRUE[("gemm", phase)]
            flops, byts = 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n)
            t = c["calls"] + c["flops"] * flops + c["bytes"] * byts
            rows.append({"op": "gemm", "phase": phase, "m": m, "k": k, "n": n,
                         "seconds": t * (1 + noise * rng.normal())})
        tokens, heads, chunks = int(rng.integers(512, 131072)), int(rng.choice([8, 16, 32])), int(rng.integers(1, 2048))
        c = TRUE[("kda_chunk", "fwd")]
        t = c["calls"] + c["token_heads_kv"] * tokens * heads * 128 * 128 + c["chunk_steps"] * chunks
        rows.append({"op": "kda_chunk", "phase": "fwd", "tokens": tokens, "heads": heads, "head_k_dim": 128,
                     "head_v_dim": 128, "max_chunks": chunks, "seconds": t * (1 + noise * rng.normal())})
        pairs = float(rng.integers(10**6, 10**10))
        c = TRUE[("attention_tree", "bwd")]
        t = c["calls"] + c["attn_flops"] * pairs * 16 * 640
        rows.append({"op": "attention_tree", "phase": "bwd", "pairs": pairs, "heads": 16, "qk_dim": 192,
                     "v_dim": 128, "seconds": t * (1 + noise * rng.normal())})
    return rows


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_fit_recovers_the_synthetic_device(tmp_path, suffix):
    path = tmp_path / f"profile{suffix}"
    save_profile(path, "synthetic H200", synthetic_rows(noise=0.0), source="test")
    header, ms = load_profile(path)
    assert header["device"] == "synthetic H200"
    cal = fit_profile(ms, device="synthetic H200")
    for (op, phase), coefs in TRUE.items():
        fit = cal.fits[f"{op}:{phase}"]
        got = [dict(zip(fit.features, fit.coefficients, strict=True))[n] for n in coefs]
        assert_close(f"{op}:{phase}", got, list(coefs.values()), 1e-6)
        assert fit.rel_rms < 1e-9
    cal.save(tmp_path / "cal.json")
    again = load_calibration(tmp_path / "cal.json")
    assert again == cal


def test_fit_with_noise_predicts_within_noise(tmp_path):
    rows = synthetic_rows(seed=1, noise=0.03)
    cal = fit_profile([measurement_features(r) for r in rows])
    for key, fit in cal.fits.items():
        assert fit.rel_rms < 0.06, key
    truth = TRUE[("gemm", "fwd")]
    fit = cal.fits["gemm:fwd"]
    want = truth["calls"] + truth["flops"] * 1e13 + truth["bytes"] * 1e9
    assert_close("gemm", [fit.predict({"calls": 1, "flops": 1e13, "bytes": 1e9})], [want], 0.05)


def test_calibrated_model_uses_fits_and_falls_back_to_roofline():
    hw = load_hardware("h200")
    tiny = get_model_config("tiny")
    cal = fit_profile([measurement_features(r) for r in synthetic_rows(noise=0.0)])
    calibrated = make_cost_model("calibrated", tiny, ParallelConfig(), hw, calibration=cal)
    roof = make_cost_model("roofline", tiny, ParallelConfig(), hw)
    w = expanded_microbatch(0, 0, [8192, 4096])
    f_cal, f_roof = calibrated.forward(0, [w]), roof.forward(0, [w])
    assert f_cal.seconds != f_roof.seconds
    pr = calibrated.pricer
    assert "gemm:fwd" in pr.calibrated_keys and "kda_chunk:fwd" in pr.calibrated_keys
    assert "elementwise:fwd" in pr.fallback_keys  # not in the profile: roofline price
    # elementwise ops are priced identically by both
    assert dict(f_cal.by_kind)["elementwise"] == pytest.approx(dict(f_roof.by_kind)["elementwise"])


def test_elementwise_scale_scales_only_elementwise_and_round_trips(tmp_path):
    import dataclasses

    hw = load_hardware("h200")
    tiny = get_model_config("tiny")
    cal = fit_profile([measurement_features(r) for r in synthetic_rows(noise=0.0)])
    scaled = dataclasses.replace(cal, elementwise_scale=3.0)
    w = expanded_microbatch(0, 0, [8192, 4096])
    a = dict(make_cost_model("calibrated", tiny, ParallelConfig(), hw, calibration=cal).forward(0, [w]).by_kind)
    b = dict(make_cost_model("calibrated", tiny, ParallelConfig(), hw, calibration=scaled).forward(0, [w]).by_kind)
    assert b["elementwise"] == pytest.approx(3.0 * a["elementwise"])
    assert all(b[k] == pytest.approx(a[k]) for k in a if k != "elementwise")
    path = tmp_path / "cal.json"
    scaled.save(path)
    assert load_calibration(path).elementwise_scale == 3.0
    cal.save(path)
    assert load_calibration(path).elementwise_scale == 1.0


def test_bad_rows():
    with pytest.raises(ValueError, match="known 'op'"):
        measurement_features({"op": "conv3d", "phase": "fwd", "seconds": 1})
    with pytest.raises(ValueError, match="seconds"):
        measurement_features({"op": "gemm", "phase": "fwd", "seconds": 0, "m": 1, "k": 1, "n": 1})
    with pytest.raises(ValueError, match="needs"):
        measurement_features({"op": "kda_chunk", "phase": "fwd", "seconds": 1, "tokens": 5, "heads": 2})


def test_one_optimizer_row_prices_the_same_parameters_at_its_own_time():
    """A single row cannot separate a per-call term from bytes: the fit puts it all on bytes,
    counted in the model's bytes per parameter, so the simulated Adam step over the same
    parameters costs what the row measured, whatever its launch count or `bytes` field."""
    from harts.sim.ops import ADAM_BYTES_PER_PARAM

    hw = load_hardware("h200")
    tiny = get_model_config("tiny")
    cost = make_cost_model("roofline", tiny, ParallelConfig(), hw)
    params = sum(cost.stages[0].stage_params())
    row = {"op": "optimizer", "phase": "step", "seconds": 7e-3, "bytes": params * 16, "params": params}
    assert measurement_features(row).features["bytes"] == params * ADAM_BYTES_PER_PARAM
    cal = fit_profile([measurement_features(row)])
    fit = cal.fits["optimizer:step"]
    assert dict(zip(fit.features, fit.coefficients, strict=True))["calls"] == 0.0
    calibrated = make_cost_model("calibrated", tiny, ParallelConfig(), hw, calibration=cal)
    assert calibrated.optimizer(0) == pytest.approx(7e-3, rel=1e-9)
    # with as many rows as features the per-call term is fitted as before
    rows = [dict(row, seconds=s, params=p, calls=8) for s, p in ((7e-3, params), (3.6e-3, params / 2))]
    fit = fit_profile([measurement_features(r) for r in rows]).fits["optimizer:step"]
    coef = dict(zip(fit.features, fit.coefficients, strict=True))
    assert_close("per-call", [coef["calls"]], [0.2e-3 / 8], 1e-6)


def test_kda_kernel_roles():
    from harts.sim.ops import Phase
    from harts.sim.profile import kda_kernel_role

    assert kda_kernel_role("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == (Phase.FWD, True)
    assert kda_kernel_role("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64") == (Phase.BWD, True)
    assert kda_kernel_role("_bwd_dhu_inject_kernel") == (Phase.BWD, True)
    assert kda_kernel_role("chunk_kda_fwd_kernel_intra_token_parallel") == (Phase.FWD, False)
    assert kda_kernel_role("chunk_kda_bwd_kernel_wy_dqkg_fused") == (Phase.BWD, False)
    assert kda_kernel_role("recompute_w_u_fwd_kda_kernel") == (Phase.FWD, False)
    assert kda_kernel_role("chunk_local_cumsum_vector_kernel") == (Phase.FWD, False)


def test_kda_fit_from_step_kernels_recovers_a_synthetic_step():
    """A step of L calls per pass, forward run twice (recomputation), the backward rerunning
    the forward's state recurrence once: the fit recovers the per-token and per-step prices
    of each phase, and prices a step of other calls (more chunk steps per token) right."""
    from harts.sim.ops import OpCall, OpKind, Phase
    from harts.sim.profile import fit_kda_from_kernels

    calls, thkv, steps = 24, 2.1e10, 1180.0
    tok_f, step_f, tok_b, step_b = 2.4e-13, 2.6e-6, 1.0e-12, 3.7e-6
    kernels = [
        ("chunk_kda_fwd_kernel_intra_token_parallel", 2 * thkv * tok_f * 0.6, 2 * calls),
        ("chunk_gla_fwd_kernel_o", 2 * thkv * tok_f * 0.4, 2 * calls),
        # fwd recurrence: twice per forward pass, once more inside the backward
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", 3 * steps * step_f, 3 * calls),
        ("chunk_kda_bwd_kernel_intra", thkv * tok_b, calls),
        ("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", steps * (step_b - step_f), calls),
    ]
    fits = fit_kda_from_kernels(kernels, calls, thkv, steps, forward_passes=2)
    f, b = fits["kda_chunk:fwd"], fits["kda_chunk:bwd"]
    assert f.features == ("calls", "token_heads_kv", "chunk_steps")
    assert_close("fwd", list(f.coefficients), [0.0, tok_f, step_f], 1e-9)
    assert_close("bwd", list(b.coefficients), [0.0, tok_b, step_b], 1e-9)
    op = OpCall("kda.core", OpKind.KDA_CHUNK, Phase.BWD, 1, token_heads_kv=1e9, chunk_steps=500.0)
    from harts.sim.profile import op_features

    assert b.predict(op_features(op)) == pytest.approx(1e9 * tok_b + 500 * step_b)
    with pytest.raises(ValueError):
        fit_kda_from_kernels(kernels, 0, thkv, steps)
