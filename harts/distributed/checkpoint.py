"""Checkpoint and resume on `torch.distributed.checkpoint` (DCP): sharded, atomic, verified.

A run's checkpoint directory holds one directory per saved step and a pointer to the newest:

    step-000004/
      .metadata             DCP's global metadata: every tensor's global shape, its chunks
                            and which file holds each
      __0_0.distcp, ...     DCP's data files (each rank writes its own shards)
      rng-rank00000.json    each rank's RNG states: torch CPU and CUDA, numpy, python
      train_state.json      step counter, data position, world size, the run's description
      manifest.json         size and SHA-256 of every file above; written last
    latest                  "step-000004": the newest complete checkpoint

Model and optimizer state go through `get_state_dict` / `set_state_dict`
(`torch.distributed.checkpoint.state_dict`) with flattened optimizer state keyed by
parameter name, so FSDP2-sharded (DTensor) parameters and their AdamW moments are written as
shards with global metadata, and load into another mesh or into a plain single-process model:
DCP reads, for each loading rank, the parts of the saved shards its own tensors cover.

Atomicity: a checkpoint is written into `step-XXXXXX.tmp/`, its manifest last; only then is
the directory renamed to `step-XXXXXX/` and `latest` replaced (a temporary file renamed over
it, every step fsynced). A crash at any point leaves `latest` naming the previous complete
checkpoint; a leftover `.tmp` directory is removed by the next save.

Integrity: loading first checks every file the manifest lists (present, the recorded size,
the recorded SHA-256), so a truncated or corrupted checkpoint is refused with one line
naming the file, before any state is touched.

Processes: with no process group initialized everything runs in this process. Under a
process group (gloo or NCCL) every rank calls the same functions: DCP writes and reads the
shards collectively, rank 0 creates, finalizes and renames the directory, the files are
hashed and checked in shares spread over the ranks, and any rank's failure is raised on
every rank. The ranks must see one shared file system (as DCP's file writer assumes).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

T = TypeVar("T")

FORMAT_VERSION = 1
LATEST = "latest"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_HASH_CHUNK = 1 << 20
_OPTIONS = StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded; the message is one line naming the file."""


@dataclass(frozen=True)
class DataPosition:
    """Where a run stands in its data: what it trains on and which batch comes next."""

    source: str  # what the batches are drawn from, e.g. "workload:tiny-treestep:seed=0" or a file's hash
    next_batch: int  # index of the next batch the run's batch stream yields

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "next_batch": self.next_batch}


@dataclass(frozen=True)
class TrainState:
    """The non-tensor part of a checkpoint: how far the run got and what it was."""

    step: int  # update steps completed
    data: DataPosition
    # the run's description (model, mode, dtype, ...: JSON values), for a resume to compare
    meta: Mapping[str, Any] = field(default_factory=dict)
    world_size: int = 1  # processes that wrote the checkpoint (filled in by `save_checkpoint`)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---- the process group: rank, world size and the few collectives used here


@dataclass(frozen=True)
class _Comm:
    group: Any  # the process group, or None when no group is initialized

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.active else 0

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if self.active else 1

    def gather(self, value: T) -> list[T]:
        """Every rank's `value`, on every rank, in rank order."""
        if not self.active or self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def run(self, fn: Callable[[], T], what: str) -> list[T]:
        """Run `fn` on every rank; if it fails on any, raise that rank's error on all of them."""
        try:
            result, error = fn(), None
        except CheckpointError as err:
            result, error = None, str(err)
        except Exception as err:  # noqa: BLE001  (reported to every rank as one line)
            result, error = None, f"{what}: {type(err).__name__}: {_one_line(err)}"
        outcomes = self.gather((result, error))
        errors = [(r, e) for r, (_, e) in enumerate(outcomes) if e is not None]
        if errors:
            rank, message = errors[0]
            raise CheckpointError(message if self.world == 1 else f"rank {rank}: {message}")
        return [r for r, _ in outcomes]


@contextlib.contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """DCP warns on every single-process save and load; here that is the intended mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _describe(err: BaseException) -> str:
    """One line for an error, DCP's (which wraps each failed rank's exception) included."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, failure = min(err.failures.items())
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {_one_line(inner)}"
    return f"{type(err).__name__}: {_one_line(err)}"


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


# ---- files: atomic writes, fsync, hashes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file in the same folder, fsynced and renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _read_json(path: Path) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete checkpoint") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable or corrupt: {_one_line(err)}") from None


# ---- RNG states as JSON (exact: bytes in base64, integers and floats as Python writes them)


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, every CUDA device's (where CUDA is available),
    numpy's global generator and python's `random`."""
    np_state = np.random.get_state(legacy=False)
    version, py_state, gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "cuda": [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available() else [],
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}},
        "python": [version, list(py_state), gauss],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned (CUDA states only where as many devices are visible)."""
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in cuda])
    np_state = dict(state["numpy"])
    np_state["state"] = {"key": np.asarray(np_state["state"]["key"], dtype=np.uint32),
                         "pos": np_state["state"]["pos"]}
    np.random.set_state(np_state)
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.json"


