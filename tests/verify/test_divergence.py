"""The op-by-op divergence report on CPU: a rerun introduces nothing; a difference put into
one op's output in the second run is reported as introduced there and nowhere before it,
and inherited (input differs) after it; mixers count a position's whole prefix as input."""

import numpy as np
import pytest
import torch

from harts.config.models import get_model_config
from harts.exec.model.model import build_model
from harts.exec.tree_trainer import TreeTrainer
from harts.tree.workload import generate_trajectories
from harts.verify.divergence import _prefix_any, compare_runs, format_table, op_modules


@pytest.fixture(scope="module")
def setup():
    trajs = generate_trajectories("tiny-treestep", seed=2)
    net = build_model(get_model_config("tiny-cpu"), seed=1, dtype=torch.bfloat16)
    return net, trajs, TreeTrainer(net).partition(trajs, 1 << 17)


@pytest.mark.parametrize("mode", ["expanded", "replay"])
def test_a_rerun_introduces_nothing(setup, mode):
    net, trajs, partition = setup
    rep = compare_runs(net, trajs, partition, mode, mode)
    assert rep["first_introduced"] is None and rep["positions"] == sum(len(t) for t in trajs)
    assert all(o["output_differs"] == 0 and o["input_differs"] == 0 for o in rep["ops"])
    assert [o["op"] for o in rep["ops"]] == [n for n, _, _ in op_modules(net)]


def test_a_difference_is_found_where_it_is_put(setup):
    net, trajs, partition = setup
    target = "layers.1.ffn_norm"

    def perturb(name, y):
        if name != target:
            return y
        y = y.clone()
        y[::7] += 1.0  # every 7th row of the run's own layout
        return y

    rep = compare_runs(net, trajs, partition, "replay", "replay", perturb_b=perturb)
    assert rep["first_introduced"] == target
    names = [o["op"] for o in rep["ops"]]
    at = names.index(target)
    for o in rep["ops"][:at]:
        assert o["output_differs"] == 0 and o["introduced"] == 0, o["op"]
    hit = rep["ops"][at]
    assert hit["input_differs"] == 0 and 0 < hit["output_differs"] == hit["introduced"] < 1
    after = rep["ops"][at + 1]  # the FFN: its input is the perturbed norm's output
    assert after["input_differs"] == hit["output_differs"] and after["introduced"] <= after["output_differs"]
    assert target in format_table(rep)


def test_mixers_see_the_prefix():
    differs = np.array([False, True, False, False, False, True])
    starts = np.array([0, 3, 6])
    assert _prefix_any(differs, starts).tolist() == [False, True, True, False, False, True]


def test_unknown_mode_is_refused(setup):
    net, trajs, partition = setup
    with pytest.raises(ValueError, match="mode must be"):
        compare_runs(net, trajs, partition, "expanded", "tree")


def test_float32_norms_are_closer_to_float64():
    """ModelConfig.norm_float32: the bf16 RMSNorm normalised in float32 inside is nearer the
    float64 result than the one computed in bf16 throughout."""
    from harts.exec.model.layers import rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g, dtype=torch.float64) * 3
    w = 1 + 0.1 * torch.randn(512, generator=g, dtype=torch.float64)
    want = rms_norm(x, w, 1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    err32 = (rms_norm(xb, wb, 1e-6, float32=True).double() - want).abs().mean()
    err16 = (rms_norm(xb, wb, 1e-6).double() - want).abs().mean()
    assert err32 < err16
    assert torch.equal(rms_norm(x, w, 1e-6, float32=True), want)  # a float64 input is not cast


def test_norm_float32_is_a_validated_switch():
    import dataclasses

    from harts.config.models import ConfigError

    cfg = get_model_config("tiny-cpu")
    assert cfg.norm_float32 is False
    net = build_model(dataclasses.replace(cfg, norm_float32=True), seed=1)
    assert net.layers[0].attn_norm.float32 and net.norm.float32
    with pytest.raises(ConfigError, match="norm_float32"):
        dataclasses.replace(cfg, norm_float32="yes").validate()
