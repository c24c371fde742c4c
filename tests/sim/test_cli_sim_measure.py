"""`harts sim --hardware h100|h200|FILE`, `harts sim calibrate` and `harts sim validate` on a CPU."""

from __future__ import annotations

import json

import pytest

from harts.cli.main import main
from harts.sim.executor_rates import RATE_NAMES
from harts.sim.hardware import HARDWARE_DIR, load_hardware
from harts.tree import shapes
from harts.tree.io import save_jsonl


def run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    return out


@pytest.fixture(scope="module")
def grpo_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim") / "grpo.jsonl"
    save_jsonl(shapes.draw("grpo", 0, 4096, vocab_size=32768), path)
    return path


def _sim(capsys, path, hardware):
    return json.loads(run(capsys, ["sim", "--input", str(path), "--model", "tiny-h200", "--gpus", "1", "--planner",
                                   "l1l2", "--microbatch-tokens", "4096", "--hardware", hardware, "--json"]))


def test_sim_prices_a_rollout_file_on_both_shipped_gpus(capsys, grpo_file, tmp_path):
    h100, h200 = _sim(capsys, grpo_file, "h100"), _sim(capsys, grpo_file, "h200")
    for out, name in ((h100, "h100"), (h200, "h200")):
        assert out["hardware"] == name and out["cost_model"] == "executor"
        assert out["step_seconds"] > 0
    assert h100["step_seconds"] != h200["step_seconds"]
    # a profile given as a file is the same profile
    path = tmp_path / "mine.json"
    path.write_text((HARDWARE_DIR / "h100.json").read_text())
    assert _sim(capsys, grpo_file, str(path))["step_seconds"] == pytest.approx(h100["step_seconds"])


def test_calibrate_on_cpu_writes_a_loadable_labelled_profile(capsys, tmp_path):
    out = tmp_path / "cpu.json"
    rows = tmp_path / "rows.json"
    run(capsys, ["sim", "calibrate", "--device", "cpu", "--out", str(out), "--instances", "grpo/0@256",
                 "--steps", "1", "--warmup", "1", "--unsplit-budget", "2048", "--rows-out", str(rows), "--json"])
    hw = load_hardware(out)
    data = json.loads(out.read_text())
    assert hw.executor is not None and hw.executor.device_scale > 0
    assert {data["executor"][n]["source"] for n in RATE_NAMES} <= {"measured", "fitted", "assumption"}
    assert data["executor"]["device_scale"]["source"] == "fitted"
    assert data["gpu"]["matmul_flops_per_s"]["source"] == "measured"
    assert data["provenance"]["instances"] == [["grpo", 0, 256]]
    measured = json.loads(rows.read_text())["rows"]
    assert sorted(r["kind"] for r in measured) == ["expanded", "tree", "windows"]
    assert all(r["seconds"] > 0 for r in measured)


def test_host_only_calibration_keeps_the_base_and_fits_the_host_rate(capsys, tmp_path):
    out, rows = tmp_path / "host.json", tmp_path / "rows.json"
    run(capsys, ["sim", "calibrate", "--host-only", "--base", "h100", "--device", "cpu", "--model", "tiny-cpu",
                 "--out", str(out), "--instances", "grpo/0@256", "--steps", "1", "--rows-out", str(rows), "--json"])
    base, data = json.loads((HARDWARE_DIR / "h100.json").read_text()), json.loads(out.read_text())
    for n in RATE_NAMES:
        if n != "host_s_per_launch":
            assert data["executor"][n]["value"] == base["executor"][n]["value"], n
    assert data["executor"]["host_s_per_launch"]["source"] == "fitted"
    assert data["gpu"] == base["gpu"]  # no op micro-benchmarks
    hw = load_hardware(out)
    # this machine's host alone: `harts sim` reports no spread over other machines' hosts
    assert hw.host_machines == (hw.executor.host_s_per_launch,)
    # the machine's host probe is recorded beside its fitted rate
    probe = data["host_machines"][0]["probe"]
    assert probe["device"] == "cpu" and probe["s_per_op"] > 0 and probe["ops_per_iteration"] > 0
    measured = json.loads(rows.read_text())["rows"]
    assert sorted(r["kind"] for r in measured) == ["expanded", "windows"]
    # the fit is least squares on the log error in the one rate: it prices the measured
    # steps no worse than the base by that measure
    import math

    from harts.bench.sim_measure import measured_cases
    from harts.sim.fit_executor import predict

    def squares(prof):
        hw_, cases, _ = measured_cases(prof, measured, "tiny-cpu", 131072)
        return sum(math.log(predict(hw_.executor, c) / c.measured_s) ** 2 for c in cases)

    assert squares(data) <= squares(base) * (1 + 1e-9)


