"""The fused short-conv Triton kernels under TRITON_INTERPRET=1 against the gather-form
reference: outputs and the gradients of x, weight and bias on tree windows (forks, roots)
and packed-sequence windows; and the output of a row depends only on its window (a tree
row and the same token in its trajectory get the same bits)."""


from tests.exec.gpu import interpret_triton  # noqa: E402

interpret_triton()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harts.exec.ops.conv import short_conv, window_from_cu_seqlens, window_from_parents  # noqa: E402
from harts.exec.ops.conv.triton import short_conv_fused, window_inverse  # noqa: E402
from harts.testing import assert_close  # noqa: E402
from tests.strategies import conv_windows  # noqa: E402

# float32 sums are accurate to a few units of rounding of the sum of their terms' magnitudes,
# not of their result: a bias gradient of four terms of ~0.5 that cancel to 1e-4 carries a
# relative error of ~1e-4 in any float32 order (the reference's own was 5e-5 on such a
# draw). The fused kernel is held to TOL x that magnitude, element by element, against the
# reference in float64.
TOL = 1e-5
SILU_SLOPE = 1.1  # |d silu(z) / dz| <= 1.1 for every z


def _check_against_float64(fused, x, w, b, dy, window, bias, act):
    """The fused kernel's float32 (y, dx, dw, db) against the reference in float64: each
    element within TOL x the magnitude of the terms its sum adds (`_magnitudes`)."""
    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    y = short_conv(leaves[0], leaves[1], leaves[2] if bias else None, window_TW=window, activation=act)
    y.backward(dy.double())
    want = [y.detach(), leaves[0].grad, leaves[1].grad] + ([leaves[2].grad] if bias else [])
    for name, got, ref, scale in zip(("y", "dx", "dw", "db"), fused, want,
                                     _magnitudes(x, w, b if bias else torch.zeros_like(b), dy, window, act),
                                     strict=False):
        err = (got.double() - ref).abs()
        worst = float((err - TOL * scale).max())
        assert worst <= 0.0, (name, float(err.max()), float(scale.max()))


def _magnitudes(x, w, b, dy, window, act):
    """Per element of y, dx, dw and db: the sum of the magnitudes of the terms it adds
    (the activation's slope bounded by SILU_SLOPE), in float64."""
    slope = SILU_SLOPE if act == "silu" else 1.0
    x, w, b, dy = (t.double().abs() for t in (x, w, b, dy))
    ok = window >= 0
    xw = torch.where(ok[..., None], x[window.clamp(min=0)], 0.0)  # [n, W, D]
    y = slope * ((xw * w.T[None]).sum(1) + b)
    dw = slope * (dy[:, None, :] * xw).sum(0).T  # [D, W]
    db = slope * dy.sum(0)
    dx = torch.zeros_like(x)
    dx.index_add_(0, window[ok], slope * (dy[:, None, :] * w.T[None]).expand(-1, window.shape[1], -1)[ok])
    return y, dx, dw, db


@settings(max_examples=25, deadline=None)
@given(window=conv_windows(), D=st.integers(1, 40), bias=st.booleans(), act=st.sampled_from(["silu", None]),
       seed=st.integers(0, 2**16))
def test_fused_conv_matches_reference(window, D, bias, act, seed):
    T, W = window.shape
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    w, b = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = short_conv_fused(leaves[0], leaves[1], leaves[2] if bias else None, window_TW=window, activation=act)
    y.backward(dy)
    fused = [y.detach(), leaves[0].grad, leaves[1].grad] + ([leaves[2].grad] if bias else [])
    _check_against_float64(fused, x, w, b, dy, window, bias, act)


@settings(max_examples=40, deadline=None)
@given(window=conv_windows(), BT=st.sampled_from([1, 2, 4, 32]))
def test_window_inverse_lists_every_reader_in_order(window, BT):
    """For every row t, the pairs (r, j) with window[r, j] = t, sorted by r then j, and each
    tile's trip count the most pairs of any of its rows."""
    T, W = window.shape
    ptr, ref, col, tile_pairs = window_inverse(window, BT)
    assert ptr.tolist()[0] == 0 and ptr.tolist()[-1] == int((window >= 0).sum())
    counts = []
    for t in range(T):
        want = [(r, j) for r in range(T) for j in range(W) if int(window[r, j]) == t]
        got = list(zip(ref[ptr[t]:ptr[t + 1]].tolist(), col[ptr[t]:ptr[t + 1]].tolist(), strict=True))
        assert got == want
        counts.append(len(want))
    for i, n in enumerate(tile_pairs.tolist()):
        assert n == max(counts[i * BT:(i + 1) * BT])


