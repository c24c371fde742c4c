"""`l1l2`: HARTS level 1 + level 2, a step plan that computes every row of the forest once
and gives every slot the same load on every replica.

Level 1 (`l1`) fixes how many slots a compression-oriented packing needs, recomputing the
rows a tree's pieces share. Level 2 rebuilds the step around *sharing windows*: each
replica's S slots are cut into *cells* (runs of consecutive slots); a cell holds whole
trees, and its *producer* (trunk nodes of split trees and DFS prefixes shaved off its
items) runs once, its rows read as context by the cell's consumers. A tree never leaves
its cell and a cell has one producer, so the compression is the forest's own; shaving
prefixes into the producer is what levels the slots, since the producer's forward and
backward land on the window's first and last slots.

The stages (`pipeline.STAGES`, in this order):

1. `choose.choose_cells`: slot count S and cells per replica m minimising the critical
   path sum_s max_r load(s, r) (pipelined with pp > 1); trees dealt to cells
   (`cells`), each cell solved and levelled (`solver.CellSolver`, `fill`); on one replica
   without a pipeline, where slot loads only add up, filled for the lowest peak memory
   instead (`CellSolver.sequential`).
2. `relevel.line_up` (pp = 1): whole cells moved within and between replicas
   (`arrange`); off the ideal path, windows re-cut toward the other replicas' slots and
   slots handed between windows (`relevel`).
3. `recut.recut_windows` (off ideal): every window's slot loads re-cut at once by a
   linear program (`lp`) toward balanced slots, the path capped.
4. `merge.merge_single_trees` (off ideal): runs of single trees merged into windows,
   arranged and re-cut; kept when better balanced.
5. `swap.swap_cells_trees` (off ideal): single trees swapped between cells, scored by
   the re-cut's LP (`columns`).
6. `anneal.anneal_windows` (off ideal, opt-in by `PlanConfig.search_evaluations`):
   cells re-formed by a seeded simulated annealing, kept only where the layout still wins
   once both are repacked as `finish` repacks them.

Every stage after the first keeps trees, slot counts and every-row-once, and takes a
change only when the critical path is no longer (and, for 3-6, the slot balance higher).
`pipeline.finish` repacks each window into as few slots as fit, its producer computing
items whole (`absorb.take_into_producers`, one replica without a pipeline), and lets L1's
own plan compete on the same measure, so l1l2 never compresses worse than l1 nor uses
more slots. KDA replay is not counted: shaved prefixes
end on the chunk grid.

A tree over the budget that no one-window cell holds (a trunk whose branches do not fit
beside its retained rows: `nested_trees`) would leave the whole forest to L1's
recomputation; `make_plan` runs it as nested windows instead (`chains.chain_windows`,
every row once) where that plan's step load is lighter than l1l2's own, even where its
windows take more slots.
"""

from harts.plan.planners.l1l2.cell import Cell, Item
from harts.plan.planners.l1l2.pipeline import (
    STAGES,
    finish,
    nested_trees,
    plan_l1l2,
    plan_with,
    run,
)
from harts.plan.planners.l1l2.solver import CellSolver
from harts.plan.planners.l1l2.state import Candidate, Context, Stage, State

__all__ = [
    "STAGES",
    "Candidate",
    "Cell",
    "CellSolver",
    "Context",
    "Item",
    "Stage",
    "State",
    "finish",
    "nested_trees",
    "plan_l1l2",
    "plan_with",
    "run",
]
