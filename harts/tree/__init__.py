"""Rollout trees: the data model every other package builds on (numpy only, no torch)."""

from harts.tree.build import build_forest, build_structure
from harts.tree.forest import Payload, RolloutForest, Targets
from harts.tree.io import RolloutFormatError, from_records, load_jsonl, save_jsonl
from harts.tree.trajectory import Trajectory, TrajectoryError

__all__ = [
    "Payload",
    "RolloutForest",
    "RolloutFormatError",
    "Targets",
    "Trajectory",
    "TrajectoryError",
    "build_forest",
    "build_structure",
    "from_records",
    "load_jsonl",
    "save_jsonl",
]
