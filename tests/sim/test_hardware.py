"""Hardware profiles: the H200 file loads, derived rates follow from its measurements, and
every number says where it came from."""

from __future__ import annotations

import json

import pytest

from harts.sim.hardware import HARDWARE_DIR, known_hardware, load_hardware, profile_from_dict


def test_h200_profile():
    hw = load_hardware("h200")
    assert "h200" in known_hardware()
    assert 7.0e14 <= hw.matmul_flops_per_s <= 7.9e14  # measured range (DESIGN.md, KINDS.md)
    assert hw.hbm_bytes_per_s == 4.3e12
    # derived: 32k causal, 16 heads, fwd 2*(192+128) per pair-head, bwd 2.5x, 37 ms
    t = 32768
    want = t * (t + 1) / 2 * 16 * 640 * 3.5 / 0.037
    assert hw.attention_flops_per_s["causal"] == pytest.approx(want)
    assert hw.attention_flops_per_s["tree"] < hw.attention_flops_per_s["causal"]
    assert hw.kda_s_per_token_head == pytest.approx(1 / (3.0e6 * 16))
    assert set(hw.sources.values()) <= {"measured", "assumption", "fitted"}
    # only the executor rates are fitted (harts/sim/executor.py)
    assert all(k.startswith("executor.") for k, v in hw.sources.items() if v == "fitted")
    # the multi-GPU numbers are assumptions, said so in the file
    assert all(v == "assumption" for k, v in hw.sources.items() if k.startswith("interconnect."))
    assert hw.link(True).bus_bytes_per_s < hw.link(False).bus_bytes_per_s


def test_unknown_and_bad_profiles():
    with pytest.raises(KeyError, match="unknown hardware"):
        load_hardware("tpu")
    data = json.loads((HARDWARE_DIR / "h200.json").read_text())
    data["schema"] = "other"
    with pytest.raises(ValueError, match="schema"):
        profile_from_dict(data)
    data["schema"] = "harts.sim.hardware/v1"
    del data["gpu"]["hbm_bytes_per_s"]
    with pytest.raises(ValueError, match="gpu.hbm_bytes_per_s"):
        profile_from_dict(data)
