"""Fixtures the CLI tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from harts.tree.io import save_jsonl
from harts.tree.workload import generate_trajectories


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> Path:
    """tiny-stepwise (seed 0) as a rollout JSONL file."""
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    save_jsonl(generate_trajectories("tiny-stepwise", seed=0), path)
    return path
