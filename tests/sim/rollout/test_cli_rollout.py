"""`harts sim rollout` (the parser `add_rollout_parser` adds): JSON shape, compare table,
Gantt files, one-line errors."""

from __future__ import annotations

import argparse
import json

import pytest

from harts.cli.common import UserError
from harts.cli.sim_rollout import add_rollout_parser


def run(argv):
    p = argparse.ArgumentParser()
    add_rollout_parser(p.add_subparsers())
    args = p.parse_args(["rollout", *argv])
    return args.func(args)


def test_json_shape(capsys):
    assert run(["--policy", "heddle", "--workload", "tiny", "--gpus", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["policy"] == "heddle"
    assert d["throughput_tokens_per_s"] > 0 and d["makespan_s"] > 0
    assert d["throughput_tokens_per_s"] == pytest.approx(d["generated_tokens"] / d["makespan_s"])
    assert sum(d["worker_degrees"]) == 8 and d["trajectories"] == 8
    # the makespans no schedule can beat, reported beside the policy's own
    assert set(d["makespan_bounds_s"]) == {"critical_path", "tail_set", "work"}
    assert 0 < max(d["makespan_bounds_s"].values()) <= d["makespan_s"]


def test_compare_gantt_and_end_to_end(capsys, tmp_path):
    assert run(["--compare", "--workload", "tiny", "--gpus", "8", "--seed", "2", "--gantt",
                str(tmp_path / "g.png"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows][:5] == ["round-robin", "least-loaded", "cache-aware", "verl", "heddle"]
    assert max(r["speedup_vs_best_baseline"] for r in rows if r["step_centric"]) == pytest.approx(1.0)
    assert len({json.dumps(r["makespan_bounds_s"]) for r in rows}) == 1  # one set of trajectories
    for r in rows:
        assert max(r["makespan_bounds_s"].values()) <= r["makespan_s"]
        assert (tmp_path / f"g-{r['policy']}.png").stat().st_size > 1000
    assert run(["--policy", "cache-aware", "--workload", "tiny", "--gpus", "8", "--end-to-end"]) == 0
    out = capsys.readouterr().out
    assert "training s" in out and "rollout share" in out and "no policy finishes before" in out


@pytest.mark.parametrize("argv, msg", [
    (["--policy", "fifo"], "unknown rollout policy 'fifo'"),
    (["--workload", "nope"], "unknown rollout workload preset"),
    (["--gpus", "6", "--workload", "tiny"], "multiple of baseline_mp"),
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--gantt", "/nonexistent-dir/x.png", "--workload", "tiny", "--gpus", "8"], "does not exist"),
])
def test_bad_input_is_a_user_error(argv, msg):
    with pytest.raises(UserError, match=msg):
        run(argv)


def test_reference_row_is_labelled_and_not_a_baseline(capsys):
    assert run(["--policy", "cache-aware", "--workload", "tiny", "--gpus", "8", "--reference", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["cache-aware", "known-lengths (ORACLE)"]
    assert not rows[1]["step_centric"] and "layout" in rows[1]["reference_schedule"]
    assert rows[1]["generated_tokens"] == rows[0]["generated_tokens"]


def test_a_dense_served_model_and_the_baseline_degree(capsys):
    # qwen3-8b fits one GPU: baselines at MP1 give one worker per GPU
    assert run(["--policy", "cache-aware", "--workload", "tiny", "--gpus", "4", "--model", "qwen3-8b",
                "--baseline-mp", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["worker_degrees"] == [1, 1, 1, 1] and d["generated_tokens"] > 0
    for bad in (["--model", "nope"], ["--baseline-mp", "3"]):
        with pytest.raises(UserError):
            run(["--workload", "tiny", *bad])
