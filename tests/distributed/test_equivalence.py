"""The distributed step (worker processes, gloo, float64) equals the single-process
expanded step: every log-prob, loss term, expert load and parameter gradient, on a plan
with sharing windows on both replicas."""

from __future__ import annotations

import math

import pytest

from harts.dist.mesh import parse_parallel
from harts.verify.distributed import verify_distributed
from tests.distributed.cases import BUDGET, TOL, small_config, small_trajectories


@pytest.mark.parametrize("spec, sp, applied", [("dp=2", True, ["fsdp"]), ("dp=2,ep=2", True, ["ep", "fsdp"]),
                                              ("tp=2", False, ["tp"]), ("tp=2", True, ["tp", "sp"])],
                         ids=["dp2", "dp2ep2", "tp2", "tp2sp"])
def test_distributed_step_equals_the_expanded_reference(spec, sp, applied):
    """tp2sp: the residual stream row-sharded over TP (its rows padded to an even split),
    norms on each rank's rows, rows gathered for the mixers, the router and the LM head."""
    rep = verify_distributed(small_trajectories(), parallel=parse_parallel(spec), model=small_config(),
                             microbatch_tokens=BUDGET, sequence_parallel=sp, timeout=240)
    assert rep["world_size"] == 2 and rep["applied"] == applied
    assert rep["sharing_windows"] >= 2
    assert rep["max_rel_logprob_err"] <= TOL
    assert rep["max_rel_entropy_err"] <= TOL
    assert rep["max_rel_grad_err"] <= TOL, rep["worst_grad_params"]
    assert rep["max_rel_expert_load_err"] <= TOL
    for name, err in rep["loss_abs_err"].items():
        assert err <= TOL * max(1.0, abs(rep["ref_losses"][name])), name
    assert math.isclose(rep["grad_norm"], rep["ref_grad_norm"], rel_tol=TOL)
    assert rep["ref_losses"]["aux_loss"] > 0 and rep["ref_grad_norm"] > 0


def test_dp2_tp2_step_equals_the_expanded_reference():
    """Four processes: FSDP2 over two replicas of a TP pair with sequence parallel (each
    block's parameters DTensors on the 2-D ("dp", "tp") mesh)."""
    rep = verify_distributed(small_trajectories(), parallel=parse_parallel("dp=2,tp=2"), model=small_config(),
                             microbatch_tokens=BUDGET, timeout=400)
    assert rep["world_size"] == 4 and rep["applied"] == ["tp", "sp", "fsdp"]
    assert rep["sharing_windows"] >= 2
    assert rep["max_rel_logprob_err"] <= TOL and rep["max_rel_grad_err"] <= TOL, rep["worst_grad_params"]
    assert rep["max_rel_expert_load_err"] <= TOL
    assert math.isclose(rep["grad_norm"], rep["ref_grad_norm"], rel_tol=TOL)
