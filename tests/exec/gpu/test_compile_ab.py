"""`benchmarks/gpu/compile_ab.py` on the CPU (its smoke mode: float32, the `aot_eager`
backend): it runs a case eager and compiled from the same weights, writes its result with
provenance, and the two settings' first-step losses agree."""

import json

from benchmarks.gpu import compile_ab


def test_a_case_runs_eager_and_compiled_and_is_written(tmp_path, monkeypatch):
    # the script sets benchmarks/gpu/windows.py's device for the process: put it back after
    monkeypatch.setattr(compile_ab.W, "DEVICE", compile_ab.W.DEVICE)
    assert compile_ab.main(["--device", "cpu", "--model", "tiny-cpu", "--cases", "grpo/0@512", "--kinds", "windows",
                            "--backend", "aot_eager", "--steps", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "compile_ab.json").read_text())
    assert result["provenance"]["command"] and result["backend"] == "aot_eager"
    case = result["cases"]["grpo/0@512 windows"]
    assert case["eager"]["compile"] == "off" and case["compiled"]["compile"] == "aot_eager"
    assert case["eager"]["microbatches"] == case["compiled"]["microbatches"] > 1
    assert case["loss_rel_diff"] <= 1e-6 and case["grad_norm_rel_diff"] <= 1e-5
    assert case["wall_ratio"] > 0
