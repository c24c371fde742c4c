"""Step-global MoE aux loss (aux_scope="global"): the step's aux loss, every loss term and
every gradient are the same for any microbatch split, in expanded and tree mode, and the
aux loss is the full-batch value computed by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from harts.config.models import get_model_config
from harts.exec.loss import PolicyLossConfig
from harts.exec.model import PackedContext, build_model
from harts.exec.model.moe import MoE
from harts.exec.trainer import ExpandedTrainer
from harts.exec.tree_trainer import TreeTrainer
from harts.testing import assert_close
from harts.tree.workload import generate_trajectories

TOL = 1e-12
COEF = 0.05
LOSS = PolicyLossConfig(agg_mode="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.01)
# 3 groups of 4 tree-sampled trajectories (80-103 tokens each, 1080 expanded, 381 compact)
# the shape the budgets and partitions below were set on: the generator's copies and last-turn forks
TRAJECTORIES = generate_trajectories("tiny-treestep", seed=7, vocab_size=64, num_groups=3, allow_duplicates=True,
                                     last_turn_branching=True)
# exercise every MoE layer with a large aux weight; 3 MoE layers of 4 experts top-2
_BASE = get_model_config("tiny-cpu").replace(
    name="test-global-aux", vocab_size=64, d_model=32, kda_num_heads=2, kda_head_dim=8,
    kda_head_v_dim=8, chunk_size=16, mla_num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, dense_ffn_dim=32, num_experts=4, top_k=2,
    expert_ffn_dim=16, init_std=0.2, aux_loss_coef=COEF,
)


def _model(scope: str = "global"):
    return build_model(_BASE.replace(aux_scope=scope), dtype=torch.float64, seed=5)


@pytest.fixture(scope="module")
def trajectories():
    """Old log-probs near the current policy's, so ratios sit near 1 and some are clipped."""
    fresh = ExpandedTrainer(_model(), loss=LOSS).recompute_old_logprobs(TRAJECTORIES, 10**6)
    rng = np.random.default_rng(1)
    return [dataclasses.replace(t, old_logprobs=t.old_logprobs + 0.1 * rng.normal(size=len(t))) for t in fresh]


def _run(trainer, trajectories, budget=10**6, partition=None):
    trainer.model.zero_grad(set_to_none=True)
    result = trainer.forward_backward(trajectories, budget, partition)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return result, grads


def _assert_same_step(got, ref, tol=TOL):
    (r, g), (r0, g0) = got, ref
    for j in range(len(r0.logprobs)):
        assert_close(f"logprobs {j}", r.logprobs[j][1:], r0.logprobs[j][1:], tol)
        assert_close(f"entropy {j}", r.entropy[j][1:], r0.entropy[j][1:], tol)
    assert r.losses.keys() == r0.losses.keys()
    for key, value in r0.losses.items():
        assert value != 0, key
        assert r.losses[key] == pytest.approx(value, rel=tol), key
    assert g.keys() == g0.keys()
    for name, grad in g0.items():
        if grad.abs().sum() > 0:
            assert_close(name, g[name], grad, tol)
        else:
            assert torch.equal(g[name], grad), name
    assert np.array_equal(r.expert_load, r0.expert_load)
    assert all(m["moe_stats_drift"] == 0.0 for m in r.layout)


def _aux_by_hand(model, trajectories) -> float:
    """coef * E * sum_layers sum_i f_i P_i over one packed batch of every trajectory, from the
    router logits (softmax, top-k, unit row weights) in numpy."""
    logits = []
    hooks = [m.router.register_forward_hook(lambda mod, inp, out: logits.append(out.detach().numpy()))
             for m in model.modules() if isinstance(m, MoE)]
    ids = torch.from_numpy(np.concatenate([t.tokens for t in trajectories]))
    cu = torch.tensor([0, *np.cumsum([len(t) for t in trajectories])])
    with torch.no_grad():
        model(ids, PackedContext(cu, chunk_size=model.config.chunk_size))
    for h in hooks:
        h.remove()
    E, k = model.config.num_experts, model.config.top_k
    assert len(logits) == model.config.num_moe_layers
    total = 0.0
    for z in logits:
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        selected = np.zeros_like(p)
        np.put_along_axis(selected, np.argsort(-p, axis=-1, kind="stable")[:, :k], 1.0, axis=-1)
        f, P = selected.sum(0) / (k * len(z)), p.mean(0)
        total += COEF * E * float((f * P).sum())
    return total


