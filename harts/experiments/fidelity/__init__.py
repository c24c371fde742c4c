"""Table 7 / Figure 5: tree vs expanded numerical fidelity on CPU, by handoff depth, with and
without replay."""

from harts.experiments.fidelity.study import STUDY, FidelityConfig, run

__all__ = ["STUDY", "FidelityConfig", "run"]
