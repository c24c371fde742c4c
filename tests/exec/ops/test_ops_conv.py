"""Gather-form short convolution against the per-sequence conv1d reference: packed sequences
(with and without carried state) and rollout trees (each row against its root path run as a
plain sequence), on outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harts.exec.ops.conv import (
    final_conv_state,
    naive_short_conv,
    short_conv,
    short_conv_varlen,
    window_from_cu_seqlens,
    window_from_parents,
)
from harts.testing import assert_close

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
DTYPES = [torch.float64, torch.float32]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@st.composite
def parent_arrays(draw, max_rows: int = 40):
    """Random forests: every row's parent is an earlier row or -1 (a root)."""
    T = draw(st.integers(1, max_rows))
    return [draw(st.integers(-1, t - 1)) for t in range(T)]


@st.composite
def conv_setups(draw):
    D = draw(st.integers(1, 6))
    W = draw(st.integers(1, 5))
    return dict(
        D=D,
        W=W,
        seed=draw(st.integers(0, 2**31 - 1)),
        bias=draw(st.booleans()),
        activation=draw(st.sampled_from(["silu", None])),
    )


def _tensors(T, N, D, W, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(
        x=make(T, D),
        weight=make(D, W),
        bias=make(D),
        h0=make(N, D, max(W - 1, 0)),
        dy=make(T, D),
        dh=make(N, D, max(W - 1, 0)),
    )


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, materialize_grads=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_name)
@given(
    setup=conv_setups(),
    lens=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    with_state=st.booleans(),
)
def test_varlen_matches_naive(dtype, setup, lens, with_state):
    lens = [max(lens[0], 1), *lens[1:]]
    D, W = setup["D"], setup["W"]
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    data = _tensors(T, N, D, W, setup["seed"], dtype)
    names = ["x", "weight"] + ["bias"] * setup["bias"] + ["h0"] * with_state

    def run(fn):
        leaves = {n: data[n].clone().requires_grad_() for n in names}
        y, final = fn(
            leaves["x"],
            leaves["weight"],
            leaves.get("bias"),
            cu_seqlens=cu,
            initial_state=leaves.get("h0"),
            activation=setup["activation"],
        )
        loss = (y * data["dy"]).sum() + (final * data["dh"]).sum()
        return y, final, _grads(loss, list(leaves.values()))

    y, final, grads = run(lambda *a, **kw: short_conv_varlen(*a, **kw, output_final_state=True))
    y_ref, final_ref, grads_ref = run(naive_short_conv)
    assert y.dtype == dtype
    assert_close("y", y, y_ref, TOL[dtype])
    if final_ref.any():
        assert_close("final_state", final, final_ref, TOL[dtype])
    else:
        assert not final.any()
    for name, got, ref in zip(names, grads, grads_ref, strict=True):
        assert_close(f"d{name}", got, ref, TOL[dtype])


def _root_path(parent: list[int], row: int) -> list[int]:
    path = [row]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_name)
@given(setup=conv_setups(), parent=parent_arrays())
def test_tree_matches_root_paths(dtype, setup, parent):
    """Row r of the tree equals position depth(r) of the plain convolution of r's root path
    (as in every trajectory through r); gradients equal those of computing each row once,
    from one such path, and summing."""
    D, W = setup["D"], setup["W"]
    T = len(parent)
    data = _tensors(T, 1, D, W, setup["seed"], dtype)
    names = ["x", "weight"] + ["bias"] * setup["bias"]

    leaves = {n: data[n].clone().requires_grad_() for n in names}
    window = window_from_parents(torch.tensor(parent), W)
    y = short_conv(
        leaves["x"],
        leaves["weight"],
        leaves.get("bias"),
        window_TW=window,
        activation=setup["activation"],
    )
    grads = _grads((y * data["dy"]).sum(), list(leaves.values()))

    ref = {n: data[n].clone().requires_grad_() for n in names}
    rows_ref = []
    for r in range(T):
        path = _root_path(parent, r)
        y_path, _ = naive_short_conv(
            ref["x"][path], ref["weight"], ref.get("bias"), activation=setup["activation"]
        )
        rows_ref.append(y_path[-1])
    y_ref = torch.stack(rows_ref)
    grads_ref = _grads((y_ref * data["dy"]).sum(), list(ref.values()))
    assert_close("y", y, y_ref, TOL[dtype])
    for name, got, want in zip(names, grads, grads_ref, strict=True):
        assert_close(f"d{name}", got, want, TOL[dtype])


@given(lens=st.lists(st.integers(0, 10), min_size=1, max_size=5), W=st.integers(1, 6))
def test_chain_parents_give_sequence_windows(lens, W):
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    parent = torch.arange(T) - 1
    parent[cu[:-1][cu[:-1] < T]] = -1
    assert torch.equal(window_from_parents(parent, W), window_from_cu_seqlens(cu, W, T))


@given(setup=conv_setups(), length=st.integers(1, 30), cut=st.integers(0, 30))
def test_carried_state_handoff(setup, length, cut):
    """Cut a sequence anywhere and carry final_conv_state into the rest: the pre-activation
    float32 outputs are the same bits. After SiLU they are only close: torch's CPU SiLU
    rounds differently in its vectorised body and its scalar tail, so an element's bits
    depend on where it sits in the tensor (measured: 1 ulp, AVX512, torch 2.13)."""
    cut = min(cut, length)
    D, W = setup["D"], setup["W"]
    data = _tensors(length, 1, D, W, setup["seed"], torch.float32)
    x, weight = data["x"], data["weight"]
    bias = data["bias"] if setup["bias"] else None
    for activation in (None, setup["activation"]):
        kw = dict(activation=activation, output_final_state=True)
        whole, whole_final = short_conv_varlen(x, weight, bias, **kw)
        head, state = short_conv_varlen(x[:cut], weight, bias, **kw)
        tail, tail_final = short_conv_varlen(x[cut:], weight, bias, initial_state=state, **kw)
        if activation is None:
            assert torch.equal(torch.cat([head, tail]), whole)
        else:
            assert_close("y after handoff", torch.cat([head, tail]), whole, TOL[torch.float32])
        assert torch.equal(tail_final, whole_final)
    assert torch.equal(final_conv_state(x, torch.tensor([0, cut, length]), W)[0], state[0])


def test_window_semantics_and_errors():
    cu = torch.tensor([0, 2, 5])
    assert window_from_cu_seqlens(cu, 3, 5).tolist() == [
        [-1, -1, 0],
        [-1, 0, 1],
        [-1, -1, 2],
        [-1, 2, 3],
        [2, 3, 4],
    ]
    # carried state: rows T + n*(W-1) + j, j = 0 oldest
    assert window_from_cu_seqlens(cu, 3, 5, with_initial_state=True).tolist() == [
        [5, 6, 0],
        [6, 0, 1],
        [7, 8, 2],
        [8, 2, 3],
        [2, 3, 4],
    ]
    assert window_from_parents(torch.tensor([-1, 0, 1, 1, 0]), 3).tolist() == [
        [-1, -1, 0],
        [-1, 0, 1],
        [0, 1, 2],
        [0, 1, 3],
        [-1, 0, 4],
    ]
    x, w = torch.randn(5, 2), torch.randn(2, 3)
    with pytest.raises(ValueError):
        short_conv(x, w, window_TW=torch.full((5, 3), 5))
    with pytest.raises(ValueError):
        window_from_parents(torch.tensor([-1, 7]), 3)
    with pytest.raises(ValueError):
        window_from_cu_seqlens(torch.tensor([0, 4]), 3, 5)

