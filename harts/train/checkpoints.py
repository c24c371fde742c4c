"""A run's checkpoints (`TrainConfig.checkpoint`): written, resumed and refused.

A run with `checkpoint.dir` D writes a checkpoint (`harts.distributed.checkpoint`) after
every `checkpoint.every`-th step and after its last step. `checkpoint.resume` loads D's
latest checkpoint (model, optimizer, RNG states) and continues at the step after it, with
the batch that step would have had; with no checkpoint in D yet the run starts at step 1,
so one config serves a first launch and its restarts. A resume refuses a checkpoint written
for other data or with other settings that change the numbers (`RUN_FIELDS`: model, mode,
planner, dtype, optimizer and loss settings, old log-probs, aux scope), and a run without
`checkpoint.resume` refuses a directory that already holds checkpoints.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

from harts.config.train import TrainConfig
from harts.train.errors import TrainError

__all__ = ["RUN_FIELDS", "RunCheckpoints", "check_paths", "data_source", "run_meta"]

# the settings that change a run's numbers, by their key in a checkpoint's metadata: a
# resume must have the checkpoint's values
RUN_FIELDS = {
    "model": "model.name", "mode": "mode", "planner": "plan.planner", "dtype": "precision.dtype",
    "microbatch_tokens": "plan.microbatch_tokens", "lr": "optimizer.lr", "grad_clip": "optimizer.grad_clip",
    "agg_mode": "loss.agg_mode", "kl_coef": "loss.kl_coef", "old_logprobs": "old_logprobs",
    "aux_scope": "aux_scope",
}
# what a checkpoint written before a setting was recorded ran with
_BEFORE_THE_KEY = {"aux_scope": "microbatch"}


def _field(config: TrainConfig, key: str) -> str:
    if key == "model" and config.model.path is not None:
        return "model.path"
    return RUN_FIELDS[key]


def run_meta(config: TrainConfig) -> dict[str, Any]:
    """The settings of `RUN_FIELDS` as a checkpoint records them."""
    meta = {}
    for key in RUN_FIELDS:
        value: Any = config
        for part in _field(config, key).split("."):
            value = getattr(value, part)
        meta[key] = value
    return meta


def data_source(config: TrainConfig) -> str:
    """What the run's batches are drawn from: the input file's content hash, or the preset and seed."""
    if config.data.input is not None:
        with open(config.data.input, "rb") as fh:
            return f"file:sha256={hashlib.file_digest(fh, 'sha256').hexdigest()}"
    return f"workload:{config.data.workload}:seed={config.seed}"


def check_paths(config: TrainConfig) -> None:
    """The checkpoint folder and the Hugging Face save target, checked before any work:
    the folder's parent exists and it is a folder if it exists; the save target's folder
    exists and it is new, empty or a checkpoint directory (what `harts.models.save` replaces)."""
    ck = config.checkpoint
    if ck.dir is not None:
        path = Path(ck.dir)
        if path.exists() and not path.is_dir():
            raise TrainError(f"`checkpoint.dir` {path}: is not a folder", field="checkpoint.dir")
        if not path.parent.is_dir():
            raise TrainError(f"`checkpoint.dir` {path}: folder {path.parent} does not exist (create it first)",
                             field="checkpoint.dir")
    if ck.save is not None:
        target = Path(ck.save)
        if not target.parent.is_dir():
            raise TrainError(f"`checkpoint.save` {ck.save}: folder {target.parent} does not exist (create it "
                             "first)", field="checkpoint.save")
        if target.exists() and not target.is_dir():
            raise TrainError(f"`checkpoint.save` {ck.save}: exists and is not a directory", field="checkpoint.save")
        if target.is_dir() and any(target.iterdir()) and not (target / "config.json").is_file():
            raise TrainError(f"`checkpoint.save` {ck.save}: a non-empty directory that is not a checkpoint; not "
                             "replacing it", field="checkpoint.save")


class RunCheckpoints:
    """The run's checkpointing: `start` is the number of steps already done, `after_step`
    saves when due. Built after the trainer, so the checkpoint loads into its model and
    optimizer; under a process group every rank builds one with its own (sharded) model and
    `group` (default: the default group, when one is initialized)."""

    def __init__(self, config: TrainConfig, model: Any, optimizer: Any, *, group: Any = None):
        self.config = config
        self.start = 0
        self.checkpointer = None
        ck = config.checkpoint
        if ck.dir is None:
            return
        from harts.distributed.checkpoint import CheckpointConfig, Checkpointer, CheckpointError

        self.source = data_source(config)
        self.meta = run_meta(config)
        self.checkpointer = Checkpointer(CheckpointConfig(Path(ck.dir), every=ck.every), model, optimizer, group=group)
        try:
            latest = self.checkpointer.latest()
            if latest is not None and not ck.resume:
                raise TrainError(f"`checkpoint.dir` {ck.dir} already holds checkpoints (latest {latest.name}); "
                                 "set `checkpoint.resume` to continue that run, or choose another folder",
                                 field="checkpoint.dir")
            if ck.resume:
                self._resume(latest)
        except CheckpointError as err:
            raise TrainError(str(err), field="checkpoint.resume" if ck.resume else "checkpoint.dir") from None

    def _resume(self, latest: Path | None) -> None:
        from harts.distributed.checkpoint import read_train_state

        if latest is None:
            print(f"resume: no checkpoint in {self.config.checkpoint.dir} yet; starting at step 1", file=sys.stderr)
            return
        saved = read_train_state(latest)
        for key, value in self.meta.items():
            was = saved.meta.get(key, _BEFORE_THE_KEY.get(key))
            if was != value:
                field = _field(self.config, key)
                raise TrainError(f"`checkpoint.resume`: {latest} was written with `{field}` {was}; "
                                 f"this run has {value}", field=field)
        if saved.data.source != self.source:
            raise TrainError(f"`checkpoint.resume`: {latest} was written for data {saved.data.source}; this run "
                             f"reads {self.source}", field="checkpoint.resume")
        state = self.checkpointer.resume()
        if state.data.next_batch != state.step:
            raise TrainError(f"`checkpoint.resume`: {latest} is at step {state.step} but batch "
                             f"{state.data.next_batch}; a run uses one batch per step", field="checkpoint.resume")
        self.start = state.step

    def latest(self) -> Path | None:
        """The checkpoint a resume would continue from now (None without one)."""
        if self.checkpointer is None:
            return None
        from harts.distributed.checkpoint import CheckpointError

        try:
            return self.checkpointer.latest()
        except CheckpointError:
            return None

    def after_step(self, step: int) -> Path | None:
        """Save after update step `step` (1-based) when it is due or the run's last."""
        if self.checkpointer is None:
            return None
        from harts.distributed.checkpoint import CheckpointError, DataPosition, TrainState

        if not (self.checkpointer.config.due(step) or step == self.config.steps):
            return None
        state = TrainState(step=step, data=DataPosition(self.source, next_batch=step), meta=self.meta)
        try:
            return self.checkpointer.save(state)
        except CheckpointError as err:
            raise TrainError(str(err), field="checkpoint.dir") from None