def test_expanded_global_aux_is_independent_of_the_split(trajectories):
    trainer = ExpandedTrainer(_model(), loss=LOSS)
    full = _run(trainer, trajectories)
    assert len(full[0].microbatches) == 1 and 0 < full[0].losses["clip_frac"] < 1
    # one microbatch: the global scope is the microbatch scope (same losses and gradients)
    _assert_same_step(full, _run(ExpandedTrainer(_model("microbatch"), loss=LOSS), trajectories), TOL)
    splits = [
        _run(trainer, trajectories, 200),
        _run(trainer, trajectories, 1),  # one trajectory per microbatch
        _run(trainer, trajectories, partition=[[0, 5, 9, 2], [11], [1, 4, 7, 10, 3], [8, 6]]),
    ]
    assert [len(r.microbatches) for r, _ in splits] == [6, 12, 4]
    for split in splits:
        _assert_same_step(split, full)
    by_hand = _aux_by_hand(trainer.model, trajectories)
    for r, _ in (full, *splits):
        assert r.losses["aux_loss"] == pytest.approx(by_hand, rel=TOL)
    # the microbatch scope does depend on the split, and the tests above would see it
    mb_trainer = ExpandedTrainer(_model("microbatch"), loss=LOSS)
    r, g = _run(mb_trainer, trajectories, 200)
    assert abs(r.losses["aux_loss"] / by_hand - 1) > 1e-5
    router = "layers.1.ffn.router.weight"
    assert abs(float((g[router] - full[1][router]).norm() / full[1][router].norm())) > 1e-3


def test_tree_global_aux_equals_expanded_for_any_split(trajectories):
    reference = _run(ExpandedTrainer(_model(), loss=LOSS), trajectories)
    tree = TreeTrainer(_model(), loss=LOSS)
    groups = [tree.partition(trajectories, b) for b in (10**6, 260, 150)]
    assert [len(p) for p in groups] == [1, 2, 3]
    # trees cut inside a group: the same prompt's trajectories in different microbatches
    cut = [[0, 1, 5, 9, 10], [2, 3, 4], [6, 7, 8, 11]]
    for partition in (*groups, cut):
        got = _run(tree, trajectories, partition=partition)
        assert got[0].microbatches == partition
        assert sum(m["rows"] for m in got[0].layout) < got[0].tokens
        _assert_same_step(got, reference)
    assert reference[0].losses["aux_loss"] == pytest.approx(_aux_by_hand(tree.model, trajectories), rel=TOL)


def test_evaluate_reports_the_global_aux_without_gradients(trajectories):
    trainer = ExpandedTrainer(_model(), loss=LOSS)
    trainer.model.zero_grad(set_to_none=True)
    full = trainer.evaluate(trajectories, 10**6)
    split = trainer.evaluate(trajectories, 1)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert split.grad_norm == 0.0 and len(split.microbatches) == len(trajectories)
    assert split.losses["aux_loss"] == pytest.approx(full.losses["aux_loss"], rel=TOL)
    assert full.losses["aux_loss"] == pytest.approx(_aux_by_hand(trainer.model, trajectories), rel=TOL)


@pytest.mark.parametrize("trainer_cls", [ExpandedTrainer, TreeTrainer])
def test_prepared_step_computes_the_same_numbers(trajectories, trainer_cls):
    """A step prepared ahead (in a background thread, as a data loader would) computes
    exactly what the same step computes when it builds its microbatches itself, including
    the global aux scope's second pass over the same microbatch objects."""
    from concurrent.futures import ThreadPoolExecutor

    trainer = trainer_cls(_model(), loss=LOSS)
    budget = 260
    direct = _run(trainer, trajectories, budget)
    with ThreadPoolExecutor(1) as pool:
        prepared = pool.submit(trainer.prepare, trajectories, budget).result()
    assert prepared.partition == direct[0].microbatches and len(prepared.microbatches) > 1
    assert prepared.seconds > 0
    trainer.model.zero_grad(set_to_none=True)
    result = trainer.forward_backward(trajectories, budget, prepared=prepared)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    _assert_same_step((result, grads), direct, tol=0.0)
    with pytest.raises(ValueError, match="other trajectories or another token budget"):
        trainer.forward_backward(trajectories, budget + 1, prepared=prepared)
    with pytest.raises(ValueError, match="other trajectories or another token budget"):
        trainer.forward_backward(list(trajectories), budget, prepared=prepared)
    with pytest.raises(ValueError, match="partition differs"):
        trainer.forward_backward(trajectories, budget, partition=[list(range(len(trajectories)))], prepared=prepared)


def test_run_steps_with_prefetch_equals_stepping_one_by_one(trajectories):
    """`run_steps` prepares batch i+1 while step i runs; the updates are those of calling
    `step` batch by batch (same losses, same parameters after every step)."""
    from harts.exec.trainer import run_steps

    batches = [trajectories, trajectories[:7], trajectories]
    plain = TreeTrainer(_model(), loss=LOSS)
    ahead = TreeTrainer(_model(), loss=LOSS)
    expected = [plain.step(b, 260) for b in batches]
    got = list(run_steps(ahead, batches, 260))
    assert [r.losses for r in got] == [r.losses for r in expected]
    assert [r.microbatches for r in got] == [r.microbatches for r in expected]
    for (name, p), q in zip(plain.model.named_parameters(), ahead.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert list(run_steps(ahead, [], 260)) == []
