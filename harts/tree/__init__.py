"""Rollout trees: the data model every other package builds on (numpy only, no torch)."""

from harts.tree.trajectory import Trajectory, TrajectoryError

__all__ = ["Trajectory", "TrajectoryError"]
