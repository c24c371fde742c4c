"""The fused short conv (Triton, the CUDA default) against the gather-form reference in
fp32 on a real tree layout, and its deterministic backward (no atomics: bits repeat)."""

from __future__ import annotations

import functools

import pytest
import torch

from harts.exec.ops.conv import short_conv, window_from_parents
from harts.exec.ops.conv.triton import short_conv_fused
from harts.tree.workload import generate, preset
from tests.cuda.conftest import TOL_BF16, assert_rel

pytestmark = pytest.mark.cuda


@functools.cache
def _window():
    f = generate(preset("swe-treestep-1")).forest()  # 82k tree rows
    return window_from_parents(torch.as_tensor(f.row_parent), 4).cuda()


def _inputs(bias: bool):
    win = _window()
    T, D = win.shape[0], 2048  # a KDA layer's q/k/v: 16 heads x 128
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(D, 4, device="cuda", generator=g) * 0.3).bfloat16().requires_grad_()
    b = (torch.randn(D, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_() if bias else None
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    return win, x, w, b, dy


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fused_conv_matches_fp32_reference(bias):
    win, x, w, b, dy = _inputs(bias)
    leaves = [t for t in (x, w, b) if t is not None]
    wide = [t.detach().float().requires_grad_() for t in leaves]
    ref_y = short_conv(wide[0], wide[1], wide[2] if bias else None, window_TW=win)
    ref = [ref_y.detach(), *torch.autograd.grad(ref_y, wide, dy.float())]
    y = short_conv_fused(x, w, b, window_TW=win)
    got = [y.detach(), *torch.autograd.grad(y, leaves, dy)]
    for name, a, r in zip(("y", "dx", "dw", "db"), got, ref, strict=False):
        assert_rel(name, a, r, TOL_BF16)


def test_fused_conv_backward_bits_repeat():
    win, x, w, b, dy = _inputs(True)
    y = short_conv_fused(x, w, b, window_TW=win)
    first = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
    again = torch.autograd.grad(y, (x, w, b), dy)
    for name, a, c in zip(("dx", "dw", "db"), first, again, strict=True):
        assert torch.equal(a, c), name
