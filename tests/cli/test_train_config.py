"""`harts train` as flags -> TrainConfig -> harts.train: `--print-config` writes the
resolved config as TOML and `--config FILE` reads it back; a flag given on the command
line wins over the file, the file over the defaults; errors name the flag, or the file and
its key; every result carries the run's config. One config file runs in one process and,
with `--parallel dp=2`, under torchrun: the same steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harts.cli.main import build_parser, main
from harts.cli.train import resolve_config
from harts.config.kernels import KernelConfig
from harts.config.train import DataSource, TrainConfig, TrainParallel

ROOT = Path(__file__).resolve().parents[2]


def _resolved(argv: list[str]) -> TrainConfig:
    return resolve_config(build_parser().parse_args(["train", *argv]))[0]


def test_the_flags_defaults_are_the_configs():
    assert _resolved([]) == TrainConfig(kernels=KernelConfig.from_env())


def test_print_config_writes_the_resolved_config_that_config_reads_back(tmp_path, capsys):
    argv = ["--mode", "tree", "--input", "r.jsonl", "--steps", "2", "--lr", "3e-4", "--grad-clip", "0",
            "--parallel", "pp=2", "--schedule", "non-overlap", "--old-logprobs", "input", "--dtype", "float64",
            "--tree-attention", "varlen", "--compile", "aot_eager"]
    assert main(["train", *argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "run.toml"
    path.write_text(text)
    config = TrainConfig.from_toml(path)
    assert config == _resolved(argv)
    assert config.optimizer.grad_clip is None and config.optimizer.lr == 3e-4
    assert config.parallel == TrainParallel(pp=2, schedule="non-overlap") and config.kernels.tree_attention == "varlen"
    assert config.kernels.compile == "aot_eager"
    assert config.data == DataSource(input="r.jsonl") and config.precision.dtype == "float64"
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == text


def test_flags_given_override_the_files_values(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('mode = "tree"\nsteps = 5\nold_logprobs = "input"\n\n[data]\nworkload = "tiny-stepwise"\n\n'
                    '[optimizer]\nlr = 0.001\n\n[parallel]\ndp = 2\nschedule = "non-overlap"\n')
    file = TrainConfig.from_toml(path)
    config = _resolved(["--config", str(path), "--steps", "1", "--input", "r.jsonl"])
    # given: steps and input (the file's workload gives way); the rest is the file's
    assert config == file.override({"steps": 1, "data.input": "r.jsonl", "data.workload": None}).replace(
        kernels=KernelConfig.from_env())
    # a flag given with its default value still wins over the file
    assert _resolved(["--config", str(path), "--old-logprobs", "recompute"]).old_logprobs == "recompute"
    # --parallel replaces the file's degrees and keeps its schedule
    assert _resolved(["--config", str(path), "--parallel", "tp=2"]).parallel == TrainParallel(
        tp=2, schedule="non-overlap")
    # the same file with [parallel] dp=2 as with --parallel dp=2
    plain = tmp_path / "plain.toml"
    plain.write_text(file.replace(parallel=None).to_toml())
    assert _resolved(["--config", str(plain), "--parallel", "dp=2"]) == _resolved(["--config", str(path),
                                                                                   "--schedule", "consumer-1f1b"])


def _error(argv: list[str], capsys) -> dict:
    assert main(["train", *argv, "--json"]) == 2
    return json.loads(capsys.readouterr().out)


def test_errors_name_the_flag_or_the_files_key(tmp_path, capsys):
    err = _error(["--checkpoint-every", "2"], capsys)
    assert err["error"] == "--checkpoint-every needs --checkpoint-dir" and err["field"] == "--checkpoint-every"
    assert _error(["--schedule", "non-overlap"], capsys)["field"] == "--schedule"
    path = tmp_path / "run.toml"
    path.write_text("[checkpoint]\nevery = 2\n")
    err = _error(["--config", str(path)], capsys)
    assert err == {"error": "checkpoint.every needs checkpoint.dir", "file": str(path), "line": None,
                   "field": "checkpoint.every"}
    path.write_text("[optimizer]\nlearning_rate = 0.1\n")
    err = _error(["--config", str(path)], capsys)
    assert "unknown key optimizer.learning_rate" in err["error"] and err["file"] == str(path)
    # the file's settings refused together: named by their keys
    path.write_text('mode = "tree"\n[parallel]\npp = 2\n')
    err = _error(["--config", str(path)], capsys)
    assert err["field"] == "old_logprobs" and "parallel with pp > 1 needs old_logprobs input" in err["error"]


def test_the_json_output_carries_the_config(rollouts, capsys):
    argv = ["--mode", "tree", "--input", str(rollouts), "--steps", "1", "--dtype", "float64"]
    assert main(["train", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert TrainConfig.from_dict(out["config"]) == _resolved(argv)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_one_config_file_in_one_process_and_under_torchrun(rollouts, tmp_path):
    """`harts train --config FILE` and `torchrun --nproc-per-node 2 -m harts train --config
    FILE --parallel dp=2` both run the file's config through harts.train (their outputs carry
    it): the same steps, the policy loss equal up to float32 rounding and the gradient norm
    about equal (the MoE aux loss is per microbatch, so it changes a little with the split)."""
    from harts.distributed.runner import free_port

    (tmp_path / "rollouts.jsonl").write_bytes(rollouts.read_bytes())
    path = tmp_path / "run.toml"
    path.write_text('mode = "tree"\nsteps = 2\n\n[data]\ninput = "rollouts.jsonl"\n\n[precision]\ndevice = "cpu"\n')
    file = TrainConfig.from_toml(path)
    one = subprocess.run([sys.executable, "-m", "harts", "train", "--config", str(path), "--json"], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "harts", "train", "--config", str(path), "--parallel", "dp=2",
                          "--json"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    one, two = json.loads(one.stdout), json.loads(two.stdout)
    kernels = KernelConfig.from_env()
    assert TrainConfig.from_dict(one["config"]) == file.replace(kernels=kernels)
    assert TrainConfig.from_dict(two["config"]) == file.replace(kernels=kernels, parallel=TrainParallel(dp=2))
    assert two["world_size"] == 2 and two["applied"] == ["fsdp"] and "world_size" not in one
    assert [s["step"] for s in one["steps"]] == [s["step"] for s in two["steps"]] == [1, 2]
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert abs(a["pg_loss"] - b["pg_loss"]) <= 2e-6 * max(1.0, abs(a["pg_loss"])), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"], (a, b)
        assert a["tokens"] == b["tokens"]
