"""`harts verify`'s verdict: a PASS/FAIL line naming the tolerance, and the exit code."""

from __future__ import annotations

import json

import pytest

from harts.cli.main import build_parser, main


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """One small tree: a 16-token prompt and three 14-token continuations (a fork)."""
    path = tmp_path_factory.mktemp("verdict") / "r.jsonl"
    prompt = list(range(3, 19))
    lines = []
    for i, tail in enumerate((range(20, 34), range(40, 54), [20, 21, 22, *range(60, 71)])):
        tokens = prompt + list(tail)
        mask = [0] * len(prompt) + [1] * len(tail)
        lines.append(json.dumps({"id": f"r{i}", "group": "g", "tokens": tokens, "loss_mask": mask,
                                 "advantage": 0.5 - i / 2, "old_logprobs": [0.0] * len(tokens)}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_pass_exits_0_with_a_verdict_line(rollouts, capsys):
    assert main(["verify", "--input", rollouts]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("PASS: tree == expanded within 1e-10 relative (max_rel_logprob_err ")
    assert "max_rel_grad_err " in last


def test_fail_exits_1_and_json_says_so(rollouts, capsys):
    # a tolerance below float64's own rounding: the same step cannot meet it
    assert main(["verify", "--input", rollouts, "--tolerance", "1e-30", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["tolerance"] == 1e-30
    assert report["max_rel_grad_err"] > 1e-30
    assert report["verdict"].startswith("FAIL: tree == expanded NOT within 1e-30 relative")


def test_a_planner_is_checked_against_one_microbatch_too(rollouts, capsys):
    assert main(["verify", "--input", rollouts, "--planner", "l1l2", "--microbatch-tokens", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["tolerance"] == 1e-10
    assert "max_rel_grad_err vs one microbatch" in report["verdict"]


def test_out_of_vocabulary_input_names_file_line_and_trajectory(tmp_path, capsys):
    path = tmp_path / "oov.jsonl"
    rec = {"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1], "advantage": 0, "old_logprobs": [0, 0]}
    path.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "id": "b", "tokens": [1, 10**6]}) + "\n")
    for cmd in ("verify", "train"):
        assert main([cmd, "--input", str(path), "--json"]) == 2
        err = json.loads(capsys.readouterr().out)
        assert (err["file"], err["line"], err["field"]) == (str(path), 2, "tokens")
        assert "trajectory 'b': token id 1000000 at position 1 is outside the vocabulary" in err["error"]


def test_help_states_the_exit_code(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit code: 0 when the tree step equals the expanded one within the tolerance" in text
    assert "1 when it does not" in text
