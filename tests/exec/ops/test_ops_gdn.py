"""Gated DeltaNet ops: the chunkwise form against the token-by-token reference on outputs and
every gradient, both against fla-core's own naive reference (run in float64), and the
identity the tree executor relies on: GDN is KDA with the decay broadcast along K, so the KDA
chunk form (and with it the KDA tree machinery) computes GDN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec.ops.gdn import chunk_gdn, naive_recurrent_gdn
from harts.exec.ops.kda import chunk_kda
from harts.testing import assert_close
from tests.models.float64_reference import float64_module
from tests.strategies import gdn_problems, trajectory_sets

NAMES = ["q", "k", "v", "g", "beta", "h0"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make(lens, H, K, V, seed, with_h0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    q = F.normalize(torch.randn(T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(T, H, generator=gen, dtype=dtype) * 0.7
    beta = torch.rand(T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(N, H, K, V, generator=gen, dtype=dtype) * 0.3 if with_h0 else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    ins = [x.requires_grad_() for x in (q, k, v, g, beta)] + ([h0.requires_grad_()] if with_h0 else [])
    return ins, cu


def _run(fn, ins, cu, seed, **kw):
    q, k, v, g, beta, *rest = ins
    o, final = fn(q, k, v, g, beta, initial_state=rest[0] if rest else None, cu_seqlens=cu, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() \
        + (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
    return o, final, torch.autograd.grad(loss, ins)


def _compare(label, a, b, tol):
    (oa, fa, ga), (ob, fb, gb) = a, b
    assert_close(f"{label} o", oa, ob, tol)
    assert_close(f"{label} final_state", fa, fb, tol)
    for name, x, y in zip(NAMES, ga, gb, strict=False):
        if not y.any():
            # e.g. one-token sequences from a zero state: the decay touches no state; other
            # algorithms round to a few ulps of zero
            assert float(x.abs().max()) < 1e-14, f"{label} d{name} should be zero"
        else:
            assert_close(f"{label} d{name}", x, y, tol)


@settings(max_examples=25, deadline=None)
@given(gdn_problems(), st.sampled_from([4, 16, 64]))
def test_chunk_matches_naive_outputs_and_gradients(p, chunk_size):
    ins, cu = make(*p)
    ours = _run(chunk_gdn, ins, cu, p[4], chunk_size=chunk_size)
    ref = _run(naive_recurrent_gdn, ins, cu, p[4])
    assert ours[0].dtype == torch.float64
    _compare("chunk vs naive", ours, ref, 1e-12)


def _fla_naive(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
    """fla-core's naive recurrent GDN ([B, T, H, *], one call per sequence), in float64."""
    import fla.ops.gated_delta_rule.naive as fla_naive

    outs, finals = [], []
    with float64_module(fla_naive):
        for n in range(cu_seqlens.numel() - 1):
            a, b = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
            h0 = None if initial_state is None else initial_state[n : n + 1]
            o, h = fla_naive.naive_recurrent_gated_delta_rule(
                q[None, a:b], k[None, a:b], v[None, a:b], beta[None, a:b], g[None, a:b],
                initial_state=h0, output_final_state=True)
            outs.append(o[0])
            finals.append(h[0])
    return torch.cat(outs), torch.stack(finals)


@settings(max_examples=15, deadline=None)
@given(gdn_problems(max_len=24))
def test_naive_matches_fla_naive_reference(p):
    ins, cu = make(*p)
    ours = _run(naive_recurrent_gdn, ins, cu, p[4])
    ref = _run(_fla_naive, ins, cu, p[4])
    assert ref[0].dtype == torch.float64
    _compare("naive vs fla naive", ours, ref, 1e-12)


@settings(max_examples=20, deadline=None)
@given(gdn_problems(), st.sampled_from([4, 16]))
def test_kda_with_broadcast_decay_is_gdn(p, chunk_size):
    """The tree executor runs GDN layers as KDA with g [T, H] broadcast to [T, H, K]."""
    ins, cu = make(*p)
    K = ins[0].shape[-1]

    def as_kda(q, k, v, g, beta, initial_state=None, cu_seqlens=None):
        out = chunk_kda(q, k, v, g[:, :, None].expand(*g.shape, K), beta, initial_state=initial_state,
                        cu_seqlens=cu_seqlens, chunk_size=chunk_size)
        return out.o, out.final_state

    _compare("kda(broadcast g) vs gdn", _run(as_kda, ins, cu, p[4]), _run(naive_recurrent_gdn, ins, cu, p[4]), 1e-12)


def test_inputs_are_checked():
    (q, k, v, g, beta), cu = make([5], 1, 4, 3, 0, False)
    with pytest.raises(ValueError, match="g must be"):
        naive_recurrent_gdn(q, k, v, g[:, :, None], beta)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gdn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gdn(q, k, v, g, beta, initial_state=torch.zeros(2, 1, 4, 3, dtype=q.dtype))


def test_fla_path_refuses_cpu():
    from harts.exec.ops.gdn.fla import chunk_gdn_fla

    (q, k, v, g, beta), _ = make([5], 1, 4, 3, 0, False)
    with pytest.raises(ValueError, match="CUDA"):
        chunk_gdn_fla(q, k, v, g, beta)


@settings(max_examples=10, deadline=None)
@given(trajectory_sets(max_len=30), st.sampled_from([4, 8]), st.sampled_from(["replay", "node"]),
       st.integers(0, 2**16))
def test_tree_context_runs_gdn_as_each_trajectory_alone(trajs, chunk, mode, seed):
    """GDN through the tree's KDA rounds (g broadcast along K) against the GDN reference run
    on every trajectory alone: outputs and every input gradient, float64."""
    from harts.exec.tree import TreeContext
    from harts.tree import build_forest

    forest = build_forest(trajs)
    R, H, K, V = forest.num_rows, 2, 4, 3
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(R, H, K, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(R, H, K, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    v = torch.randn(R, H, V, generator=gen, dtype=torch.float64).requires_grad_()
    g = (-torch.rand(R, H, generator=gen, dtype=torch.float64) * 0.7).requires_grad_()
    beta = torch.rand(R, H, generator=gen, dtype=torch.float64).requires_grad_()
    ins = [q, k, v, g, beta]
    rows = torch.as_tensor(forest.traj_rows)
    w = torch.randn(int(rows.numel()), H, V, dtype=torch.float64, generator=gen)
    ctx = TreeContext(forest, chunk_size=chunk, kda_mode=mode)
    o_tree = ctx.kda(0, q, k, v, g[:, :, None].expand(R, H, K), beta, K**-0.5)[rows]
    o_alone, _ = naive_recurrent_gdn(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                     cu_seqlens=torch.as_tensor(forest.traj_offsets))
    assert_close("o", o_tree, o_alone, 1e-12)
    grads_tree = torch.autograd.grad((o_tree * w).sum(), ins)
    grads_alone = torch.autograd.grad((o_alone * w).sum(), ins)
    for name, a, b in zip("q k v g beta".split(), grads_tree, grads_alone, strict=True):
        if not b.any():
            assert float(a.abs().max()) < 1e-14, name
        else:
            assert_close(f"d{name}", a, b, 1e-10)
