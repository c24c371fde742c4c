"""`harts train` as a user meets it: every default that changes a run stated in --help (and
every other command's defaults), each step printed once, --aux-scope reaching the loss,
and the README's checkpoint line resumable by the README's resume line."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from harts.cli.main import build_parser, main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return " ".join(formatter._expand_help(action).split()) if action.help else ""


def test_every_option_with_a_default_value_states_it_in_help():
    missing = []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            default = action.default
            if (not action.option_strings or default is None or default is False or default == argparse.SUPPRESS
                    or default == [] or isinstance(action, argparse._HelpAction)):
                continue
            if "default" not in _help_of(parser, action).lower():
                missing.append(f"harts {' '.join(path)} {action.option_strings[-1]}")
    assert not missing, missing


@pytest.mark.parametrize("flag, shown", [
    ("--mode", "(default: expanded)"), ("--planner", "default: whole trees"), ("--dtype", "default float32"),
    ("--steps", "default 3"), ("--lr", "(default: 0.0001)"), ("--microbatch-tokens", "(default: 4096)"),
    ("--aux-scope", "(default: microbatch)"), ("--old-logprobs", "(default: recompute)"),
    ("--agg-mode", "(default: token-mean)"), ("--grad-clip", "(default: 1.0)"), ("--kl-coef", "(default: 0.0)"),
    ("--model", "(default: tiny-cpu)"), ("--workload", "default tiny-treestep"), ("--seed", "(default: 0)"),
    ("--checkpoint-every", "default: after the last step only"),
])
def test_train_help_states_the_defaults_that_change_the_run(flag, shown):
    (parser,) = [p for path, p in _parsers(build_parser()) if path == ("train",)]
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    assert shown in _help_of(parser, action), _help_of(parser, action)


def test_each_step_is_printed_once(rollouts, capsys):
    assert main(["train", "--mode", "tree", "--input", str(rollouts), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for step in (1, 2):
        assert len(re.findall(rf"^\s*{step}\b|^step {step}\b", out, flags=re.M)) == 1, out
    line = next(ln for ln in out.splitlines() if ln.startswith("step 2"))
    for name in ("loss", "pg", "kl", "aux", "grad_norm", "entropy", "clip_frac", "tok/s"):
        assert f" {name} " in f" {line} ", (name, line)
    assert main(["train", "--mode", "tree", "--input", str(rollouts), "--steps", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert [s["step"] for s in json.loads(out)["steps"]] == [1, 2]  # the whole of stdout is one JSON object


def _aux(argv: list[str], capsys) -> float:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["steps"][0]["aux_loss"]


def test_aux_scope_reaches_the_loss(rollouts, capsys):
    """The aux loss of a step split into several microbatches: per microbatch by default; with
    --aux-scope global the step's own, the value of the same step as one microbatch."""
    base = ["train", "--mode", "expanded", "--input", str(rollouts), "--steps", "1", "--dtype", "float64"]
    whole = _aux([*base, "--microbatch-tokens", "100000"], capsys)
    split = _aux([*base, "--microbatch-tokens", "200"], capsys)
    split_global = _aux([*base, "--microbatch-tokens", "200", "--aux-scope", "global"], capsys)
    assert abs(split - whole) > 1e-6 * whole  # the split changes the microbatch-scope aux loss
    assert abs(split_global - whole) <= 1e-12 * whole
    assert main([*base, "--aux-scope", "step"]) == 2  # argparse's choices
    capsys.readouterr()


def test_a_resume_refuses_another_aux_scope(rollouts, tmp_path, capsys):
    base = ["train", "--mode", "tree", "--input", str(rollouts), "--json", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*base, "--steps", "1"]) == 0
    capsys.readouterr()
    assert main([*base, "--steps", "2", "--resume", "--aux-scope", "global"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["field"] == "--aux-scope" and "--aux-scope microbatch; this run has global" in err["error"]


def _readme_line(flag: str) -> list[str]:
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", README, flags=re.S) if "--checkpoint-every" in b]
    (argv,) = [argv for ln in block.splitlines() if flag in (argv := shlex.split(ln, comments=True))]
    return argv


def test_the_readme_checkpoint_and_resume_lines_agree_on_every_run_flag(rollouts, tmp_path, capsys, monkeypatch):
    """The resume line refuses a checkpoint written with other settings that change the numbers:
    the README's two lines must give each of those the same value."""
    write = _readme_line("--checkpoint-every")
    resume = _readme_line("--resume")
    assert write[0] == "harts" and resume[:4] == ["torchrun", "--nproc-per-node", "2", "-m"]
    from harts.cli.train import resolve_config
    from harts.train import run_meta

    parser = build_parser()
    (a, _), (b, _) = (resolve_config(parser.parse_args(argv)) for argv in (write[1:], resume[5:]))
    assert run_meta(a) == run_meta(b)
    # and the checkpoint line runs as written (then continues in one process with --resume)
    monkeypatch.chdir(tmp_path)
    Path("rollouts.jsonl").write_bytes(rollouts.read_bytes())
    assert main(write[1:]) == 0
    assert "checkpoint ckpt/step-000004" in capsys.readouterr().out
    assert main([*write[1:], "--steps", "5", "--resume", "--json"]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)["steps"]] == [5]


def test_a_trajectory_longer_than_the_budget(tmp_path, capsys):
    """Expanded mode cuts a trajectory longer than the budget into a chain of windows (the
    expanded-ffd plan) and stays within the budget, with the per-trajectory step's losses in
    float64; tree mode without a planner runs whole trees and says so, with a planner it
    splits them at the budget."""
    from harts.tree.io import save_jsonl
    from tests.strategies import long_chain_trajectories

    path = tmp_path / "long.jsonl"
    save_jsonl(long_chain_trajectories(300, [(3, 60), (130, 40)], seed=1), path)
    base = ["train", "--input", str(path), "--steps", "1", "--dtype", "float64", "--model", "tiny-cpu"]

    def run(*extra):
        assert main([*base, *extra]) == 0
        out = capsys.readouterr().out
        return out.splitlines()[0], main([*base, *extra, "--json"]) == 0 and json.loads(capsys.readouterr().out)

    whole_line, whole = run("--mode", "expanded", "--microbatch-tokens", "4096")
    line, chained = run("--mode", "expanded", "--microbatch-tokens", "128")
    assert "microbatches of <= 128 tokens" in line, line
    assert chained["steps"][0]["microbatches"] > whole["steps"][0]["microbatches"]
    assert chained["steps"][0]["largest_microbatch_rows"] <= 128
    for key in ("pg_loss", "entropy"):
        assert chained["steps"][0][key] == pytest.approx(whole["steps"][0][key], rel=1e-10, abs=1e-12)
    line, tree = run("--mode", "tree", "--microbatch-tokens", "128")
    assert "over the budget 128" in line and tree["steps"][0]["largest_microbatch_rows"] > 128, line
    line, windows = run("--mode", "tree", "--planner", "l1l2", "--microbatch-tokens", "128")
    assert "of <= 128 tokens" in line and windows["steps"][0]["largest_microbatch_rows"] <= 128, line
