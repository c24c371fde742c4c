"""What a chain of windows keeps is linear in its length: a trajectory of n budgets' pieces
(n = 4..6, one chain, the 2-layer CPU model) retains in each window a stash bounded by a
constant times its producer's own rows, whatever the number of pieces below it, so the
sum over the chain grows with n, not n^2. Each piece's stash holds only rows it computed;
the rows above it are read from its producers' stashes (harts.exec.stash.ChainStash).
Before, a piece at depth d copied the rows of the d pieces above it into its own stash
(per window 24,832 + 14,336 d bytes here)."""

from __future__ import annotations

import pytest
import torch

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import build_model
from harts.exec.window import PlanTrainer
from harts.plan.planners import make_plan
from harts.tree import build_forest
from tests.strategies import long_chain_trajectories

CHUNK = 8
BUDGET = 24  # pieces of 16 rows
PIECE = 16
SLACK = 1.25  # a window may keep this much more per row than the chain's first


def _windows(n: int):
    (traj,) = long_chain_trajectories(PIECE * n, [], seed=1)[:1]
    # pieces of `piece_tokens` rows throughout (the producer charge alone): equal pieces
    plan = make_plan(build_forest([traj]), "l1l2", PlanConfig(microbatch_tokens=BUDGET, chunk_size=CHUNK,
                                                              chain_retention=None))
    assert len(plan.microbatches) == n
    cfg = get_model_config("tiny-cpu").replace(num_layers=2, kda_per_mla=1, chunk_size=CHUNK, aux_scope="global")
    model = build_model(cfg, seed=3, dtype=torch.float32)
    trainer = PlanTrainer(model, plan, loss=PolicyLossConfig(kl_coef=0.1))
    trainer.forward_backward([traj], 1 << 20)
    windows = sorted(trainer.windows, key=lambda w: plan.microbatches[w.producer].order)
    assert len(windows) == n - 1  # every piece but the last is a producer
    return windows, trainer.peak_retained_bytes


@pytest.fixture(scope="module")
def chains():
    return {n: _windows(n) for n in (4, 5, 6)}


@pytest.mark.parametrize("n", [4, 5, 6])
def test_each_window_keeps_what_its_producer_computed(chains, n):
    windows, _ = chains[n]
    first = windows[0]  # the chain's root piece reads nothing: it keeps its own rows only
    per_row = first.retained_bytes / first.producer_rows
    for w in windows:
        assert w.producer_rows == PIECE
        assert 0 < w.retained_bytes <= SLACK * per_row * w.producer_rows, (w.producer, w.retained_bytes)


def test_retained_bytes_grow_linearly_with_the_chain(chains):
    unit = chains[4][0][0].retained_bytes
    for n, (windows, peak) in chains.items():
        total = sum(w.retained_bytes for w in windows)
        # every window of a chain is open when its last piece runs
        assert peak == total
        assert total <= SLACK * (n - 1) * unit, (n, total)
    growth = [sum(w.retained_bytes for w in chains[n][0]) for n in (4, 5, 6)]
    # one more piece adds one window's stash, the same at every length
    assert abs((growth[2] - growth[1]) - (growth[1] - growth[0])) <= (SLACK - 1) * unit
