"""`harts verify --dtype bfloat16`: the step check in bf16, read against the baseline's own
variation (a rerun; a repacking where the aux loss allows it)."""

from __future__ import annotations

import json

from harts.cli.main import main


def test_bf16_step_check_with_sharing_windows_reports_the_baselines_variation(capsys):
    # 170: above tiny-treestep's longest trajectory (161 tokens), below its tree (a window)
    args = ["verify", "--dtype", "bfloat16", "--workload", "tiny-treestep", "--planner", "l1l2",
            "--microbatch-tokens", "170", "--json"]
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["dtype"] == "bfloat16" and rep["sharing_windows"] > 0 and rep["aux_scope"] == "global"
    rerun, repacked = rep["expanded_rerun"], rep["expanded_repacked"]
    # the CPU is deterministic: the rerun is the baseline's own bits
    assert rerun["max_rel_logprob_err"] == 0 and rerun["max_rel_grad_err"] == 0
    assert rerun["loss_abs_err"]["loss"] == 0
    # bf16 rounding differs with the batch composition, and for the tree: neither is exact
    assert repacked["rms_rel_grad_err"] > 0 and rep["rms_rel_grad_err"] > 0
    assert 0 < rep["rms_rel_logprob_err"] < 0.1


def test_bf16_table_without_planner_skips_the_repacking(capsys):
    # per-microbatch aux loss: repacking would change the loss itself, so it is not run
    assert main(["verify", "--dtype", "bfloat16", "--workload", "tiny-treestep"]) == 0
    out = capsys.readouterr().out
    assert "baseline rerun" in out and "baseline repacked" in out and "not run" in out
    assert main(["verify", "--dtype", "bfloat16", "--device", "tpu"]) == 2
