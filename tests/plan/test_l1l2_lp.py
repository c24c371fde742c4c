"""l1l2's one LP interface (`lp.solve`): both back ends (HiGHS through SciPy, GLOP through
OR-Tools' model builder) read the same `LinearProgram`, agree on whether it has an
optimum and on its objective value, and return points within its bounds and rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from scipy.sparse import csr_matrix

from harts.plan.planners.l1l2.lp import LinearProgram, LPBackend, solve
from tests.strategies import bounded_linear_programs


def _feasible(lp: LinearProgram, x: np.ndarray, tol: float = 1e-6) -> bool:
    ax = np.asarray(lp.matrix @ x).ravel()
    return bool(np.all(x >= lp.lower - tol) and np.all(x <= lp.upper + tol)
                and np.all(ax >= lp.row_lo - tol) and np.all(ax <= lp.row_hi + tol))


@settings(max_examples=60, deadline=None)
@given(bounded_linear_programs())
def test_back_ends_agree(parts):
    obj, lower, upper, mat, row_lo, row_hi = parts
    dense = LinearProgram(obj, lower, upper, mat, row_lo, row_hi)
    sparse = LinearProgram(obj, lower, upper, csr_matrix(mat), row_lo, row_hi)
    got = {(b, kind): solve(lp, b) for b in LPBackend for kind, lp in (("dense", dense), ("sparse", sparse))}
    found = {k: x is not None for k, x in got.items()}
    assert len(set(found.values())) == 1, found
    values = [float(obj @ x) for x in got.values() if x is not None]
    for x in got.values():
        if x is not None:
            assert x.shape == (len(obj),)
            assert _feasible(dense, x)
    if values:
        assert max(values) - min(values) <= 1e-6 * (1 + abs(min(values)))


def test_infeasible_has_no_optimum():
    # x <= 1 and x >= 2
    lp = LinearProgram(np.array([1.0]), np.array([0.0]), np.array([5.0]), np.array([[1.0], [1.0]]),
                       np.array([-np.inf, 2.0]), np.array([1.0, np.inf]))
    for b in LPBackend:
        assert solve(lp, b) is None
    with pytest.raises(ValueError, match="unknown LP back end"):
        solve(lp, "simplex")
