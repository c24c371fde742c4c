"""One way to train: a `harts.config.train.TrainConfig` run in one process, data/tensor/
expert parallel or as pipeline stages (`harts.train.run`), with its checkpoints
(`harts.train.checkpoints`). `harts train` (and `torchrun ... -m harts train`) is flags or a
TOML file -> TrainConfig -> `build_trainer` -> `TrainRun.steps()`."""

from harts.train.checkpoints import RunCheckpoints, data_source, run_meta
from harts.train.errors import TrainError
from harts.train.run import StepRecord, TrainRun, build_trainer, model_config, train

__all__ = ["RunCheckpoints", "StepRecord", "TrainError", "TrainRun", "build_trainer", "data_source", "model_config",
           "run_meta", "train"]
