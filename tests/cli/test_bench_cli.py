"""`harts bench` on a machine without a GPU, and `harts tree stats` duplicate counts."""

import dataclasses
import json

import pytest
import torch

from harts.cli.main import main
from harts.tree.io import save_jsonl
from harts.tree.workload import generate_trajectories


def test_bench_input_without_a_gpu_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "rollouts.jsonl"
    save_jsonl(generate_trajectories("tiny-treestep"), path)
    assert main(["bench", "--input", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith(f"harts: error: harts bench --input {path}: no CUDA device here")


def test_bench_set_needs_a_workload(capsys):
    assert main(["bench", "--set", "num_groups=2"]) == 2
    assert "--set needs --workload" in capsys.readouterr().err


def test_bench_sources_are_exclusive(capsys):
    assert main(["bench", "--input", "a.jsonl", "--workload", "tiny-treestep"]) == 2


def test_tree_stats_counts_duplicates(capsys, tmp_path):
    trajs = generate_trajectories("tiny-treestep")
    path = tmp_path / "rollouts.jsonl"
    save_jsonl(trajs + [dataclasses.replace(trajs[0], id="copy")], path)
    assert main(["tree", "stats", "--input", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["duplicate_trajectories"] == 1
    assert stats["distinct_trajectories"] == len(trajs)


def test_bench_workload_steps_take_the_models_vocabulary():
    import argparse

    from harts.cli.bench import _steps

    args = argparse.Namespace(input=None, workload="tiny-treestep", set=["num_groups=1"], schemes=None)
    [(label, name, over, trajs)] = _steps(args, vocab=300)
    assert (label, name) == ("tiny-treestep", "tiny-treestep")
    assert over == {"num_groups": "1", "vocab_size": "300"}
    assert len({t.group for t in trajs}) == 1 and max(int(t.tokens.max()) for t in trajs) < 300
    args.set = ["vocab_size=512"]
    from harts.cli.common import UserError

    with pytest.raises(UserError, match="beyond the model's 300"):
        _steps(args, vocab=300)
