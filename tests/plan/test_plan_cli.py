"""`harts plan compare / make / validate`, through the real entry point."""

from __future__ import annotations

import json

from harts.cli.main import main
from harts.plan.plan import Plan
from harts.tree.workload import generate, preset

RESULT_KEYS = {"planner", "compression", "slot_balance", "balance_p5", "step_balance", "slots",
               "plan_seconds"}


def test_compare_json_has_every_planner(capsys):
    assert main(["plan", "compare", "--workload", "small-treestep", "--dp", "2", "--json",
                 "--time-limit", "0.1"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["planner"] for r in results] == ["expanded-ffd", "ortools-ffd", "l1", "l1l2"]
    for r in results:
        assert RESULT_KEYS <= set(r)
        assert 0 < r["slot_balance"] <= 1 and 0 < r["balance_p5"] <= 1 and 0 < r["step_balance"] <= 1
    assert results[0]["compression"] == 1.0
    assert results[3]["compression"] >= results[2]["compression"] > 1.0


def test_compare_table_and_subset(capsys):
    assert main(["plan", "compare", "--workload", "tiny-stepwise", "--planners", "l1,l1l2"]) == 0
    out = capsys.readouterr().out
    assert "slot balance" in out and "l1l2" in out and "expanded-ffd" not in out


def test_make_in_both_spellings_then_validate(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    args = ["--planner", "l1l2", "--workload", "small-treestep", "--seed", "4", "--dp", "2"]
    assert main(["plan", *args, "--out", str(a)]) == 0
    assert "l1l2" in capsys.readouterr().out
    assert main(["plan", "make", *args, "--out", str(b), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert a.read_text().replace(_seconds(a), "") == b.read_text().replace(_seconds(b), "")
    plan = Plan.load(b)
    assert plan.planner == "l1l2" and plan.dp == 2 and plan.num_slots == metrics["slots"]
    plan.validate(generate(preset("small-treestep", seed=4)).forest())
    assert main(["plan", "validate", "--plan", str(b), "--workload", "small-treestep", "--seed", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] is True


def _seconds(path) -> str:
    return json.dumps(json.loads(path.read_text())["plan_seconds"])


def test_user_errors_exit_2(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert main(["plan", "--planner", "l9", "--workload", "tiny-treestep", "--out", out]) == 2
    assert "unknown planner 'l9'; known planners: expanded-ffd, ortools-ffd, l1, l1l2" in capsys.readouterr().err
    assert main(["plan", "--workload", "tiny-treestep"]) == 2
    assert "needs --planner NAME and --out FILE" in capsys.readouterr().err
    assert main(["plan", "compare", "--workload", "tiny-treestep", "--microbatch-tokens", "5"]) == 2
    assert "raise --microbatch-tokens" in capsys.readouterr().err
    assert main(["plan", "compare", "--dp", "2"]) == 2
    assert "--workload PRESET or --input JSONL" in capsys.readouterr().err
    # a plan checked against another step
    assert main(["plan", "make", "--planner", "l1", "--workload", "tiny-treestep", "--out", out]) == 0
    capsys.readouterr()
    assert main(["plan", "validate", "--plan", out, "--workload", "small-treestep"]) == 2
    assert "made for a different forest" in capsys.readouterr().err
    assert main(["plan", "validate", "--plan", str(tmp_path / "none.json"), "--workload", "tiny-treestep"]) == 2
    assert "No such file" in capsys.readouterr().err


def test_pp_asks_for_microbatches_per_replica(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "--planner", "l1l2", "--workload", "swe-treestep-8", "--dp", "4", "--pp", "2",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    per_replica = {}
    producers = {m.producer for m in plan.microbatches if m.producer is not None}
    for m in plan.microbatches:
        if m.id not in producers:
            per_replica[m.replica] = per_replica.get(m.replica, 0) + 1
    assert min(per_replica.values()) >= 4  # 2 per stage x 2 stages
    assert main(["plan", "compare", "--workload", "tiny-stepwise", "--pp", "0"]) == 2
    assert "pp must be >= 1" in capsys.readouterr().err


def test_a_preset_brings_its_own_budget(tmp_path, capsys):
    # small-treestep with a budget set on the preset: the plan is made at that budget
    # unless --microbatch-tokens names another (Flash-sized SWE presets plan 32k this way)
    out = tmp_path / "p.json"
    base = ["plan", "--planner", "l1", "--workload", "small-treestep", "--out", str(out)]
    assert main([*base, "--set", "microbatch_tokens=9000"]) == 0
    assert Plan.load(out).microbatch_tokens == 9000
    assert main([*base, "--set", "microbatch_tokens=9000", "--microbatch-tokens", "12000"]) == 0
    assert Plan.load(out).microbatch_tokens == 12000
    capsys.readouterr()


def test_window_floors_make_the_plan_the_library_makes(tmp_path, capsys):
    """`harts plan --window-floors MODEL,PROFILE` writes the l1l2 plan of PlanConfig with
    window_floors(MODEL, PROFILE, budget); bad specs are one-line errors."""
    from harts.config.models import get_model_config
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.sim.executor import window_floors
    from harts.sim.hardware import load_hardware
    from harts.tree import build_forest, shapes
    from harts.tree.io import save_jsonl

    cfg = get_model_config("tiny-h200")
    trajs = shapes.draw("bushy", 3, 8192, vocab_size=cfg.vocab_size)
    rollouts, out = tmp_path / "bushy.jsonl", tmp_path / "plan.json"
    save_jsonl(trajs, rollouts)
    argv = ["plan", "--planner", "l1l2", "--input", str(rollouts), "--microbatch-tokens", "8192", "--out", str(out)]
    assert main([*argv, "--window-floors", "tiny-h200,h100"]) == 0
    capsys.readouterr()
    floors = dict(zip(("microbatch_floor", "consumer_floor", "consumer_row_cost"),
                      window_floors(cfg, load_hardware("h100"), 8192), strict=True))
    want = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=8192, **floors))
    got = Plan.load(out)
    assert [m.to_dict() for m in got.microbatches] == [m.to_dict() for m in want.microbatches]
    for spec, msg in (("tiny-h200", "MODEL,PROFILE"), ("nosuch,h100", "--window-floors"),
                      ("tiny-h200,nosuch", "unknown hardware profile")):
        assert main([*argv, "--window-floors", spec]) == 2
        assert msg in capsys.readouterr().err


def _shape_plan_argv(tmp_path, capsys, instance: str, *flags: str) -> list[str]:
    """`harts plan` argv (l1l2, `flags` added) over a shape family instance written with
    `harts workload shape`."""
    rollouts = tmp_path / "shape.jsonl"
    assert main(["workload", "shape", "--instance", instance, "--out", str(rollouts)]) == 0
    capsys.readouterr()
    return ["plan", "--input", str(rollouts), "--planner", "l1l2", *flags, "--out", str(tmp_path / "p.json")]


def test_make_says_which_trees_run_as_nested_windows(tmp_path, capsys):
    # an SWE-agent tree planned at 0.7 of the budget it was drawn at: no one window holds
    # it; at half of it a trajectory is over the budget too
    argv = _shape_plan_argv(tmp_path, capsys, "swe-tree/4@16384", "--microbatch-tokens", "11468")
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["window_trees"], got["nested_trees"]) == (1, 1)
    assert main(argv) == 0
    assert "nested windows for 1 tree: 1 that no one window holds" in capsys.readouterr().out
    assert main([*argv, "--microbatch-tokens", "8192"]) == 0
    assert "1 with a trajectory over the budget" in capsys.readouterr().out


def test_make_says_when_short_trees_join_a_window_trees_leaves(tmp_path, capsys):
    # long-agent/1 at 16k, pieces of `piece_tokens` rows: its short trajectories ride in the
    # first fork's consumer
    argv = _shape_plan_argv(tmp_path, capsys, "long-agent/1@16384", "--microbatch-tokens", "16384",
                            "--chain-retention", "off")
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["filled_leaves"] == 1
    assert main(argv) == 0
    assert "1 microbatch of short trees joined window-tree leaves" in capsys.readouterr().out


def test_make_says_when_fork_branches_share_a_leaf(tmp_path, capsys):
    # long-agent/12 at 16k with the H100 floors: three branch consumers become one leaf
    argv = _shape_plan_argv(tmp_path, capsys, "long-agent/12@16384", "--microbatch-tokens", "16384",
                            "--window-floors", "tiny-h200,h100")
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["sunk_leaves"] == 2
    assert main(argv) == 0
    assert "2 microbatches fewer by fork branches sharing a later leaf" in capsys.readouterr().out
    # without floors no leaf is known to be host-paced
    bare = _shape_plan_argv(tmp_path, capsys, "long-agent/12@16384", "--microbatch-tokens", "16384")
    assert main([*bare, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sunk_leaves"] == 0


def test_make_says_when_a_tree_is_split_over_replicas(tmp_path, capsys):
    # long-group/105 drawn at 16k, planned at 8k on two replicas: the group's trajectories in
    # two window trees, one per replica (harts.plan.planners.tree_split)
    argv = _shape_plan_argv(tmp_path, capsys, "long-group/105@16384", "--microbatch-tokens", "8192", "--dp", "2")
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["split_trees"] == [2] and got["window_trees"] == 2
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "nested windows for 1 tree: 1 with a trajectory over the budget" in said
    assert "1 tree split over replicas into 2 window trees" in said


def test_chain_retention_sizes_the_pieces_and_off_restores_the_producer_charge(tmp_path, capsys):
    # swe-treestep-1 at 16,384: its longest trajectory (46,635 tokens) is a chain; charged
    # by their context its first pieces take the whole budget, fewer microbatches
    plans = {}
    for value in ("off", "0.076"):
        out = tmp_path / f"{value}.json"
        assert main(["plan", "--planner", "l1l2", "--workload", "swe-treestep-1", "--microbatch-tokens", "16384",
                     "--chain-retention", value, "--out", str(out)]) == 0
        plans[value] = Plan.load(out)
    assert plans["off"].chain_retention is None and plans["0.076"].chain_retention == 0.076
    assert plans["0.076"].num_microbatches < plans["off"].num_microbatches
    assert max(m.executed_tokens for m in plans["0.076"].microbatches) == 16384
    assert max(plans["0.076"].memory_tokens()) <= 16384
    capsys.readouterr()
    assert main(["plan", "--planner", "l1l2", "--workload", "swe-treestep-1", "--chain-retention", "x",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "expected a number or 'off'" in capsys.readouterr().err
