"""The calibrated cost model: a synthetic profile written by the test, fitted back."""

from __future__ import annotations

import numpy as np
import pytest

from harts.config.models import get_model_config
from harts.sim.costs import make_cost_model
from harts.sim.hardware import load_hardware
from harts.sim.parallel import ParallelConfig
from harts.sim.profile import (
    fit_profile,
    load_calibration,
    load_profile,
    measurement_features,
    save_profile,
)
from harts.sim.work import expanded_microbatch
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
