"""The README's code blocks, run as written: the main job, every command of "Command line"
(those needing a GPU must refuse cleanly without one), and the Python example, whose losses
must be those of the `harts train` command the README names next to it."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(lang: str, section: str | None = None) -> list[str]:
    text = README
    if section is not None:
        start = text.index(f"## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end >= 0 else None]
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _commands() -> list[str]:
    (block,) = _blocks("bash", "Command line")
    return [line for line in block.splitlines() if line.strip()]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)  # the README's commands use the embedded ./harts-runs
    env["CUDA_VISIBLE_DEVICES"] = ""  # the GPU commands are checked for their refusal
    return env


def _harts(command: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command, comments=True)
    assert argv[0] == "harts", command
    return subprocess.run([sys.executable, "-m", "harts", *argv[1:]], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=600)


def test_every_command_line_command_runs_as_written(tmp_path, monkeypatch, capsys):
    """In process (one torch import for all of them), from an empty folder, in order."""
    import torch

    from harts.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the GPU lines must refuse
    commands = _commands()
    assert len(commands) >= 15 and not any("|" in shlex.split(c, comments=True) for c in commands)
    for command in commands:
        argv = shlex.split(command, comments=True)
        assert argv[0] == "harts", command
        code = main(argv[1:])
        res = capsys.readouterr()
        if "# GPU:" in command:
            assert code == 2, (command, res.err)
            assert res.err.count("\n") == 1 and "CUDA" in res.err, (command, res.err)
            continue
        assert code == 0, (command, res.out[-2000:], res.err[-2000:])
        if "--json" in command:
            json.loads(res.out)
        if command.startswith("harts verify"):
            verdict = json.loads(res.out)["verdict"] if "--json" in command else res.out.splitlines()[-1]
            assert verdict.startswith("PASS: tree == expanded within 1e-10 relative"), command
    for name in ("rollouts.jsonl", "plan.json", "harts-runs/mlflow.db", "harts-runs/report.html",
                 "sweep.png"):
        assert (tmp_path / name).is_file(), name


def test_python_example_prints_the_losses_of_harts_train(tmp_path):
    assert _harts("harts workload generate --workload tiny-stepwise --out rollouts.jsonl", tmp_path).returncode == 0
    (example,) = _blocks("python", "Rollout input format")
    run = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    py_losses = [float(line.split()[1]) for line in run.stdout.splitlines()]
    named = re.search(r"It prints the losses of `(harts train[^`]*)`", README.replace("\n", " "))
    assert named is not None
    cli = _harts(named.group(1) + " --json", tmp_path)
    assert cli.returncode == 0, cli.stderr
    cli_losses = [step["loss"] for step in json.loads(cli.stdout)["steps"]]
    assert len(py_losses) == len(cli_losses) == 3
    # the same steps in two processes: equal to the 6 printed digits
    assert [f"{x:.6f}" for x in cli_losses] == [f"{x:.6f}" for x in py_losses]


@pytest.mark.parametrize("line", [ln for ln in _blocks("bash")[0].splitlines() if "harts run" in ln])
def test_main_job_runs_as_written(line, tmp_path):
    command = line.split("&&", 1)[1].split("#")[0].strip()
    assert command == "python3 -m harts run"
    res = subprocess.run(shlex.split(command.replace("python3", sys.executable, 1)), cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "equivalent to expanded training within 1e-10: yes" in res.stdout
    assert "mlflow ui --backend-store-uri" in res.stdout and (tmp_path / "harts-runs" / "mlflow.db").is_file()


def test_checkpoint_commands_run_as_written(tmp_path):
    """The "Your own checkpoint" block on a tiny transformers-built Kimi-Linear checkpoint:
    every line exits 0, and the saved directory loads in transformers with the trained
    weights."""
    import torch
    from transformers import KimiLinearForCausalLM

    from harts.models import load
    from harts.tree.io import save_jsonl
    from tests.models.test_kimi_linear import _hf_model, _trajectories

    _hf_model().save_pretrained(tmp_path / "tiny-kimi")
    save_jsonl(_trajectories(), tmp_path / "rollouts.jsonl")
    (block,) = _blocks("bash", "Your own checkpoint")
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 3
    for command in commands:
        res = _harts(command, tmp_path)
        assert res.returncode == 0, f"{command}\n{res.stdout}\n{res.stderr}"
    assert (tmp_path / "logprobs.jsonl").read_text().count("\n") == len(_trajectories())
    trained = KimiLinearForCausalLM.from_pretrained(tmp_path / "tiny-kimi-trained", torch_dtype=torch.float64)
    before = _hf_model().state_dict()
    after = trained.state_dict()
    assert set(after) == set(before)
    assert any(not torch.equal(after[k], before[k]) for k in after)  # the steps changed the weights
    reloaded = load(tmp_path / "tiny-kimi-trained").model.state_dict()
    assert all(torch.isfinite(t).all() for t in reloaded.values())


_STEP_LINE = re.compile(r"^step (\d+)\s+loss (\S+)\s+pg (\S+)\s.*?grad_norm (\S+)", re.M)


def _distributed_argv(line: str) -> list[str]:
    """A "More than one GPU" line as this interpreter runs it: `torchrun` is
    `python -m torch.distributed.run` with the same arguments, `harts` is `python -m harts`."""
    argv = shlex.split(line, comments=True)
    if argv[0] == "torchrun":
        assert argv[argv.index("-m") + 1] == "harts", line
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    assert argv[0] == "harts", line
    return [sys.executable, "-m", "harts", *argv[1:]]


def test_distributed_commands_run_as_written(tmp_path):
    """Every line of "More than one GPU", in order, from a folder holding the rollouts.jsonl
    of "Command line" (tiny-stepwise: 2 trees, 16 trajectories), on the CPU: no CUDA device,
    so the lines' default device is the CPU and their process groups gloo, in the default
    dtype (float32) where a line names none. Each exits 0. A training line prints one line
    per step it runs, with finite numbers: steps 1..--steps, or with --resume the steps after
    the checkpoint the line before wrote; lines training the same first step (the same
    model, rollouts and loss, split another way) print the same policy loss and about the
    same gradient norm (the model's MoE aux loss is per microbatch, so it and its gradient
    change a little with the split). A verify line passes. torchrun's port comes from PET_MASTER_PORT (its --master-port), so
    concurrent tests do not share one."""
    from harts.distributed.runner import free_port

    (block,) = _blocks("bash", "More than one GPU")
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) >= 5
    assert _harts("harts workload generate --workload tiny-stepwise --out rollouts.jsonl", tmp_path).returncode == 0
    first_steps: dict[bool, list[tuple[str, float, float]]] = {}
    for line in lines:
        argv = shlex.split(line, comments=True)
        ckpt = tmp_path / argv[argv.index("--checkpoint-dir") + 1] if "--checkpoint-dir" in argv else None
        before = max((int(d.name.removeprefix("step-")) for d in ckpt.glob("step-*")), default=0) if ckpt else 0
        env = dict(_env(), PET_MASTER_PORT=str(free_port()))
        res = subprocess.run(_distributed_argv(line), cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, f"{line}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        if "verify" in argv:
            report = json.loads(res.stdout)
            assert report["passed"] is True and report["verdict"].startswith("PASS"), (line, report["verdict"])
            continue
        assert "train" in argv, line
        steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 3
        printed = [(int(m[1]), float(m[2]), float(m[3]), float(m[4])) for m in _STEP_LINE.finditer(res.stdout)]
        numbers = [n for p in printed for n in p[1:]]
        assert all(math.isfinite(x) for x in numbers), (line, res.stdout)
        done = [p[0] for p in printed]
        if "--resume" in argv:  # the steps after the latest checkpoint the lines before wrote
            assert before > 0 and done == list(range(before + 1, steps + 1)), (line, before, res.stdout)
            assert (ckpt / f"step-{steps:06d}").is_dir(), line
        else:
            assert done == list(range(1, steps + 1)), (line, res.stdout)
            first_steps.setdefault("--old-logprobs" in argv, []).append((line, printed[0][2], printed[0][3]))
        if "--checkpoint-every" in argv:
            every = int(argv[argv.index("--checkpoint-every") + 1])
            assert all((ckpt / f"step-{s:06d}").is_dir() for s in range(every, steps + 1, every)), line
    # the policy loss printed to 6 decimals: equal up to float32 rounding and the print's
    for runs in first_steps.values():
        _, pg, norm = runs[0]
        for line, other_pg, other_norm in runs[1:]:
            assert abs(other_pg - pg) <= 2e-6 and abs(other_norm - norm) <= 1e-3 * norm, (line, runs[0])
    assert len(first_steps[False]) >= 4 and len(first_steps[True]) >= 2, first_steps
