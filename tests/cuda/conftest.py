"""GPU correctness tests (the `cuda` marker): the fast kernels against float64 references,
bit-identity claims, and tree/expanded equivalence on a CUDA device.

    python3 -m pytest -q -m cuda tests/cuda
    HARTS_TEST_NO_AUTOTUNE=1 python3 -m pytest -q -m cuda tests/cuda   # no Triton tuning

The default run (`python3 -m pytest -q`) deselects them (pyproject: addopts -m "not cuda").
Selected on a machine without CUDA they fail, loudly, rather than skip: a green run must
mean they ran. Float32 tolerances assume float32 dots in Triton kernels as true fp32
(TRITON_F32_DEFAULT=ieee), which the session sets before any kernel compiles.
"""

from __future__ import annotations

import os

import pytest
import torch

# tolerances, relative L2 error against float64 (tests/cuda/common.rel):
# float32 kernels: 1e-4 (fp32 rounding through chunked recurrences and two-pass softmax);
# bf16 kernels: one bf16 epsilon, 2**-7 (inputs rounded to bf16 already differ by ~2**-9)
TOL_F32 = 1e-4
TOL_BF16 = 2.0**-7


@pytest.fixture(autouse=True, scope="session")
def cuda_device():
    if not torch.cuda.is_available():
        pytest.fail("tests/cuda need a CUDA device; on a machine without one run the default "
                    "`python3 -m pytest -q` (which deselects them)", pytrace=False)
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if os.environ.get("HARTS_TEST_NO_AUTOTUNE") == "1":
        # each Triton autotuner takes its first config that fits, untimed (the GPU suites'
        # --no-autotune): fla's KDA kernels otherwise tune every config at their first use,
        # minutes on a fresh machine; the tests check values, which every config computes
        from benchmarks.gpu.common import no_autotune

        no_autotune()
    return torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b, in float64 (inf where a is not finite)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_rel(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = rel(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
