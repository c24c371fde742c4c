"""The README's main command, on its embedded defaults."""

from __future__ import annotations

import json

from harts.cli.main import main


def test_run_reports_a_verified_split_tree_step_and_a_simulation(capsys):
    assert main(["run", "--json", "--no-log"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["equivalent"] is True
    assert summary["tree"]["compression"] > 1
    rep = summary["verify"]
    assert rep["sharing_windows"] >= 1 and rep["microbatches"] > 1
    assert rep["max_rel_grad_err"] <= 1e-10 and rep["vs_single_microbatch"]["max_rel_grad_err"] <= 1e-10
    runs = {r["planner"]: r for r in summary["simulation"]["runs"]}
    assert runs["l1l2"]["throughput"] > runs["expanded-ffd"]["throughput"]
    assert "tracking" not in summary
