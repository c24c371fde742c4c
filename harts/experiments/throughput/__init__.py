"""Figure 4: simulated update-throughput speedups over the expanded baseline, per preset."""

from harts.experiments.throughput.study import STUDY, ThroughputConfig, run

__all__ = ["STUDY", "ThroughputConfig", "run"]
