"""The FLOP ratio: GEMM FLOPs follow the token ratio, attention the pair ratio."""

import numpy as np
import pytest

from harts.config.models import get_model_config
from harts.sim.flops import flop_ratio, step_flops
from harts.tree import build_forest
from harts.tree.trajectory import Trajectory


def _traj(name, group, tokens):
    n = len(tokens)
    mask = np.ones(n, bool)
    mask[0] = False
    return Trajectory.make(name, group, np.asarray(tokens), mask, 1.0, np.zeros(n))


def test_no_sharing_gives_ratio_one():
    f = build_forest([_traj("a", "g0", [1, 2, 3, 4]), _traj("b", "g1", [5, 6, 7])])
    r = flop_ratio(f, get_model_config("tiny-cpu"))
    assert r["flop_ratio"] == pytest.approx(1.0, rel=1e-12)
    assert r["gemm_ratio"] == pytest.approx(1.0, rel=1e-12)


def test_prefix_pair_attention_and_gemm_ratios():
    # b extends a: the tree has 7 rows on one chain; expanded has 4 + 7 tokens
    f = build_forest([_traj("a", "g", [1, 2, 3, 4]), _traj("b", "g", [1, 2, 3, 4, 5, 6, 7])])
    m = get_model_config("tiny-cpu")
    r = flop_ratio(f, m, recompute=False)
    assert r["gemm_ratio"] == pytest.approx(11 / 7, rel=1e-12)
    assert r["attention_ratio"] == pytest.approx((10 + 28) / 28, rel=1e-12)
    tree, exp = step_flops(f, m, "tree", False), step_flops(f, m, "expanded", False)
    assert r["flop_ratio"] == pytest.approx(exp.total / tree.total, rel=1e-12)
    # the ratio lies between the two ratios, weighted by the attention share
    assert r["attention_ratio"] < r["flop_ratio"] < r["gemm_ratio"]


def test_unknown_mode_is_refused():
    f = build_forest([_traj("a", "g", [1, 2])])
    with pytest.raises(ValueError, match="mode"):
        step_flops(f, get_model_config("tiny-cpu"), "both")
