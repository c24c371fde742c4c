"""Reading runs back: the latest finished run of each kind, with chosen artifacts.

Used by `harts report` (the latest run of every study) and by the tests that check what a
study logged. Artifacts are fetched through mlflow, so the same code reads a local store
and a tracking server.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harts.config import env
from harts.track.record import _quiet, client_for


@dataclass(frozen=True)
class LoggedRun:
    run_id: str
    experiment: str
    name: str
    status: str
    start_time: int  # ms since the epoch
    end_time: int | None
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str]
    files: dict[str, bytes] = field(default_factory=dict)  # artifact path -> content
    children: tuple[LoggedRun, ...] = ()


def _fetch(client: Any, run_id: str, paths: tuple[str, ...], dirs: tuple[str, ...]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    wanted = list(paths)
    for d in dirs:
        wanted += [f.path for f in client.list_artifacts(run_id, d) if not f.is_dir]
    if not wanted:
        return files
    present = {f.path for f in client.list_artifacts(run_id)}
    # no download progress bars on stderr (`harts report` fetches dozens of small files)
    with env.mlflow_progress_bars_off(), tempfile.TemporaryDirectory(prefix="harts-fetch-") as tmp:
        for path in wanted:
            top = path.split("/", 1)[0]
            if top not in present:
                continue
            local = Path(client.download_artifacts(run_id, path, tmp))
            if local.is_file():
                files[path] = local.read_bytes()
    return files


def _to_run(client: Any, run: Any, exp_name: str, paths: tuple[str, ...], dirs: tuple[str, ...]) -> LoggedRun:
    return LoggedRun(
        run_id=run.info.run_id,
        experiment=exp_name,
        name=run.info.run_name or "",
        status=run.info.status,
        start_time=int(run.info.start_time or 0),
        end_time=run.info.end_time,
        params=dict(run.data.params),
        metrics=dict(run.data.metrics),
        tags=dict(run.data.tags),
        files=_fetch(client, run.info.run_id, paths, dirs),
    )


def read_run(run_id: str, tracking_uri: str | None = None, artifacts: tuple[str, ...] = (),
             artifact_dirs: tuple[str, ...] = (), children: bool = True) -> LoggedRun:
    """One run (and its nested children, without their artifacts)."""
    with _quiet():
        client = client_for(tracking_uri)
        run = client.get_run(run_id)
        exp = client.get_experiment(run.info.experiment_id)
        kids: tuple[LoggedRun, ...] = ()
        if children:
            found = client.search_runs([run.info.experiment_id],
                                       filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'",
                                       order_by=["attributes.start_time ASC"], max_results=1000)
            kids = tuple(_to_run(client, r, exp.name, (), ()) for r in found)
        out = _to_run(client, run, exp.name, artifacts, artifact_dirs)
        return LoggedRun(**{**out.__dict__, "children": kids})


def latest_runs(tracking_uri: str | None = None, *, kind: str, group_by: str,
                artifacts: tuple[str, ...] = (), artifact_dirs: tuple[str, ...] = ()) -> dict[str, LoggedRun]:
    """The latest FINISHED top-level run per value of tag `group_by`, among runs tagged
    ``harts.kind = kind``, in every experiment of the store."""
    with _quiet():
        client = client_for(tracking_uri)
        exps = {e.experiment_id: e.name for e in client.search_experiments()}
        if not exps:
            return {}
        latest: dict[str, Any] = {}
        token = None
        while True:
            page = client.search_runs(
                list(exps),
                filter_string=f"tags.`harts.kind` = '{kind}' and attributes.status = 'FINISHED'",
                order_by=["attributes.start_time DESC"], max_results=500, page_token=token,
            )
            for run in page:
                key = run.data.tags.get(group_by)
                if key and key not in latest and "mlflow.parentRunId" not in run.data.tags:
                    latest[key] = run
            token = page.token
            if not token:
                break
        return {k: _to_run(client, r, exps[r.info.experiment_id], artifacts, artifact_dirs)
                for k, r in latest.items()}
