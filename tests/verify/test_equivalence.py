"""Tree execution is the expanded training: log-probs, losses, loads and every gradient."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.cli.main import main
from harts.config.models import ConfigError, get_model_config
from harts.exec.model.model import build_model
from harts.exec.tree_trainer import TreeTrainer
from harts.tree.workload import generate_trajectories
from harts.verify.equivalence import verify_step
from tests.strategies import trajectory_sets

TOL64 = 1e-10


def _assert_equivalent(report: dict) -> None:
    assert report["max_rel_logprob_err"] <= TOL64, report["max_rel_logprob_err"]
    assert report["max_rel_entropy_err"] <= TOL64
    assert report["max_rel_grad_err"] <= TOL64, report["worst_grad_params"]
    assert report["max_rel_expert_load_err"] <= TOL64
    for name, err in report["loss_abs_err"].items():
        assert err <= TOL64, name


@settings(max_examples=15)
@given(trajectory_sets(max_groups=2, max_per_group=4, max_len=20), st.sampled_from([2, 4, 8]),
       st.integers(0, 1000))
def test_float64_tree_equals_expanded_on_drawn_trees(trajs, chunk, seed):
    # small chunks put forks on chunk boundaries, inside first chunks and mid-chunk
    cfg = get_model_config("tiny-cpu").replace(chunk_size=chunk)
    report = verify_step(trajs, model=cfg, seed=seed, no_replay=True)
    _assert_equivalent(report)
    _assert_equivalent(report["no_replay"])


@pytest.mark.parametrize("workload", ["tiny-stepwise", "tiny-treestep"])
def test_float64_tree_equals_expanded_on_generated_workloads(workload):
    trajs = generate_trajectories(workload, seed=11)
    report = verify_step(trajs, seed=1, microbatch_tokens=200)
    assert report["microbatches"] >= 2  # whole trees split over several microbatches
    _assert_equivalent(report)


def test_float32_replay_reproduces_the_chunk_grid_and_no_replay_does_not():
    trajs = generate_trajectories("tiny-treestep", seed=5)
    report = verify_step(trajs, dtype=torch.float32, seed=2)
    kda = report["kda_layer"]
    assert kda["replay"]["bit_identical"]
    assert not kda["node"]["bit_identical"] and kda["node"]["max_abs_err"] > 0
    # whole-model fidelity stays at float32 rounding either way
    assert report["max_rel_logprob_err"] < 1e-5 and report["no_replay"]["max_rel_logprob_err"] < 1e-5
    assert report["no_replay"]["rounds"] > report["rounds"]


def test_recomputation_gives_identical_tree_gradients():
    trajs = generate_trajectories("tiny-treestep", seed=3)
    grads = []
    for recompute in (False, True):
        model = build_model("tiny-cpu", dtype=torch.float64, seed=4, recompute=recompute)
        TreeTrainer(model).forward_backward(trajs, 4096)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_token_dropping_is_refused_in_tree_mode():
    cfg = get_model_config("tiny-cpu").replace(capacity_factor=1.25)
    with pytest.raises(ConfigError, match="token dropping breaks"):
        TreeTrainer(build_model(cfg, dtype=torch.float64))
    assert main(["verify", "--model", "nope"]) == 2


def test_cli_verify_json(tmp_path, capsys):
    from harts.tree import save_jsonl

    path = tmp_path / "r.jsonl"
    trajs = generate_trajectories("tiny-stepwise", seed=1)
    save_jsonl(trajs, path)
    assert main(["verify", "--input", str(path), "--dtype", "float64", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["num_targets"] == sum(len(t) - 1 for t in trajs)
    for key in ("max_rel_logprob_err", "max_rel_grad_err", "rounds", "replay_tokens"):
        assert key in rep and key in rep["no_replay"]
    assert rep["max_rel_logprob_err"] <= TOL64 and rep["max_rel_grad_err"] <= TOL64
    bad = tmp_path / "bad.jsonl"
    save_jsonl(trajs, bad)
    text = bad.read_text().replace('"tokens":[', '"tokens":[100000,', 1)
    text = text.replace('"loss_mask":[', '"loss_mask":[0,', 1).replace('"old_logprobs":[', '"old_logprobs":[0.0,', 1)
    text = text.replace('"ref_logprobs":[', '"ref_logprobs":[0.0,', 1)
    bad.write_text(text)
    assert main(["verify", "--input", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl line 1: field 'tokens'" in err
    assert "token id 100000 at position 0 is outside the vocabulary" in err
