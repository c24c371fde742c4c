"""`harts sim`, `harts sim sweep`, `harts sim fit` end to end on small inputs."""

from __future__ import annotations

import json

import pytest

from harts.cli.main import main
from harts.plan.schedule import Schedule
from harts.sim.profile import save_profile
from harts.sim.trace_io import diff_traces, load_trace_events
from tests.sim.test_profile import synthetic_rows


def run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_sim_json_trace_gantt_schedule(capsys, tmp_path):
    trace, png, sched = tmp_path / "t.json", tmp_path / "g.png", tmp_path / "s.txt"
    code, out, _ = run(capsys, ["sim", "--workload", "small-treestep", "--planner", "l1",
                                "--schedule", "consumer-1f1b", "--model", "tiny", "--gpus", "4", "--pp", "2",
                                "--microbatch-tokens", "6000", "--json", "--trace", str(trace),
                                "--gantt", str(png), "--schedule-out", str(sched)])
    assert code == 0
    d = json.loads(out)
    for key in ("throughput", "step_seconds", "bubble_fraction", "peak_memory_bytes"):
        assert d[key] > 0
    assert d["parallel"] == "DP2/PP2/EP2"
    assert d["throughput"] == pytest.approx(d["expanded_tokens"] / d["step_seconds"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Schedule.from_text(sched.read_text()).name == "consumer-1f1b"
    events = load_trace_events(trace)
    diff = diff_traces(events, events)
    assert diff.matched == len(events) and diff.makespan_error == 0.0
    assert diff.makespan_simulated == pytest.approx(d["step_seconds"])


def test_sweep_tables(capsys, tmp_path):
    code, out, _ = run(capsys, ["sim", "sweep", "--workload", "small-stepwise", "--planners", "expanded-ffd,l1",
                                "--schedule-planner", "l1", "--model", "tiny", "--gpus", "2", "--pp", "2",
                                "--microbatch-tokens", "8192", "--gantt", str(tmp_path / "s.png")])
    assert code == 0
    assert "speedup" in out and "pipeline schedules (l1)" in out
    for s in ("non-overlap", "overlap-bwd-first", "consumer-1f1b"):
        assert s in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.png"]  # the schedules as panels of one PNG


def test_fit_command(capsys, tmp_path):
    prof = tmp_path / "p.json"
    save_profile(prof, "synthetic", synthetic_rows(noise=0.0))
    code, out, _ = run(capsys, ["sim", "fit", "--profile", str(prof), "--out", str(tmp_path / "c.json"), "--json"])
    assert code == 0
    assert "gemm:fwd" in json.loads(out)["fits"]
    code, out, _ = run(capsys, ["sim", "--workload", "small-treestep", "--planner", "l1", "--model", "tiny",
                                "--gpus", "1", "--cost-model", "calibrated", "--calibration",
                                str(tmp_path / "c.json"), "--json"])
    assert code == 0 and json.loads(out)["cost_model"] == "calibrated"


@pytest.mark.parametrize("argv, msg", [
    (["sim", "--workload", "nope", "--planner", "l1"], "unknown workload preset"),
    (["sim", "--workload", "small-treestep", "--schedule", "gpipe"], "unknown schedule"),
    (["sim", "--workload", "small-treestep", "--planner", "magic"], "unknown planner"),
    (["sim", "--workload", "small-treestep", "--gpus", "6", "--pp", "4"], "!= --gpus"),
    (["sim", "--workload", "small-treestep", "--model", "huge"], "unknown model"),
    (["sim"], "needs --workload"),
])
def test_user_errors(capsys, argv, msg):
    code, _, err = run(capsys, argv)
    assert code == 2
    assert msg in err


def test_sim_table_has_units_and_rounding(capsys):
    code, out, _ = run(capsys, ["sim", "--workload", "tiny-treestep", "--planner", "l1", "--model", "tiny",
                                "--gpus", "1"])
    assert code == 0
    lines = {line[:24].strip(): line[24:].strip() for line in out.splitlines()}
    assert lines["throughput"].endswith(" k tok/s") and lines["step seconds"].endswith(" s")
    assert lines["peak memory"].endswith(" GiB") and lines["bubble fraction"].endswith("%")
    assert lines["compression"].endswith("x")
    number = lines["step seconds"].removesuffix(" s")
    assert len(number.replace(".", "").replace(",", "").lstrip("0")) == 3  # 3 significant digits
    code, out, _ = run(capsys, ["sim", "--workload", "tiny-treestep", "--planner", "l1", "--model", "tiny",
                                "--gpus", "1", "--json"])
    d = json.loads(out)
    assert f"{d['step_seconds']:.3g}" == f"{float(number):.3g}"
    assert f"{d['peak_memory_bytes'] / 2**30:,.1f} GiB" == lines["peak memory"]


def _first_row(text: str, header_line: int = 1) -> dict[str, str]:
    """The first row of a `format_table` table whose header is line `header_line` of `text`."""
    import re

    lines = text.splitlines()
    head = re.split(r"\s{2,}", lines[header_line].strip())
    return dict(zip(head, re.split(r"\s{2,}", lines[header_line + 2].strip()), strict=True))


def test_sim_and_sweep_print_peak_memory_alike(capsys):
    """The same step's peak memory: one label, one unit (GiB) and one number in both
    commands; the JSON keeps bytes under keys ending in `_bytes`."""
    case = ["--workload", "tiny-treestep", "--model", "tiny", "--gpus", "2", "--pp", "2", "--microbatch-tokens", "4096"]
    code, out, _ = run(capsys, ["sim", *case, "--planner", "l1", "--schedule", "consumer-1f1b"])
    assert code == 0
    lines = {line[:24].strip(): line[24:].strip() for line in out.splitlines()}
    assert "peak memory bytes" not in lines and "peak memory per stage" in lines
    single = lines["peak memory"]
    code, out, _ = run(capsys, ["sim", "sweep", *case, "--planners", "l1", "--schedules", "consumer-1f1b",
                                "--schedule-planner", "l1"])
    assert code == 0 and "GB" not in out.replace("GiB", "")
    row = _first_row(out)
    assert single == f"{row['peak memory GiB']} GiB"
    code, out, _ = run(capsys, ["sim", *case, "--planner", "l1", "--schedule", "consumer-1f1b", "--json"])
    d = json.loads(out)
    assert single == f"{d['peak_memory_bytes'] / 2**30:,.1f} GiB"
    assert max(d["peak_memory_per_stage_bytes"]) == d["peak_memory_bytes"]
    sizes = [k for k, v in d.items() if ("memory" in k or "capacity" in k) and not isinstance(v, bool)]
    assert sizes and all(k.endswith("_bytes") for k in sizes), sizes
    code, out, _ = run(capsys, ["sim", "sweep", *case, "--planners", "l1", "--schedules", "consumer-1f1b",
                                "--schedule-planner", "l1", "--json"])
    rows = json.loads(out)["planners"]
    assert rows[0]["peak_memory_bytes"] == d["peak_memory_bytes"]


def test_sim_and_sweep_take_the_users_rollouts(capsys, tmp_path):
    """`--input FILE` simulates the trees of a rollout file: the same step as the preset the
    file was generated from (same trees, same budget), in `harts sim` and in each sweep row."""
    rollouts = tmp_path / "r.jsonl"
    assert main(["workload", "generate", "--workload", "tiny-stepwise", "--out", str(rollouts)]) == 0
    capsys.readouterr()
    common = ["--model", "tiny", "--gpus", "2", "--pp", "1", "--microbatch-tokens", "256", "--json"]
    results = {}
    for source in (["--workload", "tiny-stepwise"], ["--input", str(rollouts)]):
        assert main(["sim", *source, "--planner", "l1l2", *common]) == 0
        results[source[0]] = json.loads(capsys.readouterr().out)
    by_preset, by_file = results["--workload"], results["--input"]
    assert by_file["workload"] == str(rollouts)
    assert by_file["step_seconds"] == by_preset["step_seconds"] > 0
    assert by_file["microbatches"] == by_preset["microbatches"]
    assert main(["sim", "sweep", "--input", f"{rollouts},{rollouts}", "--planners", "expanded-ffd,l1l2",
                 "--schedules", "consumer-1f1b", *common]) == 0
    rows = json.loads(capsys.readouterr().out)["planners"]  # one row per file and planner
    assert [(r["workload"], r["planner"]) for r in rows] == [(str(rollouts), p) for p in ("expanded-ffd", "l1l2")] * 2
    assert all(r["step_seconds"] == by_file["step_seconds"] for r in rows if r["planner"] == "l1l2")


def test_sim_input_errors_name_the_file(capsys, tmp_path):
    assert main(["sim", "--input", str(tmp_path / "missing.jsonl"), "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["file"] == str(tmp_path / "missing.jsonl") and "cannot read" in err["error"]
    good = tmp_path / "r.jsonl"
    assert main(["workload", "generate", "--workload", "tiny-stepwise", "--out", str(good)]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text().splitlines()[0] + '\n{"id": 3}\n')
    assert main(["sim", "--input", str(bad), "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["file"] == str(bad) and err["line"] == 2
    assert main(["sim", "--input", str(bad), "--workload", "tiny-stepwise"]) == 2  # one source, not both


def test_sweep_over_budgets(capsys):
    """`harts sim sweep --microbatch-tokens A,B`: each budget planned and simulated on its
    own, the same numbers as one sweep at that budget alone; a bad list is refused."""
    case = ["--workload", "tiny-treestep", "--model", "tiny", "--gpus", "1", "--pp", "1", "--planners",
            "expanded-ffd,l1l2", "--schedules", "consumer-1f1b", "--json"]
    code, out, _ = run(capsys, ["sim", "sweep", *case, "--microbatch-tokens", "256,1024"])
    assert code == 0
    rows = json.loads(out)["planners"]
    assert [(r["microbatch_tokens"], r["planner"]) for r in rows] == [
        (256, "expanded-ffd"), (256, "l1l2"), (1024, "expanded-ffd"), (1024, "l1l2")]
    assert rows[0]["microbatches"] > rows[2]["microbatches"]  # a smaller budget, more microbatches
    for budget in (256, 1024):
        code, out, _ = run(capsys, ["sim", "sweep", *case, "--microbatch-tokens", str(budget)])
        alone = json.loads(out)["planners"]
        assert [r["step_seconds"] for r in alone] == [r["step_seconds"] for r in rows
                                                       if r["microbatch_tokens"] == budget]
    assert main(["sim", "sweep", *case, "--microbatch-tokens", "256,x"]) == 2
    assert "expected token budgets" in json.loads(capsys.readouterr().out)["error"]


def test_window_floors_plan_as_the_library_does(capsys, tmp_path):
    """`--window-floors auto` plans l1l2 with window_floors for the model on --hardware at
    the budget: the simulated step equals that plan's, and it is no dearer than the plan
    without floors wherever the floors chose L1."""
    from harts.config.models import get_model_config
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.sim.executor import window_floors
    from harts.sim.hardware import load_hardware
    from harts.tree import build_forest, shapes
    from harts.tree.io import save_jsonl

    cfg = get_model_config("tiny-h200")
    trajs = shapes.draw("bushy", 3, 8192, vocab_size=cfg.vocab_size)
    rollouts = tmp_path / "bushy.jsonl"
    save_jsonl(trajs, rollouts)
    common = ["--input", str(rollouts), "--model", "tiny-h200", "--gpus", "1", "--planner", "l1l2",
              "--microbatch-tokens", "8192", "--hardware", "h100", "--json"]
    off, auto = (json.loads(run(capsys, ["sim", *common, "--window-floors", w])[1]) for w in ("off", "auto"))
    assert json.loads(run(capsys, ["sim", *common])[1])["microbatches"] == auto["microbatches"]  # the default
    floor, consumer, per_row = window_floors(cfg, load_hardware("h100"), 8192)
    plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=8192, chunk_size=cfg.chunk_size,
                                                             microbatch_floor=floor, consumer_floor=consumer,
                                                             consumer_row_cost=per_row))
    assert auto["microbatches"] == len(plan.microbatches)
    if plan.info.get("chosen") == "l1":
        assert auto["step_seconds"] <= off["step_seconds"]
    code, out, _ = run(capsys, ["sim", *common, "--window-floors", "sometimes"])
    assert code == 2 and "--window-floors" in json.loads(out)["error"]


def test_sim_reports_the_step_over_the_measured_hosts(capsys, tmp_path):
    """On a profile with host rates of two or more machines (h100) `harts sim` adds the
    step at the slowest and the fastest of them; the prediction at the profile's own rate,
    one of them, lies between. Without them (h200) the field is absent; a malformed entry
    is refused."""
    from harts.sim.hardware import HARDWARE_DIR, load_hardware

    common = ["sim", "--workload", "swe-treestep-1", "--model", "tiny-h200", "--gpus", "1", "--planner", "l1l2",
              "--microbatch-tokens", "16384", "--json"]
    h100 = json.loads(run(capsys, [*common, "--hardware", "h100"])[1])
    lo, hi = h100["step_seconds_over_hosts"]
    assert lo <= h100["step_seconds"] <= hi and lo < hi
    assert load_hardware("h100").executor.host_s_per_launch in load_hardware("h100").host_machines
    assert "step_seconds_over_hosts" not in json.loads(run(capsys, [*common, "--hardware", "h200"])[1])
    # the table says where the spread comes from and how to pin this machine's host
    text = [a for a in common if a != "--json"]
    assert "calibrate --host-only" in run(capsys, [*text, "--hardware", "h100"])[1]
    assert "calibrate --host-only" not in run(capsys, [*text, "--hardware", "h200"])[1]
    prof = json.loads((HARDWARE_DIR / "h100.json").read_text())
    prof["host_machines"] = [{"host_s_per_launch": -1.0, "fitted_to": "x"}]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(prof))
    code, out, _ = run(capsys, [*common, "--hardware", str(bad)])
    assert code != 0 and "host_machines" in out
