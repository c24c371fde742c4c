"""The fidelity report on CPU: in float64 every run (tree with and without replay, the
expanded rerun and the expanded run repacked one trajectory per microbatch) is the expanded
baseline to the comparison's float32 rounding; in bf16 the report has every pair and the
deterministic rerun is exact."""

import dataclasses

import pytest
import torch

from harts.config.models import get_model_config
from harts.tree.workload import generate_trajectories
from harts.verify.fidelity import fidelity

PAIRS = ("expanded_rerun", "expanded_repacked", "tree_replay", "tree_no_replay")


def test_float64_runs_agree():
    # global aux scope: the MoE aux loss does not depend on how the step is packed
    model = dataclasses.replace(get_model_config("tiny-cpu"), aux_scope="global")
    trajs = generate_trajectories("tiny-treestep", seed=2)
    rep = fidelity(trajs, model=model, dtype=torch.float64, seed=1)
    for name in PAIRS:
        r = rep[f"{name}_vs_expanded"]
        # logits are compared in float32: identical rows give cosine 1 to ~1e-9
        assert r["cosine"] == pytest.approx(1.0, abs=1e-7), name
        assert r["sym_kl"] < 1e-9 and r["nll_diff_max"] < 1e-5 and r["loss_diff"] < 1e-12, name


def test_bf16_report_has_every_pair():
    trajs = generate_trajectories("tiny-treestep", seed=2)
    rep = fidelity(trajs, model="tiny-cpu", dtype=torch.bfloat16, seed=1)
    assert rep["expanded_rerun_vs_expanded"]["sym_kl"] == 0.0
    for name in PAIRS:
        r = rep[f"{name}_vs_expanded"]
        assert 0.99 < r["cosine"] <= 1.0 + 1e-6 and r["positions"] > 0, name
        assert 0 in r["by_handoff_depth"], name
