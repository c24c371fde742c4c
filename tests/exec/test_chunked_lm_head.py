"""The chunked LM head equals the unchunked reference (float64) and never forms a
[rows, vocab] tensor."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harts.exec.loss import (
    PolicyLossConfig,
    TargetTable,
    lm_head_chunk_rows,
    loss_denominators,
    policy_loss,
    target_logprobs,
)
from harts.testing import assert_close


class LargestTensor(TorchDispatchMode):
    """Counts the largest tensor any op creates (a CPU proxy for peak activation memory)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _problem(T=37, D=6, V=53, N=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, generator=g, requires_grad=True)
    row = torch.randint(0, T, (N,), generator=g)
    label = torch.randint(0, V, (N,), generator=g)
    rng = np.random.default_rng(seed)
    table = TargetTable(row=row, label=label, traj=torch.from_numpy(rng.integers(0, 3, N)),
                        position=torch.arange(N), weight=torch.from_numpy((rng.random(N) < 0.8).astype(np.float64)),
                        advantage=torch.from_numpy(rng.normal(size=N)),
                        old_logprob=torch.from_numpy(-np.log(V) + 0.2 * rng.normal(size=N)),
                        ref_logprob=torch.from_numpy(-np.log(V) + 0.3 * rng.normal(size=N)))
    return hidden, weight, table


def _reference_and_chunked(hidden, weight, table, den, chunk_elements, **config):
    """(output, d hidden, d lm_head) of the reference LM head and of the chunked one."""
    outs = []
    for elements in (None, chunk_elements):
        cfg = PolicyLossConfig(lm_head_chunk_elements=elements, **config)
        hidden.grad = weight.grad = None
        out = policy_loss(hidden, weight, table, den, cfg)
        out.loss.backward()
        outs.append((out, hidden.grad.clone(), weight.grad.clone()))
    return outs


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 1000])
def test_chunked_equals_reference_float64(chunk_rows):
    hidden, weight, table = _problem()
    den = loss_denominators([20.0, 15.0, 13.0])
    (r, rh, rw), (c, ch, cw) = _reference_and_chunked(hidden, weight, table, den, chunk_rows * 53, kl_coef=0.1,
                                                      entropy_coef=0.05, agg_mode="seq-mean-token-mean")
    assert_close("logprob", c.logprob_N, r.logprob_N, 1e-12)
    assert_close("entropy", c.entropy_N, r.entropy_N, 1e-12)
    for key in ("loss", "pg_loss", "kl", "entropy"):
        assert_close(key, getattr(c, key), getattr(r, key), 1e-12)
    assert_close("d hidden", ch, rh, 1e-12)
    assert_close("d lm_head", cw, rw, 1e-12)


def test_entropy_gradient_only_with_an_entropy_bonus():
    hidden, weight, table = _problem()
    unique = torch.unique(table.row, return_inverse=True)
    for entropy_grad in (False, True):
        lp, ent = target_logprobs(hidden, weight, table.row, table.label, entropy_grad=entropy_grad,
                                  unique=unique, chunk_rows=4)
        assert lp.requires_grad and ent.requires_grad == entropy_grad
        lp_ref, ent_ref = target_logprobs(hidden, weight, table.row, table.label, entropy_grad=entropy_grad,
                                          unique=unique)
        if entropy_grad:
            g = torch.autograd.grad(ent.sum(), (hidden, weight))
            g_ref = torch.autograd.grad(ent_ref.sum(), (hidden, weight))
            for a, b in zip(g, g_ref, strict=True):
                assert_close("entropy grad", a, b, 1e-12)


@pytest.mark.parametrize("T,V", [(64, 512), (256, 2048), (512, 4096)])
def test_largest_tensor_does_not_grow_with_rows_times_vocab(T, V):
    budget = 4 * 4096  # logits per chunk (the [vocab, D] weight gradient is no larger here)
    hidden, weight, table = _problem(T=T, D=4, V=V, N=2 * T, seed=1)
    den = loss_denominators([float(T)] * 3)
    cfg = PolicyLossConfig(entropy_coef=0.01, lm_head_chunk_elements=budget)
    with LargestTensor() as mode:
        policy_loss(hidden, weight, table, den, cfg).loss.backward()
    assert mode.largest <= budget  # one chunk's logits, never [rows, vocab]
    with LargestTensor() as ref:
        policy_loss(hidden, weight, table, den, PolicyLossConfig(entropy_coef=0.01,
                                                                 lm_head_chunk_elements=None)).loss.backward()
    rows = int(torch.unique(table.row).numel())
    assert ref.largest >= rows * V > budget  # the reference forms the full log-softmax


def test_chunk_rows_rule():
    assert lm_head_chunk_rows(100, 1000, None) is None
    assert lm_head_chunk_rows(100, 1000, 10**5) is None  # fits: one unchunked pass
    assert lm_head_chunk_rows(100, 1000, 10**4) == 10
    assert lm_head_chunk_rows(131072, 163840, 1 << 27) == 819
    with pytest.raises(ValueError, match="lm_head_chunk_elements"):
        PolicyLossConfig(lm_head_chunk_elements=0).validate()


@pytest.mark.parametrize("host_pairs", [False, True])
def test_chunked_with_shared_rows_and_labels_equals_reference(host_pairs):
    """Targets as a tree gives them: many per row, mostly with the row's one next token, a
    few rows with several labels (forks). The label logit is formed once per (row, label)
    pair (pairs from `TargetTable.to` on the host, or from the targets on the device);
    log-probs, losses and both gradients equal the reference's in float64."""
    hidden, weight, _ = _problem(N=1)
    g = torch.Generator().manual_seed(5)
    T, V = hidden.shape[0], weight.shape[0]
    rows = torch.randint(0, T, (400,), generator=g)
    nxt = torch.randint(0, V, (T,), generator=g)
    labels = torch.where(torch.rand(400, generator=g) < 0.85, nxt[rows], torch.randint(0, V, (400,), generator=g))
    rng = np.random.default_rng(5)
    table = TargetTable(row=rows, label=labels, traj=torch.from_numpy(rng.integers(0, 3, 400)),
                        position=torch.arange(400), weight=torch.from_numpy((rng.random(400) < 0.8) * 1.0),
                        advantage=torch.from_numpy(rng.normal(size=400)),
                        old_logprob=torch.from_numpy(-np.log(V) + 0.2 * rng.normal(size=400)))
    if host_pairs:
        table = table.to("cpu")
        assert table.pair_row is not None and table.pair_row.numel() < 400
    den = loss_denominators([150.0, 120.0, 100.0])
    (r, rh, rw), (c, ch, cw) = _reference_and_chunked(hidden, weight, table, den, 7 * V, entropy_coef=0.05)
    assert_close("logprob", c.logprob_N, r.logprob_N, 1e-12)
    assert_close("loss", c.loss, r.loss, 1e-12)
    assert_close("d hidden", ch, rh, 1e-12)
    assert_close("d lm_head", cw, rw, 1e-12)
