"""`benchmarks/gpu/window_suite.py --window-floors` on the CPU (its smoke mode): the floored
plan runs beside the window plan, records what the planner chose, and its step over the
unsplit step is summarised."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "gpu"))

import window_suite  # noqa: E402
import windows as W  # noqa: E402


def test_the_floored_plan_is_run_and_summarised(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "DEVICE", W.DEVICE)
    assert window_suite.main(["--model", "tiny-cpu", "--families", "stepwise", "--budgets", "256", "--seeds", "11",
                              "--steps", "1", "--warmup", "0", "--window-floors", "--device", "cpu",
                              "--out", str(tmp_path)]) == 0
    (inst,) = json.loads((tmp_path / "window_suite.json").read_text())["instances"].values()
    cases = inst["cases"]
    assert "error" not in cases["windows-floored"] and "error" not in cases["tree"]
    # l1l2 with tiny-cpu's floors on the h100 profile keeps L1's windowless plan here
    assert cases["windows-floored"]["plan_info"].get("chosen") == "l1"
    assert "consumer" not in cases["windows-floored"]["roles"] and "consumer" in cases["windows"]["roles"]
    s = inst["summary"]
    assert s["floored_over_unsplit"] == cases["windows-floored"]["seconds"] / cases["tree"]["seconds"]
    assert s["floored_microbatches"] == cases["windows-floored"]["microbatches"]
