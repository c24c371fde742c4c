"""The trajectory-expanded reference trainer: packing, packed == one at a time, microbatch
split invariance, gradcheck, aux-loss weighting, the update step and `harts train`."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harts.cli.main import main
from harts.config.models import get_model_config
from harts.config.optimizer import OptimizerConfig
from harts.exec.loss import PolicyLossConfig, policy_loss
from harts.exec.model import PackedContext, build_model
from harts.exec.trainer import (
    ExpandedTrainer,
    pack_microbatches,
    step_denominators,
    trajectory_targets,
)
from harts.testing import assert_close
from harts.tree.trajectory import Trajectory

LENGTHS = [13, 40, 7, 25, 2, 18]


def _config(**changes):
    return get_model_config("tiny-cpu").replace(
        name="test-trainer", vocab_size=48, d_model=24, kda_num_heads=2, kda_head_dim=8,
        kda_head_v_dim=8, chunk_size=16, mla_num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, dense_ffn_dim=24, num_experts=4, top_k=2,
        expert_ffn_dim=12, init_std=0.2, **changes,
    )


def _trajectories(vocab, seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = rng.random(n) < 0.7
        mask[0] = False
        out.append(Trajectory.make(
            f"t{i}", f"g{i % 2}", rng.integers(0, vocab, n), mask, rng.normal(size=n),
            ref_logprobs=-np.log(vocab) + 0.3 * rng.normal(size=n),
        ))
    return out


def _on_policy(trainer, trajectories, seed=1):
    """Old log-probs near the current policy's, so ratios sit near 1 (some clipped)."""
    rng = np.random.default_rng(seed)
    fresh = trainer.recompute_old_logprobs(trajectories, 10**6)
    return [dataclasses.replace(t, old_logprobs=t.old_logprobs + 0.1 * rng.normal(size=len(t))) for t in fresh]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 60))
def test_pack_microbatches_first_fit_decreasing(lengths, budget):
    bins = pack_microbatches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        total = sum(lengths[i] for i in b)
        assert total <= budget or len(b) == 1
    # first-fit: no item of a later bin fits into the room an earlier bin had left
    for later, b in enumerate(bins):
        for i in b:
            for earlier in bins[:later]:
                opened_before = [j for j in earlier if (-lengths[j], j) < (-lengths[i], i)]
                assert sum(lengths[j] for j in opened_before) + lengths[i] > budget
    assert pack_microbatches(lengths, budget) == bins


@pytest.mark.parametrize("budget", [10**6, 45, 1])
def test_microbatching_leaves_logprobs_loss_and_gradients_unchanged(budget):
    # aux loss off: it is the one packing-dependent term (tested below)
    model = build_model(_config(aux_loss_coef=0.0), dtype=torch.float64)
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.01)
    trainer = ExpandedTrainer(model, loss=cfg)
    trajectories = _on_policy(trainer, _trajectories(48))
    model.zero_grad()
    full = trainer.forward_backward(trajectories, 10**6)
    full_grads = _grads(model)
    model.zero_grad()
    split = trainer.forward_backward(trajectories, budget)
    if budget == 1:
        assert len(split.microbatches) == len(LENGTHS)
    for j, t in enumerate(trajectories):
        assert np.isnan(split.logprobs[j][0]) and np.isnan(split.entropy[j][0])
        assert_close(f"logprobs {t.id}", split.logprobs[j][1:], full.logprobs[j][1:], 1e-12)
        assert_close(f"entropy {t.id}", split.entropy[j][1:], full.entropy[j][1:], 1e-12)
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ppo_kl"):
        assert split.losses[key] == pytest.approx(full.losses[key], rel=1e-12, abs=1e-15), key
    assert 0 < full.losses["clip_frac"] < 1
    grads = _grads(model)
    assert grads.keys() == full_grads.keys()
    for name, g in full_grads.items():
        if g.abs().sum() > 0:
            assert_close(name, grads[name], g, 1e-11)
        else:
            assert torch.equal(grads[name], g), name
    assert np.array_equal(split.expert_load, full.expert_load)
    assert_close("grad norm", split.grad_norm, full.grad_norm, 1e-12)


def test_logprobs_match_each_trajectory_run_alone():
    model = build_model(_config(use_rope=True), dtype=torch.float64)
    trajectories = _trajectories(48, seed=4)
    result = ExpandedTrainer(model).evaluate(trajectories, 60)
    assert len(result.microbatches) > 1 and result.grad_norm == 0.0
    for j, t in enumerate(trajectories):
        ids = torch.from_numpy(t.tokens)
        hidden = model(ids, PackedContext(torch.tensor([0, len(t)]), chunk_size=16)).hidden_TD
        logp = torch.log_softmax(hidden @ model.lm_head_weight.T, -1)
        expected = logp[torch.arange(len(t) - 1), ids[1:]]
        assert_close(f"logprobs {t.id}", result.logprobs[j][1:], expected, 1e-12)


