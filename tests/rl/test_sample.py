"""Sampling: the draw under temperature and top-p, per-rollout generators, trees from
turn-boundary branching, and the HARTS policy's recomputed forward."""

import numpy as np
import pytest

from harts.rl.env import make_env
from harts.rl.loop import toy_model_config, uniform_expansion
from harts.rl.sample import (
    HartsPolicy,
    SamplingConfig,
    SamplingError,
    boundary_prefixes,
    draw,
    prompt_prefix,
    run_episodes,
    sample_tree_rollouts,
)
from harts.tree import build_forest
from harts.tree.trajectory import Trajectory

ENV = make_env("switchboard")


class TablePolicy:
    """A torch-free policy: log-probs a fixed function of the prefix length and last token."""

    def __init__(self, vocab=16):
        self.vocab = vocab
        self.calls = []

    def next_logprobs(self, prefixes):
        self.calls.append(len(prefixes))
        out = []
        for p in prefixes:
            z = np.sin(np.arange(self.vocab) * (1 + len(p)) + p[-1])
            out.append(z - np.log(np.exp(z).sum()))
        return np.array(out)


def test_draw_top_p_keeps_only_the_nucleus_and_low_temperature_is_greedy():
    logp = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    seen = {draw(logp, rng, SamplingConfig(top_p=0.7)) for _ in range(300)}
    assert seen == {0, 1}
    seen = {draw(logp, rng, SamplingConfig(temperature=1e-3)) for _ in range(50)}
    assert seen == {0}
    full = np.bincount([draw(logp, rng, SamplingConfig()) for _ in range(4000)], minlength=4) / 4000
    assert np.abs(full - np.exp(logp)).max() < 0.03


def test_sampling_config_is_checked():
    with pytest.raises(SamplingError, match="top_p"):
        SamplingConfig(top_p=0.0).validate()
    with pytest.raises(SamplingError, match="temperature"):
        SamplingConfig(temperature=0.0).validate()


def test_tree_rollouts_are_deterministic_and_continuations_share_their_prefix():
    cfg = SamplingConfig(seed=3)
    def sample():
        return sample_tree_rollouts(TablePolicy(), ENV, [10, 11], [3, 3], uniform_expansion(ENV, 3), cfg, step=1)
    a, b = sample(), sample()
    assert [r.tokens.tolist() for r in a] == [r.tokens.tolist() for r in b]
    assert [r.prompt for r in a] == sorted(r.prompt for r in a)
    roots = [r for r in a if r.branch_turn == 0]
    conts = [r for r in a if r.branch_turn > 0]
    assert len(roots) == 6 and 0 < len(conts) <= 6
    for c in conts:
        cut = 2 + 4 * c.branch_turn
        parent = [r for r in roots if r.prompt == c.prompt and r.path[0] == c.path[0]][0]
        assert c.tokens[:cut].tolist() == parent.tokens[:cut].tolist()
        assert np.array_equal(c.old_logprobs[:cut], parent.old_logprobs[:cut])
    for r in a:
        assert 0.0 <= r.reward <= 1.0
        assert r.loss_mask.sum() == 2 * len(r.turns)
        for t in r.turns:
            assert r.loss_mask[t.start:t.end].all() and not r.loss_mask[t.end:t.end + 2].any()
        assert np.all(r.old_logprobs[~r.loss_mask] == 0) and np.all(r.old_logprobs[r.loss_mask] < 0)
    trajs = [Trajectory.make(f"t{i}", f"p{r.prompt}", r.tokens, r.loss_mask.astype(int)) for i, r in enumerate(a)]
    assert build_forest(trajs).compression > 1.0  # shared prompts and branched prefixes


def test_a_rollout_does_not_depend_on_what_else_is_in_the_batch():
    cfg = SamplingConfig(seed=1)
    base = prompt_prefix(ENV, 4)
    other = prompt_prefix(ENV, 5)
    def rng(k):
        return np.random.default_rng(np.random.SeedSequence([9, k]))
    alone = run_episodes(TablePolicy(), ENV, [base], [rng(0)], cfg)
    together = run_episodes(TablePolicy(), ENV, [other, base, other], [rng(1), rng(0), rng(2)], cfg)
    assert alone[0].tokens.tolist() == together[1].tokens.tolist()


def test_boundary_prefixes_replay_the_episode_and_negative_counts_are_refused():
    roots = sample_tree_rollouts(TablePolicy(), ENV, [3, 4], [2, 2], None, SamplingConfig(seed=2))
    for r in roots:
        pre = boundary_prefixes(ENV, r)
        assert len(pre) == len(r.turns) - 1
        for t, p in enumerate(pre, start=1):
            assert p.turn == t and list(p.tokens) == r.tokens[: 2 + 4 * t].tolist()
            assert p.state.history == r.turns[:t]
    with pytest.raises(SamplingError, match="counts >= 0"):
        sample_tree_rollouts(TablePolicy(), ENV, [1], [2], lambda rs: [(boundary_prefixes(ENV, rs[0])[0], -1)]
                             if len(rs[0].turns) > 1 else [(prompt_prefix(ENV, 1), -1)], SamplingConfig())


def test_harts_policy_matches_one_forward_per_prefix():
    import torch

    from harts.exec.model import build_model
    from harts.exec.model.context import PackedContext

    model = build_model(toy_model_config(ENV.config), seed=0, dtype=torch.float64)
    prefixes = [np.array([0, 5, 3]), np.array([0, 6]), np.array([0, 5, 3]), np.array([0, 7, 1, 2, 9])]
    got = HartsPolicy(model).next_logprobs(prefixes)
    assert got.shape == (4, 16)
    for p, row in zip(prefixes, got, strict=True):
        with torch.no_grad():
            ctx = PackedContext(torch.tensor([0, len(p)]), chunk_size=model.config.chunk_size)
            h = model(torch.from_numpy(p), ctx).hidden_TD[-1]
            want = torch.log_softmax(h @ model.lm_head_weight.T, -1).numpy()
        np.testing.assert_allclose(row, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.exp(got).sum(1), 1.0, atol=1e-12)


def test_the_transformers_hook_matches_one_forward_per_prefix():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from harts.rl.sample import HFCausalLMPolicy

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).double().eval()
    prefixes = [np.array([0, 5, 3]), np.array([0, 6]), np.array([0, 7, 1, 2, 9])]
    got = HFCausalLMPolicy(model).next_logprobs(prefixes)
    for p, row in zip(prefixes, got, strict=True):
        with torch.no_grad():
            want = torch.log_softmax(model(input_ids=torch.from_numpy(p)[None]).logits[0, -1], -1).numpy()
        np.testing.assert_allclose(row, want, rtol=0, atol=1e-10)
