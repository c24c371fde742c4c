"""Small distributed cases: a 2-layer model (KDA + MLA, dense + MoE) and three tiny rollout
trees whose plans under a 26-token budget hold sharing windows on both of two replicas
(one replica two windows, the other one)."""

from __future__ import annotations

import numpy as np

from harts.config.models import get_model_config
from harts.tree.trajectory import Trajectory

BUDGET = 26
TOL = 1e-10  # float64: every value, relative
# float32: the relative RMS error (`rms_rel`: ||got - ref|| / ||ref|| over all values) of the
# log-probs and of the whole gradient. float32 rounds at u = 2^-24 (6e-8); the tree step in
# one process already differs from the expanded one by ~5u in the gradient (the same sums in
# another order: 1.3e-8 log-probs, 3.3e-7 gradient on these cases), and a distributed step
# only reorders sums further (TP, EP and FSDP reductions), each adding about u per value.
# 1e-5 (~170u) is ~20x the largest error measured (stated per mesh in the tests).
TOL32 = 1e-5


def small_config():
    return get_model_config("tiny-cpu").replace(num_layers=2, kda_per_mla=1, chunk_size=8, aux_scope="global")


def small_trajectories(seed: int = 0, groups: int = 3, kids: int = 3) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prefix = rng.integers(1, 500, 14)
        for c in range(kids):
            tokens = np.concatenate([prefix, rng.integers(1, 500, int(rng.integers(6, 12)))])
            mask = np.ones(len(tokens), bool)
            mask[:5] = False
            out.append(Trajectory.make(f"g{g}/{c}", f"g{g}", tokens, loss_mask=mask, advantage=float(rng.normal()),
                                       old_logprobs=rng.normal(-2, 0.5, len(tokens)),
                                       ref_logprobs=rng.normal(-2, 0.5, len(tokens))))
    return out
