"""The norms' fast path (torch's fused RMSNorm, harts/exec/ops/norm/fused.py) against the
references (naive.py): in float64 the same values and gradients (of the input and the
weight) to rounding; in float32 and bf16 as near float64 as the reference is. And which
path each call takes: the fused kernel on CUDA in bf16/fp16/fp32 unless norm=reference
or force_reference, the reference elsewhere."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from harts.config.kernels import Impl, KernelConfig, NormKernel
from harts.exec import backend
from harts.exec.model.layers import GatedRMSNorm, RMSNorm, l2_norm_of
from harts.exec.ops.norm.fused import l2_norm_fused, rms_norm_fused
from harts.exec.ops.norm.naive import l2_norm, rms_norm
from harts.exec.ops.record import KernelRecord
from tests.strategies import norm_cases


def _inputs(case, dtype=torch.float64):
    lead, D, scale, eps, seed = case
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, D, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    dy = torch.randn(*lead, D, generator=g, dtype=torch.float64).to(dtype)
    return x, w, dy, eps


def _value_and_grads(fn, x, w, dy):
    y = fn(x, w)
    grads = torch.autograd.grad((y * dy).sum(), (x, w) if w is not None else (x,), allow_unused=True)
    return (y, *grads)


@settings(deadline=None, max_examples=40)
@given(norm_cases())
def test_fused_rms_norm_is_the_reference_in_float64(case):
    x, w, dy, eps = _inputs(case)
    for float32 in (False, True):
        got = _value_and_grads(lambda a, b, f=float32: rms_norm_fused(a, b, eps, f), x, w, dy)
        want = _value_and_grads(lambda a, b, f=float32: rms_norm(a, b, eps, f), x, w, dy)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * max(1.0, float(b.detach().abs().max())))


@settings(deadline=None, max_examples=40)
@given(norm_cases())
def test_fused_l2_norm_is_the_reference_in_float64(case):
    x, _, dy, eps = _inputs(case)
    got = _value_and_grads(lambda a, _b: l2_norm_fused(a, eps), x, None, dy)
    want = _value_and_grads(lambda a, _b: l2_norm(a, eps), x, None, dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * max(1.0, float(b.detach().abs().max())))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["rms", "l2"])
def test_fused_norms_are_as_near_float64_as_the_references(dtype, which):
    """In the dtypes people train in the fused form rounds differently (once, in float32),
    and lands at least as near the float64 value as the reference, on values and gradients."""
    case = ((512,), 128, 3.0, 1e-6, 7)
    x64, w64, dy64, eps = _inputs(case)
    x, w, dy, _ = _inputs(case, dtype)
    if which == "rms":
        fused = _value_and_grads(lambda a, b: rms_norm_fused(a, b, eps, True), x, w, dy)
        ref = _value_and_grads(lambda a, b: rms_norm(a, b, eps, True), x, w, dy)
        exact = _value_and_grads(lambda a, b: rms_norm(a, b, eps), x64, w64, dy64)
    else:
        fused = _value_and_grads(lambda a, _b: l2_norm_fused(a, eps), x, None, dy)
        ref = _value_and_grads(lambda a, _b: l2_norm(a, eps), x, None, dy)
        exact = _value_and_grads(lambda a, _b: l2_norm(a, eps), x64, None, dy64)
    for f, r, e in zip(fused, ref, exact, strict=True):
        err_f = float((f.detach().double() - e).norm() / e.norm())
        err_r = float((r.detach().double() - e).norm() / e.norm())
        assert err_f <= 1.25 * err_r + 1e-7, (err_f, err_r)
        assert err_f < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fused_kernel_runs_on_cuda_in_training_dtypes(dtype):
    cuda = torch.device("cuda")
    assert backend.norm_impl(cuda, dtype, KernelConfig()) is Impl.FUSED
    assert backend.norm_impl(cuda, dtype, KernelConfig(norm="reference")) is Impl.REFERENCE
    assert backend.norm_impl(cuda, dtype, KernelConfig(force_reference=True)) is Impl.REFERENCE
    assert backend.norm_impl(torch.device("cpu"), dtype, KernelConfig()) is Impl.REFERENCE
    assert backend.norm_impl(cuda, torch.float64, KernelConfig()) is Impl.REFERENCE


def test_norm_setting_reads_its_variable(monkeypatch):
    monkeypatch.setenv("HARTS_NORM", "reference")
    assert KernelConfig.from_env().norm is NormKernel.REFERENCE
    monkeypatch.setenv("HARTS_NORM", "fast")
    with pytest.raises(ValueError, match="HARTS_NORM"):
        KernelConfig.from_env()


def test_norm_modules_record_what_they_ran():
    """The modules run the context's pick and note it in the context's record; without a
    context, the defaults (the reference, on the CPU)."""

    class Ctx:
        kernels = KernelConfig()
        kernel_record = KernelRecord()

    ctx = Ctx()
    x = torch.randn(5, 16, dtype=torch.float64)
    norm, gated = RMSNorm(16, 1e-6).double(), GatedRMSNorm(16, 1e-6).double()
    torch.testing.assert_close(norm(x, ctx), norm(x), rtol=0, atol=0)
    gated(x, x, ctx)
    l2_norm_of(x, ctx)
    assert ctx.kernel_record.ran == {"rms_norm": {"reference"}, "l2_norm": {"reference"}}