# ---- the directory: latest pointer, listing


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint `latest` names in `directory`, or None when there is no `latest`."""
    directory = Path(directory)
    pointer = directory / LATEST
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{pointer} is unreadable: {_one_line(err)}") from None
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer} is corrupt: it holds {name[:40]!r}, not a step-NNNNNN name")
    path = directory / name
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names {name}, but {path} does not exist")
    return path


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    out = []
    for p in directory.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} as DCP saves and loads them: tensors (DTensor shards
    where sharded) keyed by parameter name, optimizer state flattened under those names."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_OPTIONS)}
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": msd, "optim": osd}


def _set_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, sd: dict[str, Any]) -> None:
    if optimizer is None:
        set_model_state_dict(model, sd["model"], options=_OPTIONS)
    else:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=_OPTIONS)


# ---- save


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    group: Any = None,
    keep: int | None = None,
) -> Path:
    """Write `step-XXXXXX/` (XXXXXX = `state.step`) under `directory` and point `latest` at it.

    Every rank of `group` (default: the default process group, when one is initialized) must
    call this with its own shards of `model` / `optimizer` (plain modules, or FSDP2 /
    DTensor-sharded ones) and the same `state`. `keep`: afterwards remove all but the newest
    `keep` checkpoints. Returns the checkpoint's path. Raises `CheckpointError` on every
    rank if any rank fails; `latest` and earlier checkpoints are then untouched.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None; got {keep}")
    comm = _Comm(group)
    directory = Path(directory)
    final = directory / step_dir_name(state.step)
    tmp = final.with_name(final.name + ".tmp")

    def prepare() -> None:
        if comm.rank != 0:
            return
        directory.mkdir(parents=True, exist_ok=True)
        latest = latest_checkpoint(directory)
        if latest is not None and latest.name == final.name:
            raise CheckpointError(f"{final} is the latest checkpoint already; it is not overwritten")
        for stale in (tmp, final):  # a crash's leftover, or a step saved but never made latest
            if stale.exists():
                shutil.rmtree(stale)
        tmp.mkdir()

    comm.run(prepare, f"creating {tmp}")
    try:
        sd = _state_dicts(model, optimizer)
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        try:
            with _quiet_no_dist():
                dcp.save(sd, storage_writer=writer, process_group=group, no_dist=not comm.active)
        except (Exception, CheckpointException) as err:  # DCP has already made every rank raise
            raise CheckpointError(f"writing {tmp}: {_describe(err)}") from None

        def write_own() -> None:
            _write_json(tmp / _rng_file(comm.rank), rng_state())
            if comm.rank == 0:
                _write_json(tmp / TRAIN_STATE, {
                    "format": FORMAT_VERSION, "step": state.step, "data": state.data.to_dict(),
                    "meta": dict(state.meta), "world_size": comm.world,
                })

        comm.run(write_own, f"writing {tmp}")

        def hash_share() -> dict[str, Any]:
            files = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
            return {name: _digest(tmp / name) for name in files[comm.rank::comm.world]}

        shares = comm.run(hash_share, f"hashing {tmp}")

        def finalize() -> None:
            if comm.rank != 0:
                return
            files = {name: d for share in shares for name, d in share.items()}
            _write_manifest(tmp, {"format": FORMAT_VERSION, "files": dict(sorted(files.items()))})
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(directory)
            _write_atomic(directory / LATEST, final.name + "\n")
            if keep is not None:  # the newest `keep` up to this step (a later one is a crash's orphan)
                for _, old in [d for d in _step_dirs(directory) if d[0] <= state.step][:-keep]:
                    shutil.rmtree(old)

        comm.run(finalize, f"finalizing {final}")
    except BaseException:
        # a failed save in one process removes its partial directory; under a group the
        # next save removes it (other ranks may still be reading it here)
        if comm.world == 1 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_manifest(path: Path, manifest: Mapping[str, Any]) -> None:
    _write_json(path / MANIFEST, manifest)


# ---- verify and load