@pytest.mark.parametrize("tiles", [None, (16, 16, 2, 2, 8, 2)])
def test_fused_conv_backward_on_a_bushy_tree_over_several_programs(tiles):
    """Rows read by many branches (a root with 12 children, forks inside) and enough rows
    that the weight gradient is summed from several programs' partials; the default tiles
    and a tile override (KernelConfig.conv_bwd_tiles)."""
    import functools

    torch.manual_seed(1)
    g = torch.Generator().manual_seed(3)
    parent = [-1, 0, 1]
    for _ in range(12):  # 12 branches off row 2, each a chain with a fork in its middle
        start = len(parent)
        parent += [2] + list(range(start, start + 20))
        parent += [start + 10] + list(range(len(parent), len(parent) + 15))
    window = window_from_parents(torch.tensor(parent), 4)
    T, D = window.shape[0], 6
    assert T > 8 * 32 and int(window_inverse(window, 32)[3].max()) > 4
    x, dy = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    w, b = torch.randn(D, 4, generator=g), torch.randn(D, generator=g)
    out = {}
    fused = functools.partial(short_conv_fused, bwd_tiles=tiles)
    for name, fn in (("ref", short_conv), ("fused", fused)):
        leaves = [t.clone().double().requires_grad_() if name == "ref" else t.clone().requires_grad_()
                  for t in (x, w, b)]
        y = fn(*leaves, window_TW=window, activation="silu")
        y.backward(dy.double() if name == "ref" else dy)
        out[name] = [y.detach(), *(t.grad for t in leaves)]
    for name, got, want in zip(("y", "dx", "dw", "db"), out["fused"], out["ref"], strict=True):
        assert_close(name, got.double(), want, 1e-5)


def test_a_rows_output_depends_only_on_its_window():
    """The same token in a tree (after a fork) and alone in a packed sequence: same bits."""
    torch.manual_seed(0)
    D, W = 24, 4
    # tree: 0-1-2 shared, then 3-4 and 5-6 branch off row 2
    parent = torch.tensor([-1, 0, 1, 2, 3, 2, 5])
    x_tree = torch.randn(7, D)
    w, b = torch.randn(D, W), torch.randn(D)
    y_tree = short_conv_fused(x_tree, w, b, window_TW=window_from_parents(parent, W))
    # the trajectory through 5-6 as one packed sequence, after an unrelated one
    other = torch.randn(3, D)
    x_seq = torch.cat([other, x_tree[[0, 1, 2, 5, 6]]])
    y_seq = short_conv_fused(x_seq, w, b, window_TW=window_from_cu_seqlens(torch.tensor([0, 3, 8]), W, 8))
    assert torch.equal(y_tree[[0, 1, 2, 5, 6]], y_seq[3:])


@settings(max_examples=25, deadline=None)
@given(window=conv_windows(), D=st.integers(1, 24), bias=st.booleans(), data=st.data(), seed=st.integers(0, 2**16))
def test_fused_conv_writes_any_order_of_its_rows(window, D, bias, data, seed):
    """A window over another order of the rows, some repeated and some left out (a tree's
    KDA rounds: replayed rows twice): output row i is row index[i]'s, with the same bits,
    and x's gradient sums every reader of a row (the inverse built for x's row count)."""
    T, W = window.shape
    index = torch.tensor(data.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=2 * T + 2)))
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(T, D, generator=g), torch.randn(index.numel(), D, generator=g)
    w, b = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    y_all = short_conv_fused(x, w, b if bias else None, window_TW=window, activation="silu")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = short_conv_fused(leaves[0], leaves[1], leaves[2] if bias else None, window_TW=window[index],
                         activation="silu")
    y.backward(dy)
    fused = [y.detach(), leaves[0].grad, leaves[1].grad] + ([leaves[2].grad] if bias else [])
    assert torch.equal(fused[0], y_all[index])
    _check_against_float64(fused, x, w, b, dy, window[index], bias, "silu")
    ptr = window_inverse(window[index], 4, T)[0]
    assert ptr.numel() == T + 1 and int(ptr[-1]) == int((window[index] >= 0).sum())


def test_fused_conv_rejects_bad_shapes():
    with pytest.raises(ValueError, match="expected weight"):
        short_conv_fused(torch.zeros(3, 4), torch.zeros(4, 2), None, window_TW=torch.zeros(3, 3, dtype=torch.int64))


def test_backend_picks_the_fused_kernels_on_cuda_unless_told():
    from harts.config.kernels import KernelConfig
    from harts.exec import backend

    assert backend.conv_impl(torch.device("cuda"), KernelConfig()) is backend.Impl.TRITON
    assert backend.conv_impl(torch.device("cpu"), KernelConfig()) is backend.Impl.REFERENCE
    assert backend.conv_impl(torch.device("cuda"), KernelConfig(conv="reference")) is backend.Impl.REFERENCE
    assert backend.conv_impl(torch.device("cuda"), KernelConfig(force_reference=True)) is backend.Impl.REFERENCE
