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


@settings(max_examples=25, deadline=None)
@given(window=conv_windows(), D=st.integers(1, 40), bias=st.booleans(), act=st.sampled_from(["silu", None]),
       seed=st.integers(0, 2**16))
def test_fused_conv_matches_reference(window, D, bias, act, seed):
    T, W = window.shape
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    w, b = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    out = {}
    for name, fn in (("ref", short_conv), ("fused", short_conv_fused)):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(leaves[0], leaves[1], leaves[2] if bias else None, window_TW=window, activation=act)
        y.backward(dy)
        out[name] = [y.detach(), leaves[0].grad, leaves[1].grad] + ([leaves[2].grad] if bias else [])
    for name, got, want in zip(("y", "dx", "dw", "db"), out["fused"], out["ref"], strict=False):
        assert_close(name, got, want, 1e-5)


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
    y_all = short_conv_fused(x, w, b if bias else None, window_TW=window)
    out = {}
    for name, fn in (("ref", short_conv), ("fused", short_conv_fused)):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(leaves[0], leaves[1], leaves[2] if bias else None, window_TW=window[index], activation="silu")
        y.backward(dy)
        out[name] = [y.detach(), leaves[0].grad, leaves[1].grad] + ([leaves[2].grad] if bias else [])
    assert torch.equal(out["fused"][0], y_all[index])
    for name, got, want in zip(("y", "dx", "dw", "db"), out["fused"], out["ref"], strict=False):
        assert_close(name, got, want, 1e-5)
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
