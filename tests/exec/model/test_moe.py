"""MoE routing, occurrence weighting (row_weight) and token dropping, against direct references."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.config.models import ConfigError
from harts.exec.model import PackedContext
from harts.exec.model.moe import MoE
from harts.testing import assert_close


@dataclass
class RowsContext:
    """Token-wise rows with weights (what a tree context gives the MoE); no token dropping."""

    row_weight: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_weight.numel()


def _moe(make_config, **changes) -> MoE:
    torch.manual_seed(0)
    moe = MoE(make_config(aux_loss_coef=0.01, **changes)).to(torch.float64)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def _expert(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ moe.w_gate[e].T) * (x @ moe.w_up[e].T)) @ moe.w_down[e].T


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_outputs_and_aux_match_dense_reference(make_config, router):
    moe = _moe(make_config, router=router)
    T, E, k = 11, moe.num_experts, moe.top_k
    x = torch.randn(T, 32, dtype=torch.float64)
    w = torch.tensor([1, 2, 1, 3, 1, 1, 5, 1, 1, 2, 1], dtype=torch.float64)
    y, aux, load = moe(x, RowsContext(w))

    logits = (x @ moe.router.weight.T).detach().numpy()
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores = scores / scores.sum(-1, keepdims=True) if router == "softmax" else 1 / (1 + np.exp(-logits))
    probs = scores / scores.sum(-1, keepdims=True)
    expected_y = torch.zeros_like(x)
    sel = np.zeros((T, E))
    for t in range(T):
        top = np.argsort(-scores[t], kind="stable")[:k]
        sel[t, top] = 1
        for e in top:
            weight = scores[t, e] / scores[t, top].sum()
            expected_y[t] += weight * _expert(moe, int(e), x[t : t + 1])[0]
    expected_y += moe.shared(x)
    wn = w.numpy()
    f = (wn[:, None] * sel).sum(0) / (k * wn.sum())
    P = (wn[:, None] * probs).sum(0) / wn.sum()
    assert_close("moe output", y, expected_y, 1e-13)
    assert_close("aux loss", aux, 0.01 * E * (f * P).sum(), 1e-13)
    assert_close("expert load", load, (wn[:, None] * sel).sum(0), 0.0)


def test_row_weight_two_equals_duplicated_row(make_config):
    moe = _moe(make_config)
    x = torch.randn(5, 32, dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 1.0, 1.0, 2.0], dtype=torch.float64)
    dup = torch.tensor([0, 1, 1, 2, 3, 4, 4])
    x_leaf = x.clone().requires_grad_(True)
    y_w, aux_w, load_w = moe(x_leaf, RowsContext(w))
    aux_w.backward()
    grad_router_w = moe.router.weight.grad.clone()
    moe.zero_grad()
    y_d, aux_d, load_d = moe(x[dup], RowsContext(torch.ones(7, dtype=torch.float64)))
    aux_d.backward()
    assert_close("aux", aux_w, aux_d, 1e-14)
    assert torch.equal(load_w, load_d)
    assert_close("rows", y_w[dup], y_d, 1e-14)
    assert_close("aux grad wrt router", grad_router_w, moe.router.weight.grad, 1e-13)


def test_token_dropping_only_where_rows_are_tokens(make_config):
    moe = _moe(make_config, capacity_factor=0.5)
    T = 16
    x = torch.randn(T, 32, dtype=torch.float64)
    with pytest.raises(ConfigError, match="token dropping is not allowed with RowsContext"):
        moe(x, RowsContext(torch.ones(T, dtype=torch.float64)))
    y, _, load = moe(x, PackedContext(torch.tensor([0, T])))
    # reference: keep each expert's first `capacity` assignments in row order
    capacity = int(np.ceil(0.5 * T * moe.top_k / moe.num_experts))
    _, top_i, top_w = moe.route(x)
    expected = moe.shared(x)
    seen = [0] * moe.num_experts
    dropped = 0
    for t in range(T):
        for j in range(moe.top_k):
            e = int(top_i[t, j])
            seen[e] += 1
            if seen[e] <= capacity:
                expected[t] = expected[t] + top_w[t, j] * _expert(moe, e, x[t : t + 1])[0]
            else:
                dropped += 1
    assert dropped > 0
    assert_close("dropped output", y, expected, 1e-13)
    assert load.sum().item() == T * moe.top_k  # statistics count routing before dropping


# --- grouped experts (the GPU path) against the per-expert loop reference ---------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harts.exec.ops.moe import experts_loop, grouped_mm_reference  # noqa: E402
from harts.exec.ops.moe.grouped import experts_grouped  # noqa: E402


def _routing(T: int, E: int, k: int, D: int, F_: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    scores = torch.randn(T, E, generator=g, dtype=torch.float64)
    top_s, top_i = torch.topk(scores.softmax(-1), k, dim=-1)
    top_w = top_s / top_s.sum(-1, keepdim=True)
    ws = [torch.randn(E, F_, D, generator=g, dtype=torch.float64) * 0.3,
          torch.randn(E, F_, D, generator=g, dtype=torch.float64) * 0.3,
          torch.randn(E, D, F_, generator=g, dtype=torch.float64) * 0.3]
    return x, top_i, top_w, ws


@settings(deadline=None)
@given(T=st.integers(1, 40), E=st.integers(1, 9), k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_grouped_experts_match_loop_outputs_and_gradients(T, E, k, seed):
    """The grouped path's sorting, slot gathers and weighted sum, in float64 with the
    reference grouped product, equal the per-expert loop: output and the gradients of x,
    every expert weight and the routing weights (experts that get no rows included)."""
    k = min(k, E)
    D, F_ = 16, 8
    x, top_i, top_w, ws = _routing(T, E, k, D, F_, seed)
    dy = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, top_w, *ws)]
        y = fn(leaves[0], top_i, leaves[1], *leaves[2:])
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    ref = run(experts_loop)
    got = run(lambda *a: experts_grouped(*a, mm=grouped_mm_reference))
    for name, a, b in zip(("y", "dx", "dtop_w", "dw_gate", "dw_up", "dw_down"), got, ref, strict=True):
        if b.abs().max() > 0:
            assert_close(name, a, b, 1e-12)
        else:
            assert not a.abs().max() > 0


@settings(deadline=None)
@given(N=st.integers(1, 40), G=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_torch_grouped_mm_matches_reference(N, G, seed):
    """torch's grouped_mm (fp32 on CPU) against the float64 per-group product, output and
    both gradients, with transposed weight views as experts_grouped passes them."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(N, 16, generator=g, dtype=torch.float64)
    b = torch.randn(G, 8, 16, generator=g, dtype=torch.float64)
    cuts = torch.sort(torch.randint(0, N + 1, (G - 1,), generator=g)).values
    offs = torch.cat([cuts, torch.tensor([N])]).to(torch.int32)
    dy = torch.randn(N, 8, generator=g, dtype=torch.float64)
    out = {}
    for name, mm, dtype in (("ref", grouped_mm_reference, torch.float64), ("torch", F.grouped_mm, torch.float32)):
        aa, bb = a.detach().to(dtype).clone().requires_grad_(), b.detach().to(dtype).clone().requires_grad_()
        y = mm(aa, bb.transpose(-2, -1), offs=offs)
        y.backward(dy.to(dtype))
        out[name] = [y.detach(), aa.grad, bb.grad]
    for name, got, want in zip(("y", "da", "db"), out["torch"], out["ref"], strict=True):
        if want.abs().max() > 0:
            assert_close(name, got.double(), want, 1e-5)
        else:
            assert not got.abs().max() > 0


def test_grouped_experts_bf16_close_to_loop():
    """bf16 (the dtype the CUDA kernels run) stays within bf16 rounding of the reference."""
    x, top_i, top_w, ws = _routing(64, 8, 2, 32, 16, 0)
    ref = experts_loop(x, top_i, top_w, *ws)
    got = experts_grouped(x.bfloat16(), top_i, top_w.bfloat16(), *(w.bfloat16() for w in ws))
    rel = (got.double() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


def test_moe_picks_reference_off_cuda():
    from harts.exec.backend import Impl, moe_impl

    assert moe_impl(torch.device("cpu"), torch.bfloat16) is Impl.REFERENCE
    assert moe_impl(torch.device("cuda"), torch.float64) is Impl.REFERENCE
