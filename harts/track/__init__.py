"""Experiment tracking in mlflow, with an embedded store that needs no server.

By default every run goes to a local SQLite store in the working directory,
``./harts-runs/mlflow.db``, with artifacts beside it in ``./harts-runs/artifacts``; set
``MLFLOW_TRACKING_URI`` (or pass a URI, e.g. ``--tracking-uri http://host:5000``) to log to
a real tracking server instead. Runs are described as data (`RunRecord`: params as a
nested config, metrics, tags, artifacts, nested child runs) and logged in a few batched
calls, so a study with a dozen variants costs a second, not a minute.

mlflow is imported inside the functions: it takes seconds to import, and `harts --help`
must stay fast.
"""

from harts.track.main_run import log_main_run
from harts.track.params import flatten_params
from harts.track.query import LoggedRun, latest_runs, read_run
from harts.track.record import RunRecord, git_state, log_record
from harts.track.store import (
    DEFAULT_STORE_DIR,
    default_tracking_uri,
    resolve_tracking_uri,
    ui_hint,
)

__all__ = [
    "DEFAULT_STORE_DIR",
    "LoggedRun",
    "RunRecord",
    "default_tracking_uri",
    "flatten_params",
    "git_state",
    "latest_runs",
    "log_main_run",
    "log_record",
    "read_run",
    "resolve_tracking_uri",
    "ui_hint",
]
