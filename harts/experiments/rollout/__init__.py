"""Heddle's rollout scheduling vs step-centric baselines, with its ablations, over seeds."""

from harts.experiments.rollout.study import STUDY, RolloutStudyConfig, run

__all__ = ["STUDY", "RolloutStudyConfig", "run"]
