"""The README's main command, on its embedded defaults."""

from __future__ import annotations

import json

from harts.cli.main import main


def test_run_reports_a_verified_tree_step(capsys):
    assert main(["run", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["equivalent"] is True
    assert summary["tree"]["compression"] > 1
    assert summary["kda_plan"]["rounds"] == summary["verify"]["rounds"]
    assert summary["verify"]["max_rel_grad_err"] <= 1e-10
