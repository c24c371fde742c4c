"""Table 3: within-microbatch prefix compression per model / GPU count / sampling scheme."""

from harts.experiments.compression.study import STUDY, CompressionConfig, run

__all__ = ["STUDY", "CompressionConfig", "run"]
