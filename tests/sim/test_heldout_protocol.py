"""benchmarks/sim_heldout.py: the held-out protocol fits on the calibration set only."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def heldout():
    spec = importlib.util.spec_from_file_location("sim_heldout", ROOT / "benchmarks" / "sim_heldout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ranking_counts_only_pairs_more_than_five_percent_apart(heldout):
    meas = {"tree": 1.0, "windows": 1.04, "expanded": 2.0}
    assert heldout.ranking_ok({"tree": 1.1, "windows": 1.0, "expanded": 3.0}, meas) == (True, [])
    ok, wrong = heldout.ranking_ok({"tree": 1.0, "windows": 1.1, "expanded": 0.9}, meas)
    assert not ok and sorted(wrong) == ["tree<expanded", "windows<expanded"]


def test_the_held_out_steps_do_not_move_the_fit(heldout, monkeypatch):
    calibration = set(heldout.CALIBRATE.split(","))
    hw = json.loads((ROOT / "harts" / "sim" / "hardware" / "h100.json").read_text())
    rates, *_ = heldout.fit_profile_rates("h100", hw, "tiny-h200", calibration, [])
    real = heldout.suite_rows

    def doubled(path):  # every held-out step twice as slow
        return [{**r, "seconds": r["seconds"] * (1 if r["instance"] in calibration else 2)} for r in real(path)]

    monkeypatch.setattr(heldout, "suite_rows", doubled)
    again, *_, truth = heldout.fit_profile_rates("h100", hw, "tiny-h200", calibration, [])
    assert again == rates
    assert {c.name for c in truth} - calibration  # the held-out steps are there, just not fitted


def test_predictions_written_ahead_are_what_harts_sim_prints(tmp_path, capsys):
    # benchmarks/sim_predict.py (the closed form, in the executor's pass order) and `harts
    # sim` (the engine) on a long family's instance, whose window plan is a chain
    from harts.cli.main import main
    from harts.tree import shapes
    from harts.tree.io import save_jsonl

    spec = importlib.util.spec_from_file_location("sim_predict", ROOT / "benchmarks" / "sim_predict.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--gpu", "h100", "--instances", "long-agent/1@8192", "--out", str(tmp_path)]) == 0
    (row,) = json.loads(next(tmp_path.glob("*-predicted-h100.json")).read_text())["rows"]
    save_jsonl(shapes.draw("long-agent", 1, 8192, vocab_size=32768), tmp_path / "r.jsonl")
    capsys.readouterr()
    # `floored` is what `harts sim` plans by default (`--window-floors auto`)
    for kind, planner, floors in (("windows", "l1l2", "off"), ("floored", "l1l2", "auto"),
                                  ("expanded", "expanded-ffd", "off")):
        assert main(["sim", "--input", str(tmp_path / "r.jsonl"), "--model", "tiny-h200", "--gpus", "1",
                     "--planner", planner, "--microbatch-tokens", "8192", "--hardware", "h100",
                     "--window-floors", floors, "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["microbatches"] == row[f"{kind}_microbatches"]
        assert got["step_seconds"] == pytest.approx(row[f"{kind}_s"], rel=1e-9)


def test_a_floored_suite_step_is_its_own_kind(heldout, tmp_path):
    """A window-suite file's `windows-floored` step is read as kind `floored` (predicted
    with the profile's floors), beside its `windows` step."""
    case = {"seconds": 1.0, "microbatches": 3, "rows": 100, "budget": 16384}
    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"instances": {"grpo/1@16384": {"cases": {"windows": case, "windows-floored": case}}}}))
    assert sorted(r["kind"] for r in heldout.suite_rows(str(path))) == ["floored", "windows"]
