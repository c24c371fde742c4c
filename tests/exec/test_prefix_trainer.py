"""The prefix-merged baseline: sequences that are prefixes of another (copies included) run
inside their host, and the step equals the expanded step in float64."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.exec.loss import PolicyLossConfig
from harts.exec.model import build_model
from harts.exec.prefix_trainer import PrefixMergedTrainer
from harts.exec.trainer import ExpandedTrainer
from harts.testing import assert_close
from harts.tree import build_forest
from harts.tree.prefix import forest_host_lengths, prefix_hosts
from harts.tree.trajectory import Trajectory


def _config(**changes):
    return get_model_config("tiny-cpu").replace(
        name="test-prefix", vocab_size=48, d_model=24, kda_num_heads=2, kda_head_dim=8,
        kda_head_v_dim=8, chunk_size=16, mla_num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, dense_ffn_dim=24, num_experts=4, top_k=2,
        expert_ffn_dim=12, init_std=0.2, **changes,
    )


def _nested(vocab, seed=0):
    """Two rollouts as step-wise samples (nested prefixes), a copy, and an unrelated one."""
    rng = np.random.default_rng(seed)
    out = []
    for r, n in enumerate((41, 29)):
        full = rng.integers(0, vocab, n)
        for k, cut in enumerate(sorted({5, 13, 22, n})):
            if cut <= n:
                out.append((f"r{r}/t{k}", f"g{r}", full[:cut]))
    out.append(("copy", "g0", out[3][2].copy()))  # a copy of rollout 0's last sample
    out.append(("alone", "g2", rng.integers(0, vocab, 17)))
    trajs = []
    for name, group, toks in out:
        n = len(toks)
        mask = rng.random(n) < 0.7
        mask[0] = False
        trajs.append(Trajectory.make(name, group, toks, mask, rng.normal(size=n),
                                     old_logprobs=-np.log(vocab) + 0.1 * rng.normal(size=n),
                                     ref_logprobs=-np.log(vocab) + 0.3 * rng.normal(size=n)))
    return trajs


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=10))
def test_prefix_hosts(seqs):
    arrays = [np.asarray(s) for s in seqs]
    host = prefix_hosts(arrays)
    for i, s in enumerate(seqs):
        h = int(host[i])
        assert host[h] == h  # hosts host themselves
        assert seqs[h][: len(s)] == s  # merged into a sequence it is a prefix of
        extended = any(j != i and len(t) >= len(s) and t[: len(s)] == s and (t != s or j > i)
                       for j, t in enumerate(seqs))
        assert (h != i) == extended
    # the hosts' total length is the forest's leaf-path total (one host per leaf)
    trajs = [Trajectory.make(f"s{i}", "g", np.asarray(s), np.zeros(len(s), bool), 0.0) for i, s in enumerate(seqs)]
    lengths = sorted(len(seqs[h]) for h in set(host.tolist()))
    assert sorted(forest_host_lengths(build_forest(trajs)).tolist()) == lengths


def test_partition_keeps_merged_sequences_with_their_host():
    trajs = _nested(48)
    trainer = PrefixMergedTrainer(build_model(_config(), dtype=torch.float64))
    bins = trainer.partition(trajs, 45)
    assert sorted(j for b in bins for j in b) == list(range(len(trajs)))
    host = prefix_hosts([t.tokens for t in trajs])
    for b in bins:
        assert all(int(host[j]) in b for j in b)


@pytest.mark.parametrize("budget,aux_scope", [(10**6, "microbatch"), (45, "global"), (1, "global")])
def test_prefix_merged_step_equals_expanded(budget, aux_scope):
    model = build_model(_config(aux_scope=aux_scope), dtype=torch.float64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.01)
    trajs = _nested(48)
    expanded = ExpandedTrainer(model, loss=cfg)
    model.zero_grad()
    # one microbatch for the expanded side under the microbatch-scoped aux loss (its aux
    # value depends on the packing); the prefix-merged side uses the budget
    ref = expanded.forward_backward(trajs, 10**6 if aux_scope == "microbatch" else budget)
    ref_grads = _grads(model)
    model.load_state_dict(state)
    model.zero_grad()
    merged = PrefixMergedTrainer(model, loss=cfg)
    res = merged.forward_backward(trajs, budget)
    assert res.executed_rows < ref.executed_rows  # the merged sequences ran no rows of their own
    assert res.executed_rows == sum(len(t) for t in trajs if t.id in ("r0/t3", "r1/t3", "alone"))
    for j, t in enumerate(trajs):
        assert_close(f"logprobs {t.id}", res.logprobs[j][1:], ref.logprobs[j][1:], 1e-12)
        assert_close(f"entropy {t.id}", res.entropy[j][1:], ref.entropy[j][1:], 1e-12)
    for key in ("loss", "pg_loss", "kl", "entropy", "aux_loss", "clip_frac", "ppo_kl"):
        assert res.losses[key] == pytest.approx(ref.losses[key], rel=1e-10, abs=1e-15), key
    assert ref.losses["aux_loss"] > 0
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        if g.abs().sum() > 0:
            assert_close(name, grads[name], g, 1e-10)
        else:
            assert torch.equal(grads[name], g), name
    assert_close("expert load", res.expert_load, ref.expert_load, 1e-12)


def test_token_dropping_is_refused():
    from harts.config.models import ConfigError

    with pytest.raises(ConfigError, match="capacity_factor"):
        PrefixMergedTrainer(build_model(_config(capacity_factor=1.0), dtype=torch.float64))


def test_step_runs_with_optimizer():
    model = build_model(_config(), dtype=torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    res = PrefixMergedTrainer(model).step(_nested(48), 64)
    assert np.isfinite(res.losses["loss"]) and res.grad_norm > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert dataclasses.is_dataclass(res)
