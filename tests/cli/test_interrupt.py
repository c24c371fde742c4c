"""Ctrl-C: one line on stderr, exit code 130, no traceback; `harts train` names its last
finished step and checkpoint and, under --json, still prints the finished steps; an
interrupt inside a checkpoint write is an interrupt (not a bad-input error) and leaves the
checkpoint directory as it was."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harts.cli.main import main
from harts.distributed.checkpoint import latest_checkpoint, verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _interrupt_step(monkeypatch, at: int) -> None:
    """Ctrl-C as update step `at` (1-based) starts."""
    from harts.exec.tree_trainer import TreeTrainer

    calls = {"n": 0}
    step = TreeTrainer.step

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(TreeTrainer, "step", interrupted)


def test_train_interrupted_at_a_step_boundary(rollouts, tmp_path, monkeypatch, capsys):
    _interrupt_step(monkeypatch, 3)
    ck = tmp_path / "ck"
    argv = ["train", "--mode", "tree", "--input", str(rollouts), "--steps", "5", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "1"]
    assert main([*argv, "--json"]) == 130
    out, err = capsys.readouterr()
    assert err == f"harts: interrupted after step 2; checkpoint at {ck / 'step-000002'}\n"
    report = json.loads(out)
    assert [s["step"] for s in report["steps"]] == [1, 2] and report["interrupted"] is True

    _interrupt_step(monkeypatch, 1)  # before any step of a fresh run, without checkpoints
    assert main(["train", "--mode", "tree", "--input", str(rollouts), "--steps", "2"]) == 130
    out, err = capsys.readouterr()
    assert err == "harts: interrupted after step 0; no checkpoint\n" and "Traceback" not in out


def test_train_interrupted_inside_a_checkpoint_write(rollouts, tmp_path, monkeypatch, capsys):
    """DCP catches the KeyboardInterrupt of its write and re-raises it wrapped in an error:
    still exit code 130 with the one line, the last complete checkpoint stays the latest and
    the half-written one is gone."""
    import torch.distributed.checkpoint.filesystem as fs

    ck = tmp_path / "ck"
    argv = ["train", "--mode", "tree", "--input", str(rollouts), "--steps", "4", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "2", "--json"]
    write = fs._write_files_from_queue
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint's (step 4)
            raise KeyboardInterrupt
        return write(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_files_from_queue", interrupted)
    assert main(argv) == 130
    out, err = capsys.readouterr()
    assert err == f"harts: interrupted after step 4; checkpoint at {ck / 'step-000002'}\n"
    assert [s["step"] for s in json.loads(out)["steps"]] == [1, 2, 3, 4]
    assert latest_checkpoint(ck) == ck / "step-000002"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000002"]
    monkeypatch.setattr(fs, "_write_files_from_queue", write)
    assert main([*argv, "--resume"]) == 0  # and it resumes from there
    assert [s["step"] for s in json.loads(capsys.readouterr().out)["steps"]] == [3, 4]


def test_any_command_interrupted_prints_one_line(monkeypatch, capsys):
    import harts.cli.tree

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(harts.cli.tree, "print_json", interrupted)
    assert main(["tree", "stats", "--workload", "tiny-treestep", "--json"]) == 130
    out, err = capsys.readouterr()
    assert (out, err) == ("", "harts: interrupted\n")


def _wait_for(proc: subprocess.Popen, ready, timeout: float = 300.0) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready(lines):
            return lines
        line = proc.stdout.readline() if ready.reads else None
        if line == "" and proc.poll() is not None:
            break
        if line:
            lines.append(line)
        if not ready.reads:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"not ready: {lines} {proc.stderr.read()}")


def _harts(args: list[str], cwd: Path) -> subprocess.Popen:
    """`python -m harts ARGS` with SIGINT at its default disposition, as a foreground command
    starts: an ignored SIGINT is inherited across exec (a shell starts its background jobs
    so, and a test run started in the background passes it on), and a process started with
    it ignored rightly ignores Ctrl-C."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "harts", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_sigint_to_a_running_harts_train(rollouts, tmp_path):
    """The real signal, to `python -m harts train`: after its first step is printed, and under
    --json after its first checkpoint is written."""
    proc = _harts(["train", "--mode", "tree", "--input", str(rollouts), "--steps", "100000"], tmp_path)

    def first_step(lines):
        return any(ln.startswith("step 1 ") for ln in lines)
    first_step.reads = True
    _wait_for(proc, first_step)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert len(err.splitlines()) == 1 and err.startswith("harts: interrupted after step ") and "no checkpoint" in err

    ck = tmp_path / "ck"
    proc = _harts(["train", "--mode", "tree", "--input", str(rollouts), "--steps", "100000", "--json",
                   "--checkpoint-dir", str(ck), "--checkpoint-every", "1"], tmp_path)

    def checkpointed(_lines):
        return (ck / "latest").is_file()
    checkpointed.reads = False
    _wait_for(proc, checkpointed)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert len(err.splitlines()) == 1 and "checkpoint at " in err, err
    steps = json.loads(out)["steps"]
    assert steps and [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert f"interrupted after step {len(steps)};" in err
    latest = latest_checkpoint(ck)
    verify_checkpoint(latest)  # complete: every file its manifest lists, with its hash
    assert f"checkpoint at {latest}" in err and not list(ck.glob("*.tmp"))
