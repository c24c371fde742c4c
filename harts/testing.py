"""Numerical comparison helpers shared by every test (fla `utils/_testing.py` style).

Errors are relative RMS: ||a - b|| / ||b||, so a tolerance means the same thing for any
shape. NaN or inf anywhere fails loudly; a reference that is all zeros is refused, since a
comparison against zeros would pass an output that was never written.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        return x.numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def rel_err(actual: Any, expected: Any) -> float:
    """Relative RMS error ||actual - expected|| / ||expected|| (inf if either has NaN/inf)."""
    a, e = _to_numpy(actual), _to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {a.shape} vs {e.shape}")
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        return float("inf")
    denom = np.linalg.norm(e)
    num = np.linalg.norm(a - e)
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / denom)


def assert_close(name: str, actual: Any, expected: Any, tol: float) -> float:
    """Assert relative RMS error <= tol; returns the error for reporting."""
    e = _to_numpy(expected)
    if e.size and not np.any(e):
        raise AssertionError(f"{name}: reference is all zeros; the comparison would prove nothing")
    err = rel_err(actual, expected)
    if not err <= tol:
        raise AssertionError(f"{name}: relative RMS error {err:.3e} > {tol:.1e}")
    return err
