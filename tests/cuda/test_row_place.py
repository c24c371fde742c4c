"""`RowPlace` on CUDA in bf16, in each of its three forms (the `cat` alone, a `cat` and a
row gather, the own rows gathered with the few others written over them), at a
consumer's size: values and gradients bit-identical to the advanced indexing it replaces
(rows are copied, never summed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.exec.ops.gather import RowPlace
from tests.exec.test_window_fast import _reference

pytestmark = pytest.mark.cuda


def _layout(form, rng, L=12000, n_ctx=3000):
    if form == "cat":  # context rows first, every stashed row read in order
        return np.arange(n_ctx, L), np.arange(n_ctx), np.arange(n_ctx), n_ctx
    if form == "cat-gather":  # context rows interleaved, some stashed rows unread
        perm = rng.permutation(L)
        src_rows = rng.permutation(n_ctx + 500)[:n_ctx]
        return np.sort(perm[n_ctx:]), np.sort(perm[:n_ctx]), src_rows, n_ctx + 500
    # own-first: a few replayed context rows among the own ones, and a few zero rows
    perm = rng.permutation(L)
    return np.sort(perm[:L - 120]), np.sort(perm[L - 120:L - 20]), np.arange(100), 100


@pytest.mark.parametrize("form", ["cat", "cat-gather", "own-first"])
def test_row_place_forms_bit_identical_on_cuda(form):
    rng = np.random.default_rng(0)
    own_at, src_at, src_rows, num_src = _layout(form, rng)
    L = 12000
    place = RowPlace(L, own_at, src_at, src_rows, num_src, "cuda")
    assert (place.in_place, place.own_first) == {"cat": (True, False), "cat-gather": (False, False),
                                                 "own-first": (False, True)}[form]
    g = torch.Generator(device="cuda").manual_seed(1)
    src = torch.randn(num_src, 8, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    own = torch.randn(own_at.size, 8, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    (got,) = place((src,), (own,))
    want = _reference(L, own_at, src_at, src_rows, src, own)
    assert torch.equal(got, want)
    w = torch.randn(got.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    for a, b in zip(torch.autograd.grad((got.float() * w).sum(), (src, own)),
                    torch.autograd.grad((want.float() * w).sum(), (src, own)), strict=True):
        assert torch.equal(a, b)