def verify_checkpoint(path: str | os.PathLike[str], *, group: Any = None) -> dict[str, Any]:
    """Check every file `path`'s manifest lists (present, size, SHA-256; the work spread over
    the ranks) and return the manifest. Raises `CheckpointError` naming the first bad file."""
    comm = _Comm(group)
    path = Path(path)
    manifest = comm.run(lambda: _read_manifest(path), f"reading {path / MANIFEST}")[0]
    names = sorted(manifest["files"])

    def check_share() -> None:
        for name in names[comm.rank::comm.world]:
            want = manifest["files"][name]
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing: the checkpoint is incomplete")
            size = file.stat().st_size
            if size != want["size"]:
                raise CheckpointError(f"{file} is truncated or corrupt: {size} bytes, the manifest says {want['size']}")
            if _digest(file)["sha256"] != want["sha256"]:
                raise CheckpointError(f"{file} is corrupt: its SHA-256 differs from the manifest's")

    comm.run(check_share, f"checking {path}")
    return manifest


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest = _read_json(path / MANIFEST)
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path / MANIFEST} is corrupt: not a JSON object")
    files = manifest.get("files")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path / MANIFEST}: unknown checkpoint format (this code reads {FORMAT_VERSION})")
    if not isinstance(files, dict) or not all(
            isinstance(d, dict) and isinstance(d.get("size"), int) and isinstance(d.get("sha256"), str)
            for d in files.values()):
        raise CheckpointError(f"{path / MANIFEST} is corrupt: no valid file list")
    for required in (".metadata", TRAIN_STATE, _rng_file(0)):
        if required not in files:
            raise CheckpointError(f"{path / MANIFEST} does not list {required}: not a complete checkpoint")
    return manifest


def read_train_state(path: str | os.PathLike[str]) -> TrainState:
    """The `TrainState` of checkpoint `path` (its files unchecked; `load_checkpoint` checks)."""
    file = Path(path) / TRAIN_STATE
    raw = _read_json(file)
    try:
        return TrainState(
            step=int(raw["step"]),
            data=DataPosition(source=str(raw["data"]["source"]), next_batch=int(raw["data"]["next_batch"])),
            meta=dict(raw["meta"]),
            world_size=int(raw["world_size"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{file} is corrupt: {type(err).__name__}: {_one_line(err)}") from None


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    group: Any = None,
    restore_rng: bool = True,
) -> TrainState:
    """Load checkpoint `path` (a `step-XXXXXX` directory) into `model` and `optimizer` in place.

    Every rank of `group` calls this with its own (possibly sharded) model and optimizer,
    built as for training; the mesh may differ from the one that saved. The checkpoint is
    verified first (`verify_checkpoint`). With `restore_rng`, each rank takes the RNG states
    its own rank saved; a rank the saving run did not have keeps its own. Optimizer
    hyperparameters (lr, betas, ...) come from the checkpoint. Returns its `TrainState`.
    """
    comm = _Comm(group)
    path = Path(path)
    verify_checkpoint(path, group=group)
    state = comm.run(lambda: read_train_state(path), f"reading {path / TRAIN_STATE}")[0]

    def load() -> None:
        sd = _state_dicts(model, optimizer)
        with _quiet_no_dist():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(path), process_group=group, no_dist=not comm.active)
        _set_state_dicts(model, optimizer, sd)

    try:
        load()
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP raises on every rank
        raise CheckpointError(f"{path}: does not load into this model/optimizer: {_describe(err)}") from None
    if restore_rng:
        def restore() -> None:
            own = path / _rng_file(comm.rank)
            if own.exists():
                set_rng_state(_read_json(own))

        comm.run(restore, f"restoring RNG from {path}")
    return state


# ---- a run's checkpointing: every N steps, resume from the latest


@dataclass(frozen=True)
class CheckpointConfig:
    """Where a run keeps its checkpoints and how often it writes them."""

    directory: Path
    every: int | None = None  # save after every step divisible by this (None: no periodic saves)
    keep: int | None = None  # keep only the newest `keep` checkpoints (None: all)

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step; got {self.every}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"checkpoints to keep must be >= 1; got {self.keep}")

    def due(self, step: int) -> bool:
        """Whether the run saves after completing update step `step` (1-based)."""
        return self.every is not None and step % self.every == 0


class Checkpointer:
    """A run's checkpoints: `resume` loads the latest (if any), `after_step` saves when due.

    `model` and `optimizer` are the run's (sharded or not); `group` as in `save_checkpoint`."""

    def __init__(self, config: CheckpointConfig, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, *, group: Any = None):
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.group = group

    def latest(self) -> Path | None:
        return latest_checkpoint(self.config.directory)

    def resume(self) -> TrainState | None:
        """Load the latest checkpoint into the model, optimizer and RNGs; None when there is none."""
        path = self.latest()
        return None if path is None else load_checkpoint(path, self.model, self.optimizer, group=self.group)

    def save(self, state: TrainState) -> Path:
        return save_checkpoint(self.config.directory, state, self.model, self.optimizer,
                               group=self.group, keep=self.config.keep)

    def after_step(self, state: TrainState) -> Path | None:
        """Save `state` (whose `step` was just completed) if the interval says so."""
        return self.save(state) if self.config.due(state.step) else None


__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "DataPosition",
    "TrainState",
    "latest_checkpoint",
    "load_checkpoint",
    "read_train_state",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "step_dir_name",
    "verify_checkpoint",
]
