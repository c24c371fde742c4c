"""`harts verify --fidelity`: the bf16 fidelity report from the command line."""

from __future__ import annotations

import json
import math

from harts.cli.main import main


def test_fidelity_report_json(capsys):
    assert main(["verify", "--fidelity", "--json", "--workload", "tiny-treestep"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["dtype"] == "bfloat16" and rep["device"] == "cpu"
    rerun = rep["expanded_rerun_vs_expanded"]
    # CPU is deterministic: the baseline's rerun is its own bits
    assert rerun["sym_kl"] == 0 and rerun["nll_diff_max"] == 0 and rerun["loss_diff"] == 0
    for key in ("tree_replay_vs_expanded", "tree_no_replay_vs_expanded", "expanded_repacked_vs_expanded"):
        r = rep[key]
        assert r["positions"] == rerun["positions"] > 0
        assert math.isfinite(r["sym_kl"]) and r["sym_kl"] >= 0 and -1 <= r["cosine_min"] <= r["cosine"] <= 1 + 1e-6
        assert sum(d["positions"] for d in r["by_handoff_depth"].values()) == r["positions"]


def test_fidelity_table_and_refusals(capsys):
    assert main(["verify", "--fidelity", "--workload", "tiny-treestep"]) == 0
    out = capsys.readouterr().out
    assert "tree (replay)" in out and "fork depth" in out
    assert main(["verify", "--fidelity", "--divergence"]) == 2
    assert main(["verify", "--fidelity", "--planner", "l1l2"]) == 2
    assert main(["verify", "--fidelity", "--device", "tpu"]) == 2
