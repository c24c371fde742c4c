"""l1l2's chunk-grid cuts (`CellSolver.offset_for`, memoised per node): the offset is the
largest chunk-aligned depth whose rows cost at most the amount asked for, and the cost it
reports is the cost model's own for those rows, asked again or not."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.planners.common import ForestIndex
from harts.plan.planners.l1l2 import CellSolver
from tests.plan.l1l2_cells import forest_and_config


@settings(max_examples=30, deadline=None)
@given(forest_and_config, st.data())
def test_offset_is_the_largest_chunk_cut_within_the_amount_and_its_cost_is_exact(forest_config, data):
    forest, config = forest_config
    idx = ForestIndex(forest, config.cost_model)
    solver = CellSolver(idx, config)
    cm, chunk = config.cost_model, config.chunk_size
    for _ in range(6):
        u = data.draw(st.integers(0, idx.n - 1))
        s, e = idx.start[u], idx.end[u]
        whole = float(cm.segment_cost(np.array([s]), np.array([e]))[0])
        want = data.draw(st.floats(-1.0, 1.5 * whole + 1.0, allow_nan=False))
        for _repeat in range(2):  # the second ask is answered from the memo
            o, cost = solver.offset_for(u, want)
            assert 0 <= o < max(1, e - s)
            if o == 0:
                assert cost == 0.0
            else:
                assert (s + o) % chunk == 0
                assert cost == float(cm.segment_cost(np.array([s]), np.array([s + o]))[0])
                assert cost <= want
            # no larger chunk-aligned cut inside the node fits the amount
            nxt = (s + o) // chunk * chunk + chunk if o else (s // chunk + 1) * chunk
            if nxt < e:
                assert float(cm.segment_cost(np.array([s]), np.array([nxt]))[0]) > want
