"""FlexAttention ancestor attention on CPU: the block mask from DFS intervals against the dense
ancestor mask, and the (eager) attention output against dense-mask SDPA. FlexAttention has
no backward on CPU; its gradients are checked on the GPU (tests/cuda/test_attention.py)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.exec.ops.attention.flex import (
    attended_pairs,
    tree_attention,
    tree_block_mask,
    tree_block_tables,
)
from harts.testing import assert_close
from harts.tree import build_forest
from harts.tree.workload import generate_trajectories


def _layout(name, seed):
    f = build_forest(generate_trajectories(name, seed=seed))
    return torch.as_tensor(f.row_end), f.num_rows


def _dense(end, q_local):
    L = end.numel()
    k = torch.arange(L)
    return (k[None, :] <= q_local[:, None]) & (q_local[:, None] <= end[None, :])


@pytest.mark.parametrize("name,seed,bs,subset", [("tiny-treestep", 0, 16, False), ("tiny-stepwise", 1, 32, False),
                                                  ("tiny-treestep", 2, 16, True)])
def test_block_classes_agree_with_the_dense_mask(name, seed, bs, subset):
    end, L = _layout(name, seed)
    rng = np.random.default_rng(seed)
    q_local = torch.as_tensor(np.sort(rng.choice(L, L // 3, replace=False))) if subset else torch.arange(L)
    t = tree_block_tables(end, q_local if subset else None, bs)
    dense = _dense(end, q_local)
    C = q_local.numel()
    pad = torch.zeros(t["full"].shape[0] * bs, t["full"].shape[1] * bs, dtype=torch.bool)
    pad[:C, :L] = dense
    blocks = pad.view(t["full"].shape[0], bs, t["full"].shape[1], bs)
    any_QK, real = blocks.any(3).any(1), torch.zeros_like(pad)
    real[:C, :L] = True
    all_QK = (blocks | ~real.view_as(blocks)).all(3).all(1)
    assert not (t["full"] & t["partial"]).any()
    assert torch.equal(t["full"] & ~all_QK, torch.zeros_like(t["full"]))  # full blocks are fully allowed
    assert not (any_QK & ~(t["full"] | t["partial"])).any()  # every allowed pair is in a kept block
    assert t["full"].any() and t["partial"].any()


@pytest.mark.parametrize("subset", [False, True])
def test_flex_tree_attention_matches_dense_sdpa(subset):
    end, L = _layout("tiny-treestep", 3)
    g = torch.Generator().manual_seed(0)
    q_local = torch.as_tensor(np.sort(np.random.default_rng(1).choice(L, L // 2, replace=False))) if subset else torch.arange(L)
    C, H = q_local.numel(), 2
    q = torch.randn(C, H, 24, generator=g, dtype=torch.float64)
    k = torch.randn(L, H, 24, generator=g, dtype=torch.float64)
    v = torch.randn(L, H, 16, generator=g, dtype=torch.float64)
    bm = tree_block_mask(end, q_local if subset else None, 16)
    o = tree_attention(q, k, v, 0.2, bm, compiled=False)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=_dense(end, q_local), scale=0.2).transpose(0, 1)
    assert torch.isfinite(o).all()
    assert_close("o", o, ref, 1e-12)

def test_attended_pairs_counts_the_dense_mask():
    end, L = _layout("tiny-stepwise", 0)
    assert attended_pairs(end) == int(_dense(end, torch.arange(L)).sum())
