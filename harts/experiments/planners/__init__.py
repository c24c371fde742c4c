"""Table 4: OR-Tools+FFD vs HARTS L1 vs L1+L2 (compression, balance, planning time)."""

from harts.experiments.planners.study import STUDY, PlannersConfig, run

__all__ = ["STUDY", "PlannersConfig", "run"]