def test_aux_loss_scaled_by_microbatch_token_share():
    model = build_model(_config(aux_loss_coef=0.05), dtype=torch.float64)
    trainer = ExpandedTrainer(model)
    trajectories = _trajectories(48, seed=5)
    total = sum(LENGTHS)
    for budget in (10**6, 45):
        result = trainer.evaluate(trajectories, budget)
        expected = 0.0
        for members in result.microbatches:
            lengths = [LENGTHS[j] for j in members]
            ids = torch.from_numpy(np.concatenate([trajectories[j].tokens for j in members]))
            cu = torch.tensor([0, *np.cumsum(lengths)])
            aux = model(ids, PackedContext(cu, chunk_size=16)).aux_loss
            expected += float(aux.detach()) * sum(lengths) / total
        assert result.losses["aux_loss"] == pytest.approx(expected, rel=1e-12)
        assert result.losses["aux_loss"] > 0


def test_gradcheck_through_model_and_loss():
    config = _config(num_layers=4, aux_loss_coef=0.05)
    model = build_model(config, dtype=torch.float64)
    trainer = ExpandedTrainer(model, loss=PolicyLossConfig(kl_coef=0.1))
    trajectories = _on_policy(trainer, _trajectories(48, seed=6, lengths=[19, 9]))
    den = step_denominators(trajectories)
    table = trajectory_targets(trajectories, [0, 1], [0, 19])
    ids = torch.from_numpy(np.concatenate([t.tokens for t in trajectories]))
    ctx = PackedContext(torch.tensor([0, 19, 28]), chunk_size=16)
    names = ["layers.0.mixer.A_log", "layers.2.mixer.dt_bias", "layers.3.mixer.kv_a_norm.weight",
             "layers.1.mixer.o_norm.weight", "layers.1.ffn.router.weight"]
    params = dict(model.named_parameters())

    def objective(*values):
        out = torch.func.functional_call(model, dict(zip(names, values, strict=True)), (ids, ctx), strict=False)
        return policy_loss(out.hidden_TD, model.lm_head_weight, table, den, trainer.loss_config).loss + out.aux_loss

    inputs = tuple(params[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(objective, inputs)


def test_step_updates_parameters():
    config = _config()
    model = build_model(config)
    trainer = ExpandedTrainer(model, OptimizerConfig(lr=1e-2, grad_clip=0.5, weight_decay=0.1))
    trajectories = _on_policy(trainer, _trajectories(48, seed=7))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = trainer.step(trajectories, 50)
    assert np.isfinite(result.grad_norm) and result.grad_norm > 0
    assert result.tokens == sum(LENGTHS)
    assert result.trained_tokens == sum(int(t.loss_mask.sum()) for t in trajectories)
    assert result.expert_load.shape == (config.num_moe_layers, config.num_experts)
    assert np.all(result.expert_load.sum(1) == config.top_k * sum(LENGTHS))
    assert result.seconds > 0 and result.tokens_per_second > 0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "layers.0.mixer.A_log" in changed and "lm_head.weight" in changed


def test_token_outside_vocabulary():
    trainer = ExpandedTrainer(build_model(_config()))
    bad = [Trajectory.make("x", "g", [1, 2, 48])]
    with pytest.raises(ValueError, match="token id 48 is outside the vocabulary of test-trainer"):
        trainer.step(bad, 100)


def test_cli_train_expanded(capsys, tmp_path):
    assert main(["train", "--mode", "expanded", "--model", "tiny-cpu", "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in report["steps"]] == [1, 2]
    for s in report["steps"]:
        assert np.isfinite(s["loss"]) and s["grad_norm"] > 0 and s["tokens"] > 0 and s["tokens_per_s"] > 0
    assert main(["train", "--steps", "1", "--microbatch-tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "step 1  loss" in out and "tok/s" in out

    # tree mode trains the same step: identical losses in float64, fewer executed rows
    runs = {}
    for mode in ("expanded", "tree"):
        assert main(["train", "--mode", mode, "--steps", "2", "--dtype", "float64", "--json"]) == 0
        runs[mode] = json.loads(capsys.readouterr().out)["steps"]
    for e, t in zip(runs["expanded"], runs["tree"], strict=True):
        assert abs(e["loss"] - t["loss"]) <= 1e-12 * max(1.0, abs(e["loss"]))
        assert abs(e["grad_norm"] - t["grad_norm"]) <= 1e-10 * e["grad_norm"]
        assert t["executed_rows"] < e["executed_rows"]
    from harts.tree.io import save_jsonl

    path = tmp_path / "big-token.jsonl"
    save_jsonl([Trajectory.make("big", "g", [1, 2, 600])], path)
    assert main(["train", "--input", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "big-token.jsonl line 1: field 'tokens': trajectory 'big': token id 600 at position 2" in err
    assert "outside the vocabulary (size 512)" in err
    assert main(["train", "--model", "flash", "--device", "cpu"]) == 2
    assert "too large to train on a CPU" in capsys.readouterr().err
