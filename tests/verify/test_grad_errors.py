"""`equivalence._grad_errors` (per parameter on the device) against the numpy definitions
`max_rel` / `rms_rel` over the gradients as host arrays."""

import math

import numpy as np
import torch

from harts.verify.equivalence import _grad_errors, max_rel, rms_rel


class _Two(torch.nn.Module):
    def __init__(self, grads):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3))
        self.b = torch.nn.Parameter(torch.zeros(2, 2))
        self.a.grad, self.b.grad = grads


def test_grad_errors_match_the_numpy_definitions():
    g = torch.Generator().manual_seed(0)
    ref = _Two((torch.randn(3, generator=g), torch.zeros(2, 2)))  # b: zero reference gradient
    got = _Two((torch.randn(3, generator=g), torch.full((2, 2), 1e-3)))
    per, rms = _grad_errors(ref, got)
    assert per["a"] == max_rel(got.a.grad.numpy(), ref.a.grad.numpy())
    assert per["b"] == math.inf  # a difference against an all-zero reference
    flat = lambda m: np.concatenate([m.a.grad.numpy().ravel(), m.b.grad.numpy().ravel()])  # noqa: E731
    assert math.isclose(rms, rms_rel(flat(got), flat(ref)), rel_tol=1e-12) and math.isfinite(rms)
    got.a.grad[0] = float("nan")
    per, rms = _grad_errors(ref, got)
    assert per["a"] == math.inf and rms == math.inf
