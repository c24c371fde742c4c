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
from tests.strategies import conv_setups, parent_arrays

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}  # relative RMS


def _silu_bounds(activation: str | None) -> tuple[float, float]:
    """(max |act'|, max |act''|): SiLU' lies in [-0.1, 1.1], |SiLU''| <= 0.5; identity 1, 0."""
    return (1.1, 0.5) if activation == "silu" else (1.0, 0.0)


def _error_scales(run_reference, data64: dict, activation: str | None):
    """Per-entry error scales for every output of the short conv: the reference (float64) run
    on |inputs| with no activation, which sums the absolute values of the terms each output
    (and each gradient) adds up, so it has no cancellation.

    Forward: y = act(b + sum_w x*w), so |y error| <= max|act'| * sum|terms|. Backward: every
    gradient sums terms dpre * (x or w or 1) with dpre = dy * act'(pre); dpre's own error is
    <= |dy| * (max|act''| * |pre error| + rounding), which the upstream magnitude
    u = |dy| * (max|act'| + max|act''| * sum|pre terms|) covers (pre error <= n eps sum|terms|).
    Returns (y_scale, final_scale, grad_scales) in the order run_reference returns them."""
    d1, d2 = _silu_bounds(activation)
    absolute = {n: v.abs() for n, v in data64.items()}
    with torch.no_grad():
        pre_abs, _ = run_reference(absolute, None, None, None, forward_only=True)
    upstream = absolute["dy"] * (d1 + d2 * pre_abs)
    _, final_abs, grads_abs = run_reference(absolute, None, upstream, absolute.get("dh"))
    return d1 * pre_abs, final_abs, grads_abs


def _term_counts(T: int, W: int) -> tuple[int, int]:
    """(n for y, n for every gradient) in the bound below. y sums W taps and the bias; +3 for
    the activation's rounding. Each gradient entry sums <= T terms (dbias/dweight over rows;
    dx of a row over the windows that hold it, at most once each, so <= T), plus W + 4 for
    the error of dpre carried into every term (pre's own W + 1 terms, act' rounding)."""
    return W + 4, T + W + 4


def assert_within_error_bound(name: str, got, ref64, scale, n_terms: int, dtype: torch.dtype) -> None:
    """|got - ref64| <= 4 * eps(dtype) * n_terms * scale for every entry.

    The classic bound for a sum of n products in floating point is |error| <= n * eps *
    sum|terms| (Higham, recursive summation; blocked or pairwise orders only lower it), so
    this holds for any summation order and any draw, including sums whose terms cancel to a
    result far below sum|terms| (where a relative-to-result tolerance is flaky: a float32
    dbias of 1e-5 relative RMS was exceeded). The factor 4 covers the activation's rounding
    and the float64 reference's own error (equal to the op's in a float64 run). A wrong or
    missing term (one window tap off) moves an entry by about sum|terms| / n_terms, i.e.
    1/(4 eps n^2) >= 800 times this bound in float32 at the drawn sizes (n <= 49)."""
    eps = torch.finfo(dtype).eps
    err = (got.detach().double() - ref64.detach()).abs()
    bound = 4 * eps * n_terms * scale.detach()
    if err.numel():
        assert scale.any(), f"{name}: every term is zero; the comparison would prove nothing"
    ok = err <= bound
    if not bool(ok.all()):
        ratio = (err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
        raise AssertionError(f"{name}: error exceeds the {dtype} error bound {ratio:.3g}x (n_terms={n_terms})")
DTYPES = [torch.float64, torch.float32]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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

    def run(fn, tensors, activation, dy, dh, forward_only=False):
        leaves = {n: tensors[n].clone().requires_grad_(not forward_only) for n in names}
        y, final = fn(
            leaves["x"],
            leaves["weight"],
            leaves.get("bias"),
            cu_seqlens=cu,
            initial_state=leaves.get("h0"),
            activation=activation,
        )
        if forward_only:
            return y, final
        loss = (y * dy).sum() + (final * dh).sum()
        return y, final, _grads(loss, list(leaves.values()))

    def reference(tensors, activation, dy, dh, forward_only=False):
        return run(naive_short_conv, tensors, activation, dy, dh, forward_only)

    op = lambda *a, **kw: short_conv_varlen(*a, **kw, output_final_state=True)  # noqa: E731
    act = setup["activation"]
    y, final, grads = run(op, data, act, data["dy"], data["dh"])
    data64 = {n: v.double() for n, v in data.items()}
    y_ref, final_ref, grads_ref = reference(data64, act, data64["dy"], data64["dh"])
    y_scale, final_scale, grad_scales = _error_scales(reference, data64, act)
    n_y, n_grad = _term_counts(T, W)
    assert y.dtype == dtype
    assert_within_error_bound("y", y, y_ref, y_scale, n_y, dtype)
    if final_ref.any():
        assert_within_error_bound("final_state", final, final_ref, final_scale, n_y, dtype)
    else:
        assert not final.any()
    for name, got, ref, scale in zip(names, grads, grads_ref, grad_scales, strict=True):
        assert_within_error_bound(f"d{name}", got, ref, scale, n_grad, dtype)


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

    act = setup["activation"]
    leaves = {n: data[n].clone().requires_grad_() for n in names}
    window = window_from_parents(torch.tensor(parent), W)
    y = short_conv(leaves["x"], leaves["weight"], leaves.get("bias"), window_TW=window, activation=act)
    grads = _grads((y * data["dy"]).sum(), list(leaves.values()))

    def reference(tensors, activation, dy, _dh, forward_only=False):
        ref = {n: tensors[n].clone().requires_grad_(not forward_only) for n in names}
        rows_ref = []
        for r in range(T):
            path = _root_path(parent, r)
            y_path, _ = naive_short_conv(ref["x"][path], ref["weight"], ref.get("bias"), activation=activation)
            rows_ref.append(y_path[-1])
        y_ref = torch.stack(rows_ref)
        if forward_only:
            return y_ref, None
        return y_ref, None, _grads((y_ref * dy).sum(), list(ref.values()))

    data64 = {n: v.double() for n, v in data.items()}
    y_ref, _, grads_ref = reference(data64, act, data64["dy"], None)
    y_scale, _, grad_scales = _error_scales(reference, data64, act)
    n_y, n_grad = _term_counts(T, W)
    assert_within_error_bound("y", y, y_ref, y_scale, n_y, dtype)
    for name, got, want, scale in zip(names, grads, grads_ref, grad_scales, strict=True):
        assert_within_error_bound(f"d{name}", got, want, scale, n_grad, dtype)


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

