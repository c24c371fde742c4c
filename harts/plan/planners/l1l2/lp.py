"""One interface to the two linear-program back ends the planner uses.

The joint re-cut (`recut`) solves a dense program a few times per plan with HiGHS through
SciPy; the window search and tree swaps (`Columns.score`) solve a small sparse program
per candidate, thousands of times, where OR-Tools' GLOP through its model builder avoids
SciPy's per-call overhead. Both read the same `LinearProgram`:

    minimise objective @ x  subject to  row_lo <= matrix @ x <= row_hi,  lower <= x <= upper
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from ortools.linear_solver.python import model_builder_helper as mbh
from scipy.optimize import linprog
from scipy.sparse import csr_matrix, issparse, vstack


class LPBackend(StrEnum):
    HIGHS = "highs"  # scipy.optimize.linprog(method="highs")
    GLOP = "glop"  # OR-Tools' model builder, GLOP


@dataclass(frozen=True, eq=False)
class LinearProgram:
    """A linear program in bounded-row form; infinite bounds are absent bounds. `matrix`
    is dense or a `scipy.sparse.csr_matrix` (one row per constraint)."""

    objective: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    matrix: np.ndarray | csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray


def solve(lp: LinearProgram, backend: LPBackend) -> np.ndarray | None:
    """The optimal x, or None when the back end reports no optimum."""
    if backend == LPBackend.HIGHS:
        return _highs(lp)
    if backend == LPBackend.GLOP:
        return _glop(lp)
    raise ValueError(f"unknown LP back end {backend!r}; known: {', '.join(b.value for b in LPBackend)}")


def _highs(lp: LinearProgram) -> np.ndarray | None:
    # linprog takes A_ub x <= b_ub: rows bounded above pass as they are, rows bounded
    # below follow negated
    a, lo, hi = lp.matrix, np.asarray(lp.row_lo), np.asarray(lp.row_hi)
    up, down = np.isfinite(hi), np.isfinite(lo)
    a_ub = a if up.all() else a[up]
    b_ub = hi if up.all() else hi[up]
    if down.any():
        a_ub = vstack([a_ub, -a[down]]).tocsr() if issparse(a) else np.vstack([a_ub, -a[down]])
        b_ub = np.concatenate([b_ub, -lo[down]])
    bounds = [(float(x), None if np.isposinf(y) else float(y))
              for x, y in zip(lp.lower, lp.upper, strict=True)]
    res = linprog(lp.objective, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    return res.x if res.status == 0 else None


def _glop(lp: LinearProgram) -> np.ndarray | None:
    mat = lp.matrix if issparse(lp.matrix) else csr_matrix(lp.matrix)
    model = mbh.ModelBuilderHelper()
    model.fill_model_from_sparse_data(lp.lower, lp.upper, lp.objective, lp.row_lo, lp.row_hi, mat)
    solver = mbh.ModelSolverHelper("glop")
    solver.solve(model)
    if solver.status() != mbh.SolveStatus.OPTIMAL:
        return None
    return np.asarray(solver.variable_values())
