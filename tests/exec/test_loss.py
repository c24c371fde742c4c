"""RL objective: per-target log-probs without expanded vocabulary rows, PPO/GRPO clipping,
k3 KL, verl aggregation modes with global denominators (microbatch sums = full batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harts.exec.loss import (
    AGG_MODES,
    PolicyLossConfig,
    TargetTable,
    aggregate,
    loss_denominators,
    policy_loss,
    target_logprobs,
)
from harts.testing import assert_close

T, D, V = 9, 6, 11


def _case(seed=0, n=14, num_traj=4, with_ref=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, dtype=torch.float64, generator=g)
    head = torch.randn(V, D, dtype=torch.float64, generator=g)
    traj = torch.arange(n) % num_traj
    weight = (torch.rand(n, generator=g) < 0.75).double()
    weight[traj == num_traj - 1] = 0.0  # one sequence without trained tokens
    table = TargetTable(
        row=torch.randint(0, T, (n,), generator=g),  # rows repeat: one row serves several targets
        label=torch.randint(0, V, (n,), generator=g),
        traj=traj,
        position=torch.arange(n) + 1,
        weight=weight,
        advantage=torch.randn(n, dtype=torch.float64, generator=g),
        old_logprob=-2.4 + 0.5 * torch.randn(n, dtype=torch.float64, generator=g),
        ref_logprob=(-2.4 + 0.5 * torch.randn(n, dtype=torch.float64, generator=g)) if with_ref else None,
    )
    counts = [float(weight[traj == j].sum()) for j in range(num_traj)]
    return hidden, head, table, loss_denominators(counts)


def _subset(table: TargetTable, idx: torch.Tensor) -> TargetTable:
    return TargetTable(*(None if getattr(table, f) is None else getattr(table, f)[idx] for f in table.__dataclass_fields__))


def test_logprobs_and_entropy_match_materialised_rows():
    hidden, head, table, _ = _case()
    assert table.row.unique().numel() < table.num_targets
    lp, ent = target_logprobs(hidden, head, table.row, table.label)
    logp_NV = torch.log_softmax(hidden[table.row] @ head.T, -1)  # the expanded rows, for reference
    assert_close("logprob", lp, logp_NV[torch.arange(table.num_targets), table.label], 1e-14)
    assert_close("entropy", ent, -(logp_NV.exp() * logp_NV).sum(-1), 1e-14)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_matches_per_sequence_definition(mode):
    _, _, table, den = _case()
    values = torch.randn(table.num_targets, dtype=torch.float64)
    got = aggregate(values, table, den, mode)
    per_seq_sum, per_seq_tokens = [], []
    for j in range(den.num_sequences):
        m = table.traj == j
        per_seq_sum.append(float((values[m] * table.weight[m]).sum()))
        per_seq_tokens.append(float(table.weight[m].sum()))
    if mode == "token-mean":
        expected = sum(per_seq_sum) / sum(per_seq_tokens)
    elif mode == "seq-mean-token-sum":
        expected = np.mean(per_seq_sum)
    else:
        expected = np.mean([s / c if c else 0.0 for s, c in zip(per_seq_sum, per_seq_tokens, strict=True)])
    assert_close(mode, got, expected, 1e-14)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_microbatch_split_sums_to_full_batch(mode):
    hidden, head, table, den = _case(seed=1)
    cfg = PolicyLossConfig(agg_mode=mode, kl_coef=0.1, entropy_coef=0.01, clip_eps_high=0.28)

    def run(parts):
        h, w = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
        total = 0.0
        for idx in parts:
            out = policy_loss(h, w, _subset(table, idx), den, cfg)
            out.loss.backward()
            total += out.loss.detach()
        return total, h.grad, w.grad

    full = run([torch.arange(table.num_targets)])
    perm = torch.randperm(table.num_targets, generator=torch.Generator().manual_seed(2))
    split = run([perm[:3], perm[3:8], perm[8:]])
    assert_close("loss", split[0], full[0], 1e-14)
    assert_close("grad hidden", split[1], full[1], 1e-13)
    assert_close("grad head", split[2], full[2], 1e-13)


def test_ppo_clipping_and_k3_kl_by_hand():
    # one-row, two-label case; target log-prob is log(1/2) for both labels
    hidden = torch.zeros(1, 2, dtype=torch.float64)
    head = torch.zeros(2, 2, dtype=torch.float64)
    lp = float(np.log(0.5))
    adv = torch.tensor([1.0, -1.0, 1.0, -2.0], dtype=torch.float64)
    # ratios: 2.0 (A>0: clipped at 1.28), 2.0 (A<0: unclipped), 0.5 (A>0: unclipped), 4.0 (A<0: dual clip 3)
    old = torch.tensor([lp - np.log(2), lp - np.log(2), lp + np.log(2), lp - np.log(4)], dtype=torch.float64)
    ref = torch.full((4,), lp, dtype=torch.float64) + torch.tensor([0.0, 0.5, -0.5, 0.0], dtype=torch.float64)
    table = TargetTable(
        row=torch.zeros(4, dtype=torch.long), label=torch.tensor([0, 1, 0, 1]), traj=torch.zeros(4, dtype=torch.long),
        position=torch.arange(1, 5), weight=torch.ones(4, dtype=torch.float64), advantage=adv,
        old_logprob=old, ref_logprob=ref,
    )
    den = loss_denominators([4])
    out = policy_loss(hidden, head, table, den, PolicyLossConfig(clip_eps_high=0.28, clip_ratio_c=3.0, kl_coef=0.5))
    pg = np.array([-1.28, 2.0, -0.5, 6.0])
    delta = np.array([0.0, 0.5, -0.5, 0.0])
    kl = np.exp(delta) - delta - 1
    assert_close("pg", out.pg_loss, pg.mean(), 1e-14)
    assert_close("kl", out.kl, kl.mean(), 1e-14)
    assert_close("loss", out.loss, pg.mean() + 0.5 * kl.mean(), 1e-14)
    assert out.clip_frac.item() == pytest.approx(0.25)
    assert_close("entropy", out.entropy, np.log(2.0), 1e-14)


def test_gradcheck_policy_loss():
    hidden, head, table, den = _case(seed=3, n=8)
    cfg = PolicyLossConfig(agg_mode="seq-mean-token-mean", kl_coef=0.2, entropy_coef=0.05)
    # gradcheck needs a smooth neighbourhood: keep every ratio away from the clip edges
    with torch.no_grad():
        lp, _ = target_logprobs(hidden, head, table.row, table.label)
    table = TargetTable(**{**table.__dict__, "old_logprob": lp + 0.01})
    assert torch.autograd.gradcheck(
        lambda h, w: policy_loss(h, w, table, den, cfg).loss,
        (hidden.requires_grad_(True), head.requires_grad_(True)),
    )


def test_bad_inputs():
    hidden, head, table, den = _case(with_ref=False)
    with pytest.raises(ValueError, match="kl_coef > 0 needs reference log-probs"):
        policy_loss(hidden, head, table, den, PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="agg_mode: unknown 'seq-sum'"):
        PolicyLossConfig(agg_mode="seq-sum").validate()
    with pytest.raises(ValueError, match="non-empty"):
        loss_denominators([])
    with pytest.raises(ValueError, match=">= 0"):
        loss_denominators([3, -1])


@given(st.lists(st.integers(0, 60), max_size=200))
def test_unique_rows_equals_numpy_unique(rows):
    from harts.exec.loss import unique_rows

    a = np.asarray(rows, dtype=np.int64)
    got_u, got_i = unique_rows(a)
    want_u, want_i = np.unique(a, return_inverse=True)
    assert got_u.dtype == got_i.dtype == np.int64
    assert np.array_equal(got_u, want_u) and np.array_equal(got_i, want_i.reshape(-1))
    if a.size:
        assert np.array_equal(got_u[got_i], a)


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 9)), max_size=200))
def test_unique_pairs_index_every_target(pairs):
    """`unique_pairs`: each distinct (row index, label) once, and every target's pair is its own."""
    from harts.exec.loss import unique_pairs

    inv = np.asarray([p[0] for p in pairs], dtype=np.int64)
    lab = np.asarray([p[1] for p in pairs], dtype=np.int64)
    row_P, lab_P, pair_N = unique_pairs(inv, lab)
    assert row_P.dtype == lab_P.dtype == pair_N.dtype == np.int64
    assert len(set(zip(row_P.tolist(), lab_P.tolist(), strict=True))) == row_P.size == len(set(pairs))
    assert np.array_equal(row_P[pair_N], inv) and np.array_equal(lab_P[pair_N], lab)
