"""The step as placements (cell, first slot), scored by the joint re-cut's linear program
without re-cutting (`Columns.score`): the slot balance the re-cut could reach with these
cells where they are. The tree swaps and the window search score their candidates so."""

from __future__ import annotations

import math

import numpy as np
from scipy.sparse import csr_matrix

from harts.plan.planners.l1l2.cell import Cell
from harts.plan.planners.l1l2.lp import LinearProgram, LPBackend, solve
from harts.plan.planners.l1l2.recut import window_ranges
from harts.plan.planners.l1l2.solver import CellSolver

# a cell formed while searching has at most this many slots
SA_MAX_K = 4
# bisection steps of the re-cuts that give a window's ranges (`window_ranges`) while
# searching and when the result is re-cut (fewer are cheaper but give narrower ranges,
# which lose most of the search's gain)
SA_STEPS = 12


class Columns:
    """The step as placements (cell, first slot) over S slots and dp replicas, scored by
    the joint re-cut's linear program (`recut`, one round, the critical path capped): the
    slot balance the re-cut can reach with these cells where they are."""

    def __init__(self, rows: list[list[Cell]], solver: CellSolver, crit: float):
        self.solver = solver
        self.dp = len(rows)
        self.S = sum(c.k for c in rows[0])
        self.crit = crit
        self.info: dict[int, tuple[Cell, list[float], list[tuple[float, float]] | None, float]] = {}
        self.P: list[tuple[Cell, int]] = []
        for row in rows:
            s0 = 0
            for c in row:
                self.reg(c)
                self.P.append((c, s0))
                s0 += c.k

    def reg(self, c: Cell) -> bool:
        """Cell c's loads and re-cut ranges, noted once; False when c cannot be placed (a
        window that does not fill its slots)."""
        got = self.info.get(id(c))
        if got is None:
            ld = self.solver.loads(c)
            movable = c.k >= 2 and bool(c.trees) and all(c.bins)
            rg = window_ranges(self.solver, c, SA_STEPS) if movable else None
            if rg is not None:
                # the cell's own loads are in reach (coarse ranges may fall short of them)
                rg = [(min(lo, x), max(hi, x)) for (lo, hi), x in zip(rg, ld, strict=True)]
            got = self.info[id(c)] = (c, ld, rg, sum(ld))
        return True

    def cell_for(self, k: int, trees: list[int]) -> Cell | None:
        """The solved cell of k slots holding `trees` (every slot used), or None."""
        solver = self.solver
        idx = solver.idx
        trees = sorted(trees, key=lambda r: (-idx.sub_cost[r], r))
        if not trees or k > SA_MAX_K:
            return None
        # an exact rejection before solving: k consumers hold at most budget - rho x the
        # producer's tokens each, the producer at most the budget
        tok = sum(idx.sub_rows[t] for t in trees)
        if tok > (k + max(0.0, 1.0 - k * solver.rho)) * solver.budget:
            return None
        c = solver.solved(k, trees)
        if c is None or len(c.bins) != k or not all(c.bins):
            return None
        self.reg(c)
        if k >= 2 and self.info[id(c)][2] is None:
            return None
        return c

    def score(self, P: list[tuple[Cell, int]], aims: dict | None = None) -> float:
        """The slot balance of the re-cut LP's loads for placements P (-1 when the LP
        fails): one round of `recut`'s program, weights at P's own peaks, built as arrays
        and solved by GLOP (OR-Tools' model builder). `aims`, when given, receives each
        window's LP loads by its index in P."""
        S, dp, info = self.S, self.dp, self.info
        cols: list[list[float]] = [[] for _ in range(S)]
        wins = []
        at_p = []
        for t, (c, s) in enumerate(P):
            _, ld, rg, total = info[id(c)]
            if rg is None:
                for j, x in enumerate(ld):
                    cols[s + j].append(x)
            else:
                wins.append((s, ld, rg, total))
                at_p.append(t)
        fixedmax = [max(col) if col else 0.0 for col in cols]
        peak = list(fixedmax)
        for s, ld, _, _ in wins:
            for j, x in enumerate(ld):
                if x > peak[s + j]:
                    peak[s + j] = x
        w = [1.0 / max(p, 1e-9) for p in peak]
        # the program as arrays (one sparse matrix, built row by row in lists): variables
        # are the S peaks, then each window's first k - 1 slot loads; rows the critical
        # path cap, then per window its last slot under the peak (`top`), its last slot
        # within range (`tail`), and each other slot under its peak
        inf = math.inf
        nv = S + sum(len(rg) - 1 for _, _, rg, _ in wins)
        lb = [0.0] * nv
        ub = [inf] * nv
        obj = [0.0] * nv
        lb[:S] = fixedmax
        obj[:S] = w
        indptr, indices, data = [0, S], list(range(S)), [1.0] * S
        clo, cup = [-inf], [self.crit]
        at = S
        for s, _, rg, total in wins:
            k = len(rg)
            last = s + k - 1
            vs = list(range(at, at + k - 1))
            for j in range(k - 1):
                lb[at + j], ub[at + j] = rg[j]
                obj[at + j] = (w[last] - w[s + j]) / dp
            indices += [last, *vs]
            data += [-1.0] * k
            indptr.append(len(indices))
            clo.append(-inf)
            cup.append(-total)
            indices += vs
            data += [1.0] * (k - 1)
            indptr.append(len(indices))
            clo.append(total - rg[-1][1])
            cup.append(total - rg[-1][0])
            for j in range(k - 1):
                indices += [s + j, at + j]
                data += [-1.0, 1.0]
                indptr.append(len(indices))
                clo.append(-inf)
                cup.append(0.0)
            at += k - 1
        mat = csr_matrix((np.array(data), np.array(indices, dtype=np.int32), np.array(indptr, dtype=np.int32)),
                         shape=(len(clo), nv))
        got = solve(LinearProgram(np.array(obj), np.array(lb), np.array(ub), mat, np.array(clo), np.array(cup)),
                    LPBackend.GLOP)
        if got is None:
            return -1.0
        sol = got.tolist()
        at = S
        for t, (s, _, rg, total) in zip(at_p, wins, strict=True):
            k = len(rg)
            z = sol[at : at + k - 1]
            at += k - 1
            for j, x in enumerate(z):
                cols[s + j].append(x)
            cols[s + k - 1].append(total - sum(z))
            if aims is not None:
                aims[t] = [*z, total - sum(z)]
        return sum(sum(col) / dp / max(col) if max(col) > 0 else 1.0 for col in cols) / S

    def rows(self, P: list[tuple[Cell, int]]) -> list[list[Cell]] | None:
        """Placements back to replicas' rows (each placement on a replica whose slots so
        far end where it starts), or None when they do not tile dp x S."""
        rows: list[list[Cell]] = [[] for _ in range(self.dp)]
        free = [0] * self.dp
        for c, s in sorted(P, key=lambda p: (p[1], -p[0].k)):
            r = next((q for q in range(self.dp) if free[q] == s), None)
            if r is None:
                return None
            rows[r].append(c)
            free[r] = s + c.k
        return rows if all(f == self.S for f in free) else None
