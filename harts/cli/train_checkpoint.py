"""`harts train`'s checkpoint flags: `--checkpoint-dir`, `--checkpoint-every`, `--resume`.

A run with `--checkpoint-dir D` writes a checkpoint (`harts.distributed.checkpoint`) after every
`--checkpoint-every` N-th step and after its last step. `--resume` loads D's latest
checkpoint (model, optimizer, RNG states) and continues at the step after it, with the
batch that step would have had; with no checkpoint in D yet the run starts at step 1, so
one command line serves a first launch and its restarts. A resume refuses a checkpoint
written for other data or with other settings that change the numbers (model, mode,
planner, dtype, optimizer and loss settings, aux scope), and a run without `--resume` refuses a
directory that already holds checkpoints.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

from harts.cli.common import UserError

# the flags whose values change a run's numbers: a resume must have the checkpoint's
_RUN_FLAGS = ("model", "mode", "planner", "dtype", "microbatch_tokens", "lr", "grad_clip", "agg_mode",
              "kl_coef", "old_logprobs", "aux_scope")
# what a checkpoint written before a flag existed ran with
_BEFORE_THE_FLAG = {"aux_scope": "microbatch"}


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="write checkpoints (torch.distributed.checkpoint) into DIR: after every "
                   "--checkpoint-every steps and after the last step")
    p.add_argument("--checkpoint-every", type=int, metavar="N", default=None,
                   help="checkpoint after every N-th step (needs --checkpoint-dir; default: after the last step only)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run from the latest checkpoint in --checkpoint-dir (from step 1 "
                   "if it holds none yet)")


def check_flags(args: argparse.Namespace) -> None:
    """The flags' own consistency, before any work."""
    if args.checkpoint_dir is None:
        for flag, value in (("--checkpoint-every", args.checkpoint_every), ("--resume", args.resume or None)):
            if value is not None:
                raise UserError(f"{flag} needs --checkpoint-dir", field=flag)
        return
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UserError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}", field="--checkpoint-every")
    path = Path(args.checkpoint_dir)
    if path.exists() and not path.is_dir():
        raise UserError(f"--checkpoint-dir {path}: is not a folder", field="--checkpoint-dir")
    if not path.parent.is_dir():
        raise UserError(f"--checkpoint-dir {path}: folder {path.parent} does not exist (create it first)",
                        field="--checkpoint-dir")


def data_source(args: argparse.Namespace) -> str:
    """What the run's batches are drawn from: the input file's content hash, or the preset and seed."""
    if args.input is not None:
        with open(args.input, "rb") as fh:
            return f"file:sha256={hashlib.file_digest(fh, 'sha256').hexdigest()}"
    return f"workload:{args.workload or 'tiny-treestep'}:seed={args.seed}"


class RunCheckpoints:
    """The run's checkpointing: `start` is the number of steps already done, `after_step`
    saves when due. Built after the trainer, so the checkpoint loads into its model and optimizer;
    under a process group every rank builds one with its own (sharded) model and `group`
    (default: the default group, when one is initialized)."""

    def __init__(self, args: argparse.Namespace, model: Any, optimizer: Any, *, group: Any = None):
        self.args = args
        self.start = 0
        self.checkpointer = None
        if args.checkpoint_dir is None:
            return
        from harts.distributed.checkpoint import CheckpointConfig, Checkpointer, CheckpointError

        self.source = data_source(args)
        self.meta = {k: getattr(args, k, _BEFORE_THE_FLAG.get(k)) for k in _RUN_FLAGS}
        self.checkpointer = Checkpointer(CheckpointConfig(Path(args.checkpoint_dir), every=args.checkpoint_every),
                                         model, optimizer, group=group)
        try:
            latest = self.checkpointer.latest()
            if latest is not None and not args.resume:
                raise UserError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (latest "
                                f"{latest.name}); pass --resume to continue that run, or choose another folder",
                                field="--checkpoint-dir")
            if args.resume:
                self._resume(latest)
        except CheckpointError as err:
            raise UserError(str(err), field="--resume" if args.resume else "--checkpoint-dir") from None

    def _resume(self, latest: Path | None) -> None:
        from harts.distributed.checkpoint import read_train_state

        if latest is None:
            print(f"--resume: no checkpoint in {self.args.checkpoint_dir} yet; starting at step 1", file=sys.stderr)
            return
        saved = read_train_state(latest)
        for key, value in self.meta.items():
            was = saved.meta.get(key, _BEFORE_THE_FLAG.get(key))
            if was != value:
                flag = "--" + key.replace("_", "-")
                raise UserError(f"--resume: {latest} was written with {flag} {was}; "
                                f"this run has {value}", field=flag)
        if saved.data.source != self.source:
            raise UserError(f"--resume: {latest} was written for data {saved.data.source}; this run reads "
                            f"{self.source}", field="--resume")
        state = self.checkpointer.resume()
        if state.data.next_batch != state.step:
            raise UserError(f"--resume: {latest} is at step {state.step} but batch {state.data.next_batch}; "
                            "harts train uses one batch per step", field="--resume")
        self.start = state.step

    def latest(self) -> Path | None:
        """The checkpoint a `--resume` would continue from now (None without one)."""
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

        if not (self.checkpointer.config.due(step) or step == self.args.steps):
            return None
        state = TrainState(step=step, data=DataPosition(self.source, next_batch=step), meta=self.meta)
        try:
            return self.checkpointer.save(state)
        except CheckpointError as err:
            raise UserError(str(err), field="--checkpoint-dir") from None
