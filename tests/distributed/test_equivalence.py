"""The distributed step (worker processes, gloo) equals the single-process expanded step:
in float64 every log-prob, loss term, expert load and parameter gradient within 1e-10
relative, on a plan with sharing windows on both replicas; in float32 (the CLI's default
dtype, run in the same worker processes right after) the log-probs and the gradient
within `TOL32` relative RMS error (tests/distributed/cases.py)."""

from __future__ import annotations

import math

import pytest
import torch

from harts.distributed.mesh import parse_parallel
from harts.verify.distributed import verify_distributed_dtypes
from tests.distributed.cases import BUDGET, TOL, TOL32, small_config, small_trajectories

DTYPES = (torch.float64, torch.float32)


def _check_float64(rep: dict) -> None:
    assert rep["dtype"] == "float64"
    assert rep["max_rel_logprob_err"] <= TOL
    assert rep["max_rel_entropy_err"] <= TOL
    assert rep["max_rel_grad_err"] <= TOL, rep["worst_grad_params"]
    assert rep["max_rel_expert_load_err"] <= TOL
    for name, err in rep["loss_abs_err"].items():
        assert err <= TOL * max(1.0, abs(rep["ref_losses"][name])), name
    assert math.isclose(rep["grad_norm"], rep["ref_grad_norm"], rel_tol=TOL)


def _check_float32(rep: dict) -> None:
    assert rep["dtype"] == "float32"
    assert rep["rms_rel_logprob_err"] <= TOL32
    assert rep["rms_rel_grad_err"] <= TOL32, rep["worst_grad_params"]
    assert math.isclose(rep["grad_norm"], rep["ref_grad_norm"], rel_tol=TOL32)


@pytest.mark.parametrize("spec, sp, applied", [("dp=2", True, ["fsdp"]), ("dp=2,ep=2", True, ["ep", "fsdp"]),
                                              ("tp=2", False, ["tp"]), ("tp=2", True, ["tp", "sp"])],
                         ids=["dp2", "dp2ep2", "tp2", "tp2sp"])
def test_distributed_step_equals_the_expanded_reference(spec, sp, applied):
    """tp2sp: the residual stream row-sharded over TP (its rows padded to an even split),
    norms on each rank's rows, rows gathered for the mixers, the router and the LM head.

    float32 relative RMS errors measured (log-probs / gradient; the single-process tree
    step's own, dp=1: 1.3e-8 / 3.3e-7): dp2 1.3e-8 / 3.3e-7, dp2ep2 1.6e-8 / 3.5e-7,
    tp2 and tp2sp 3.2e-8 / 3.7e-7; the bound `TOL32` = 1e-5."""
    rep64, rep32 = verify_distributed_dtypes(small_trajectories(), parallel=parse_parallel(spec), dtypes=DTYPES,
                                             model=small_config(), microbatch_tokens=BUDGET, sequence_parallel=sp,
                                             timeout=240)
    for rep in (rep64, rep32):
        assert rep["world_size"] == 2 and rep["applied"] == applied
        assert rep["sharing_windows"] >= 2
    _check_float64(rep64)
    assert rep64["ref_losses"]["aux_loss"] > 0 and rep64["ref_grad_norm"] > 0
    _check_float32(rep32)


def test_dp2_tp2_step_equals_the_expanded_reference():
    """Four processes: FSDP2 over two replicas of a TP pair with sequence parallel (each
    block's parameters DTensors on the 2-D ("dp", "tp") mesh). float32 relative RMS errors
    measured: 3.2e-8 (log-probs), 3.7e-7 (gradient)."""
    rep64, rep32 = verify_distributed_dtypes(small_trajectories(), parallel=parse_parallel("dp=2,tp=2"),
                                             dtypes=DTYPES, model=small_config(), microbatch_tokens=BUDGET,
                                             timeout=400)
    for rep in (rep64, rep32):
        assert rep["world_size"] == 4 and rep["applied"] == ["tp", "sp", "fsdp"]
        assert rep["sharing_windows"] >= 2
    assert rep64["max_rel_logprob_err"] <= TOL and rep64["max_rel_grad_err"] <= TOL, rep64["worst_grad_params"]
    assert rep64["max_rel_expert_load_err"] <= TOL
    assert math.isclose(rep64["grad_norm"], rep64["ref_grad_norm"], rel_tol=TOL)
    _check_float32(rep32)