def test_host_only_calibration_needs_a_profile_of_this_gpu_kind(capsys, tmp_path, monkeypatch):
    code = main(["sim", "calibrate", "--host-only", "--device", "cpu", "--out", str(tmp_path / "x.json")])
    assert code != 0 and "--base" in capsys.readouterr().err
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["sim", "calibrate", "--host-only", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2 and "CUDA" in err and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


def test_validate_on_cpu_prints_simulated_and_measured(capsys, tmp_path):
    path = tmp_path / "small.jsonl"
    save_jsonl(shapes.draw("long-chain", 0, 256, vocab_size=512), path)
    out = json.loads(run(capsys, ["sim", "validate", "--device", "cpu", "--input", str(path), "--model", "tiny-cpu",
                                  "--planner", "l1l2", "--microbatch-tokens", "256", "--hardware", "h100",
                                  "--steps", "1", "--json"]))
    assert out["simulated"]["step_seconds"] > 0 and out["measured"]["step_seconds"] > 0
    assert out["measured"]["microbatches"] == out["microbatches"]
    assert out["simulated"]["device_seconds"] <= out["simulated"]["step_seconds"]
    assert sum(out["simulated"]["device_by_category"].values()) == pytest.approx(out["simulated"]["device_seconds"])
    # the host speed the measured step implies, where one does (a CPU's host prices far above the profile's)
    assert out["profile_host_s_per_launch"] == load_hardware("h100").executor.host_s_per_launch
    h = out["host_s_per_launch_to_match"]
    assert h is None or h > 0
    assert out["host_probe"]["device"] == "cpu" and out["host_probe"]["s_per_op"] > 0
    text = run(capsys, ["sim", "validate", "--device", "cpu", "--input", str(path), "--model", "tiny-cpu",
                        "--planner", "expanded-ffd", "--microbatch-tokens", "256", "--hardware", "h100", "--steps", "1"])
    assert "simulated" in text and "step error" in text and "device: attention" in text
    assert "host rate that prices this step" in text or "no host rate within" in text


def test_the_measured_expanded_step_is_the_plan_the_simulator_prices():
    """A trajectory longer than the budget: what `harts sim calibrate` and the window suite
    time as `expanded` is the expanded-ffd plan's chain of windows the simulator prices
    (`step_of`), every microbatch within the budget, not the packed layout's one microbatch
    over it; where every trajectory fits, the packed layout."""
    from harts.bench.sim_measure import trainer_for
    from harts.config.models import get_model_config
    from harts.exec.model.model import build_model
    from harts.sim.fit_executor import step_of
    from harts.tree import build_forest

    cfg = get_model_config("tiny-cpu")
    net = build_model(cfg, seed=0)
    long = build_forest(shapes.draw("long-agent", 1, 512, vocab_size=cfg.vocab_size))
    assert int(long.traj_length.max()) > 512
    trainer = trainer_for("expanded", net, long, 512, cfg.chunk_size)
    simulated = step_of(long, "expanded", 512, cfg.chunk_size)
    assert len(trainer.plan.microbatches) == len(simulated.microbatches) > 1
    assert max(mb.executed_tokens for mb in trainer.plan.microbatches) <= 512
    short = build_forest(shapes.draw("grpo", 0, 4096, vocab_size=cfg.vocab_size))
    assert not hasattr(trainer_for("expanded", net, short, 4096, cfg.chunk_size), "plan")
