"""Table 6: the three pipeline schedules (non-overlap, overlap + backward-first, consumer 1F1B)."""

from harts.experiments.pp_schedules.study import STUDY, PPSchedulesConfig, run

__all__ = ["STUDY", "PPSchedulesConfig", "run"]
