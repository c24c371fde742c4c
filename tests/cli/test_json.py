"""`--json` on every runnable subcommand, and errors as JSON objects under it."""

from __future__ import annotations

import argparse
import json

import pytest

from harts.cli.main import build_parser, main

ERROR_KEYS = {"error", "file", "line", "field"}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) for every parser in the tree, depth first (argparse subparsers walked
    recursively); a parser with a handler (`func`) is a runnable command."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _runnable():
    return [(" ".join(path), p) for path, p in _commands(build_parser()) if p.get_default("func") is not None]


def test_the_walk_finds_the_commands():
    names = {name for name, _ in _runnable()}
    # a sample across families, nested actions and handlers on a parser with actions
    for name in ("workload generate", "workload presets", "tree stats", "plan", "plan planners", "plan make",
                 "sim", "sim sweep", "sim fit", "train", "verify", "bench", "run", "report", "experiment",
                 "model params"):
        assert name in names, name


@pytest.mark.parametrize("name,parser", _runnable(), ids=[name for name, _ in _runnable()])
def test_every_command_takes_json_as_a_flag(name, parser):
    flags = [a for a in parser._actions if "--json" in a.option_strings]
    assert len(flags) == 1, f"harts {name} has no --json"
    assert flags[0].nargs == 0 and flags[0].default is False, f"harts {name}: --json must be a plain flag"


def _error(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_user_error_as_json(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    good = '{"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1], "advantage": 0, "old_logprobs": [0, 0]}'
    bad.write_text(good + "\n" + good.replace('"a"', '"b"').replace("[1, 2]", "[1, -2]") + "\n")
    code, err, stderr = _error(capsys, ["tree", "stats", "--input", str(bad), "--json"])
    assert code == 2 and set(err) == ERROR_KEYS and stderr == ""
    assert err["file"] == str(bad) and err["line"] == 2 and err["field"] == "tokens"
    assert "position 1 is negative" in err["error"]


def test_error_without_a_file_has_null_keys(capsys):
    code, err, _ = _error(capsys, ["tree", "stats", "--workload", "no-such-preset", "--json"])
    assert code == 2 and set(err) == ERROR_KEYS
    assert err["file"] is None and err["line"] is None and err["field"] is None and err["error"]


def test_argparse_errors_as_json_and_as_text(capsys):
    code, err, _ = _error(capsys, ["plan", "planners", "--json", "--bogus"])
    assert code == 2 and set(err) == ERROR_KEYS and "--bogus" in err["error"]
    code = main(["plan", "planners", "--bogus"])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and "unrecognized arguments: --bogus" in out.err


def test_output_path_error_names_the_flag(tmp_path, capsys):
    code, err, _ = _error(capsys, ["workload", "generate", "--workload", "tiny-stepwise",
                                   "--out", str(tmp_path / "missing" / "w.jsonl"), "--json"])
    assert code == 2 and err["field"] == "--out" and "does not exist" in err["error"]


def test_json_output_of_the_two_commands_that_lacked_it(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert main(["workload", "generate", "--workload", "tiny-stepwise", "--out", str(out), "--json"]) == 0
    got = capsys.readouterr()
    d = json.loads(got.out)
    assert d["out"] == str(out) and d["trajectories"] == sum(1 for _ in out.open()) and d["tokens"] > 0
    assert f"wrote {out}" in got.err  # stdout stays pure JSON
    assert main(["plan", "planners", "--json"]) == 0
    assert "l1l2" in json.loads(capsys.readouterr().out)["planners"]
