"""Runs as data, logged to mlflow in batched calls: a parent run with nested child runs.

A `RunRecord` is what a run *is*: a name, its config (flattened into params), numeric
metrics, tags, artifacts (relative path -> bytes or text) and child runs. `log_record`
turns it into mlflow runs through `MlflowClient` (no fluent global state, so logging a
study never disturbs a run the caller has open): nested runs are children tagged with
``mlflow.parentRunId``, every run is tagged with the git commit of the code that made it,
and a run whose logging fails is marked FAILED rather than left RUNNING.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harts.config import env
from harts.track.params import clean_key, flatten_params
from harts.track.store import artifact_location, prepare_store, resolve_tracking_uri

# mlflow's batch limits (mlflow.utils.validation)
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_MAX_TAG_VALUE = 8000


@dataclass(frozen=True)
class RunRecord:
    name: str
    params: Any = None  # a config: dataclass, dict or nested mix; flattened to dotted keys
    metrics: Mapping[str, float] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    artifacts: Mapping[str, bytes | str] = field(default_factory=dict)  # relative path -> content
    children: Sequence[RunRecord] = ()


def git_state(path: str | Path | None = None) -> tuple[str | None, bool]:
    """(commit, dirty) of the checkout holding `path` (default: this package's checkout,
    else the working directory); (None, False) outside a git work tree."""
    candidates = [Path(path)] if path is not None else [Path(__file__).resolve().parents[2], Path.cwd()]
    for where in candidates:
        try:
            sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.strip()
            status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if sha:
            return sha, bool(status.strip())
    return None, False


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No "View run at ..." lines on stdout (they would corrupt --json output) and no
    INFO chatter from mlflow's schema set-up."""
    with env.mlflow_url_printing_suppressed():
        # importing mlflow configures its loggers; import first, then quieten them
        import mlflow  # noqa: F401

        loggers = [logging.getLogger(n) for n in ("mlflow", "alembic")]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


def client_for(tracking_uri: str | None = None) -> Any:
    """An `MlflowClient` for the resolved URI (the local store's directory created)."""
    uri = resolve_tracking_uri(tracking_uri)
    prepare_store(uri)
    with _quiet():
        from mlflow.tracking import MlflowClient

        return MlflowClient(uri)


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment `name`, created (artifacts beside a local store) or restored."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location(client.tracking_uri))
        except MlflowException:
            # created concurrently by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def log_record(record: RunRecord, experiment: str, tracking_uri: str | None = None) -> str:
    """Log `record` (and its children, nested) into `experiment`; returns the parent run id."""
    with _quiet():
        client = client_for(tracking_uri)
        exp = experiment_id(client, experiment)
        commit, dirty = git_state()
        common = {"mlflow.user": _user()}
        if commit:
            common.update({"mlflow.source.git.commit": commit, "harts.git_commit": commit,
                           "harts.git_dirty": str(dirty).lower()})
        return _log(client, exp, record, None, common)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _log(client: Any, exp: str, record: RunRecord, parent: str | None, common: dict[str, str]) -> str:
    from mlflow.entities import Metric, Param, RunTag

    tags = {**common, **{clean_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in record.tags.items()}}
    if parent is not None:
        tags["mlflow.parentRunId"] = parent
    run = client.create_run(exp, run_name=record.name, tags=tags)
    run_id = run.info.run_id
    try:
        params = flatten_params(record.params) if record.params is not None else {}
        plist = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(plist), _PARAMS_PER_BATCH):
            client.log_batch(run_id, params=plist[i : i + _PARAMS_PER_BATCH])
        now = int(time.time() * 1000)
        mlist = [Metric(clean_key(k), float(v), now, 0) for k, v in record.metrics.items()]
        for i in range(0, len(mlist), _METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=mlist[i : i + _METRICS_PER_BATCH])
        if record.artifacts:
            with tempfile.TemporaryDirectory(prefix="harts-artifacts-") as tmp:
                for rel, content in record.artifacts.items():
                    dest = Path(tmp) / rel
                    if dest.resolve().parent != Path(tmp).resolve() and Path(tmp).resolve() not in dest.resolve().parents:
                        raise ValueError(f"artifact path {rel!r} leaves the run's artifact directory")
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    if isinstance(content, bytes):
                        dest.write_bytes(content)
                    else:
                        dest.write_text(content)
                client.log_artifacts(run_id, tmp)
        for child in record.children:
            _log(client, exp, child, run_id, common)
        client.log_batch(run_id, tags=[RunTag("harts.children", str(len(record.children)))])
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id
