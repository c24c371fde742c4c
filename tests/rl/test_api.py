"""The batch API: layouts in (per sequence, verl-style padded, TRL-style prompt/completion),
log-probs and entropy out in the batch's order, tree and expanded updates alike."""

import numpy as np
import pytest
import torch

from harts.exec.model import build_model
from harts.rl.api import BatchError, RLPolicy, SequenceBatch
from harts.rl.env import make_env
from harts.rl.loop import toy_model_config

CFG = toy_model_config(make_env("switchboard").config)


def _batch():
    # two groups; sequences of a group share a prefix; interleaved so order matters
    seqs = [[0, 5, 9, 4, 1, 6], [0, 7, 8, 8, 2, 7, 3], [0, 5, 9, 4, 2, 5], [0, 7, 8, 3], [0, 5, 9, 11]]
    groups = ["a", "b", "a", "b", "a"]
    rng = np.random.default_rng(0)
    masks = [[0] + [1] * (len(s) - 1) for s in seqs]
    adv = [float(x) for x in rng.normal(size=len(seqs))]
    old = [rng.normal(-2.7, 0.1, size=len(s)) for s in seqs]
    return SequenceBatch.make(seqs, masks, adv, old, groups)


def test_make_broadcasts_scalar_advantages_and_zeroes_unmasked_old_log_probs():
    b = SequenceBatch.make([[0, 1, 2]], [[0, 0, 1]], [0.5], [[-1.0, -2.0, -3.0]], ["g"])
    assert b.advantages[0].tolist() == [0.5, 0.5, 0.5]
    assert b.old_log_probs[0].tolist() == [0.0, 0.0, -3.0]


@pytest.mark.parametrize("bad, match", [
    (dict(response_mask=[[1, 1, 1]]), "sequence 0: response_mask\\[0\\] is set"),
    (dict(response_mask=[[0, 1]]), "sequence 0: response_mask has 2 entries for 3 tokens"),
    (dict(advantages=[[1.0, 2.0]]), "sequence 0: advantages has 2 entries"),
    (dict(group_ids=["a", "b"]), "group_ids: 2 entries for 1 sequences"),
])
def test_bad_batches_name_the_sequence_and_field(bad, match):
    args = dict(input_ids=[[0, 1, 2]], response_mask=[[0, 1, 1]], advantages=[0.0], old_log_probs=None,
                group_ids=["g"])
    args.update(bad)
    with pytest.raises(BatchError, match=match):
        SequenceBatch.make(**args)


def test_padded_and_prompt_completion_layouts_give_the_same_batch():
    # left-padded full sequences (verl) and prompt/completion halves (TRL) of the same data
    prompts = [[0, 5], [0, 7, 8]]
    comps = [[9, 4, 1], [2]]
    adv = np.array([0.3, -0.3])
    old = [[-1.0, -2.0, -3.0], [-4.0]]
    T = 5
    ids = np.zeros((2, T), np.int64)
    att = np.zeros((2, T), np.int64)
    resp = np.zeros((2, T), np.int64)
    advs = np.zeros((2, T))
    olds = np.zeros((2, T))
    for b, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        seq = p + c
        ids[b, T - len(seq):] = seq
        att[b, T - len(seq):] = 1
        resp[b, T - len(c):] = 1
        advs[b, T - len(c):] = adv[b]
        olds[b, T - len(c):] = old[b]
    a = SequenceBatch.from_padded(ids, att, resp, advs, olds, ["g0", "g1"])
    P, C = 3, 3
    p_ids, p_mask = np.zeros((2, P), np.int64), np.zeros((2, P), np.int64)
    c_ids, c_mask, c_old = np.zeros((2, C), np.int64), np.zeros((2, C), np.int64), np.zeros((2, C))
    for b, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        p_ids[b, P - len(p):] = p
        p_mask[b, P - len(p):] = 1
        c_ids[b, :len(c)] = c
        c_mask[b, :len(c)] = 1
        c_old[b, :len(c)] = old[b]
    b2 = SequenceBatch.from_prompt_completion(p_ids, p_mask, c_ids, c_mask, adv, c_old, ["g0", "g1"])
    for x, y in zip(a.input_ids + a.old_log_probs, b2.input_ids + b2.old_log_probs, strict=True):
        assert np.array_equal(x, y)
    for x, y in zip(a.response_mask, b2.response_mask, strict=True):
        assert np.array_equal(x, y)
    for x, y, m in zip(a.advantages, b2.advantages, a.response_mask, strict=True):
        assert np.array_equal(x[m], y[m])


def test_log_probs_come_back_in_batch_order_and_tree_equals_expanded():
    batch = _batch()
    stats = {}
    for mode in ("tree", "expanded"):
        model = build_model(CFG, seed=1, dtype=torch.float64)
        stats[mode] = RLPolicy(model, mode=mode).compute_log_prob(batch)
    model = build_model(CFG, seed=1, dtype=torch.float64)
    solo = RLPolicy(model, mode="expanded")
    for i in range(len(batch)):
        one = SequenceBatch.make([batch.input_ids[i]], [batch.response_mask[i]], [batch.advantages[i]],
                                 [batch.old_log_probs[i]], ["x"])
        want = solo.compute_log_prob(one)
        for mode in ("tree", "expanded"):
            np.testing.assert_allclose(stats[mode].log_probs[i][1:], want.log_probs[0][1:], rtol=0, atol=1e-12)
            np.testing.assert_allclose(stats[mode].entropy[i][1:], want.entropy[0][1:], rtol=0, atol=1e-12)
            assert np.isnan(stats[mode].log_probs[i][0])
    lp, ent = stats["tree"].padded()
    assert lp.shape == (5, 7) and not np.isnan(lp).any()


def test_tree_and_expanded_updates_agree_in_float64():
    batch = _batch()
    out, params = {}, {}
    for mode in ("tree", "expanded"):
        model = build_model(CFG, seed=2, dtype=torch.float64)
        policy = RLPolicy(model, mode=mode)
        out[mode] = [policy.update(batch) for _ in range(2)]
        params[mode] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(out["tree"], out["expanded"], strict=True):
        assert abs(a.losses["loss"] - b.losses["loss"]) < 1e-10
        assert abs(a.grad_norm - b.grad_norm) < 1e-10
    assert out["tree"][0].compression > 1.0 and out["expanded"][0].compression == 1.0
    assert max(float((x - y).abs().max()) for x, y in zip(params["tree"], params["expanded"], strict=True)) < 1e-10
    assert out["tree"][0].grad_norm > 0
