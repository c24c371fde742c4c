"""PackedContext mixes only within each packed sequence, and each mixing op matches a
straightforward per-sequence reference written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harts.exec.model import MixingContext, PackedContext
from harts.testing import assert_close

LENGTHS = [1, 7, 20, 37]  # crosses chunk size 16 and conv window 4, includes a 1-token sequence


def _ctx(chunk_size=16) -> PackedContext:
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return PackedContext(cu, chunk_size=chunk_size)


def _sequences(ctx):
    b = ctx.cu_seqlens.tolist()
    return list(zip(b[:-1], b[1:], strict=True))


def test_packed_context_fields():
    ctx = _ctx()
    assert isinstance(ctx, MixingContext)
    assert ctx.num_rows == sum(LENGTHS)
    assert ctx.position_ids.tolist() == [p for n in LENGTHS for p in range(n)]
    assert ctx.row_weight.tolist() == [1.0] * ctx.num_rows
    with pytest.raises(ValueError, match="rise strictly"):
        PackedContext(torch.tensor([0, 3, 3, 5]))
    with pytest.raises(ValueError, match="row_weight must be"):
        PackedContext(torch.tensor([0, 3]), row_weight=torch.ones(4))


def test_attention_matches_per_sequence_softmax():
    torch.manual_seed(0)
    ctx = _ctx()
    T, H, D, E = ctx.num_rows, 3, 6, 5
    q, k = torch.randn(T, H, D, dtype=torch.float64), torch.randn(T, H, D, dtype=torch.float64)
    v = torch.randn(T, H, E, dtype=torch.float64)
    out = ctx.attention(0, q, k, v, 0.3)
    expected = torch.empty_like(out)
    for s, e in _sequences(ctx):
        for t in range(s, e):
            scores_HJ = torch.einsum("hd,jhd->hj", q[t], k[s : t + 1]) * 0.3
            expected[t] = torch.einsum("hj,jhe->he", scores_HJ.softmax(-1), v[s : t + 1])
    assert_close("attention", out, expected, 1e-13)


def test_short_conv_matches_per_sequence_loop():
    torch.manual_seed(1)
    ctx = _ctx()
    T, D, W = ctx.num_rows, 5, 4
    x = torch.randn(T, D, dtype=torch.float64)
    w = torch.randn(D, W, dtype=torch.float64)
    out = ctx.short_conv(0, "q", x, w, None)
    expected = torch.empty_like(out)
    for s, e in _sequences(ctx):
        for t in range(s, e):
            acc = torch.zeros(D, dtype=torch.float64)
            for j in range(W):
                src = t - (W - 1) + j
                if src >= s:
                    acc = acc + w[:, j] * x[src]
            expected[t] = F.silu(acc)
    assert_close("short_conv", out, expected, 1e-13)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_kda_matches_per_sequence_recurrence(chunk_size):
    torch.manual_seed(2)
    ctx = _ctx(chunk_size)
    T, H, K, V = ctx.num_rows, 2, 4, 3
    q = F.normalize(torch.randn(T, H, K, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(T, H, V, dtype=torch.float64)
    g = -torch.rand(T, H, K, dtype=torch.float64)
    beta = torch.rand(T, H, dtype=torch.float64)
    out = ctx.kda(0, q, k, v, g, beta, 0.7)
    expected = torch.empty_like(out)
    eye = torch.eye(K, dtype=torch.float64)
    for s, e in _sequences(ctx):
        S = torch.zeros(H, K, V, dtype=torch.float64)
        for t in range(s, e):
            for h in range(H):
                kt = k[t, h][:, None]
                S[h] = (eye - beta[t, h] * kt @ kt.T) @ torch.diag(g[t, h].exp()) @ S[h] + beta[t, h] * kt @ v[t, h][None]
                expected[t, h] = 0.7 * S[h].T @ q[t, h]
    assert_close("kda", out, expected, 1e-12)
