"""Where runs go: the embedded local store, or a tracking server named by URI.

Precedence: an explicit URI (a `--tracking-uri` flag) > ``MLFLOW_TRACKING_URI`` > the
embedded default, a SQLite database ``harts-runs/mlflow.db`` under the working directory.
SQLite rather than mlflow's file store: mlflow 3 keeps the file store in maintenance mode
and refuses it unless told otherwise. A plain path is accepted too: ``runs/x.db`` is that
database, a directory ``runs`` means ``runs/mlflow.db``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from urllib.parse import urlparse

from harts.config import env

DEFAULT_STORE_DIR = "harts-runs"
DB_NAME = "mlflow.db"
ARTIFACT_DIR = "artifacts"


def default_tracking_uri(workdir: str | Path | None = None) -> str:
    """``sqlite:///<workdir>/harts-runs/mlflow.db`` (absolute, so the URI works from anywhere)."""
    base = Path(workdir) if workdir is not None else Path.cwd()
    return sqlite_uri(base.resolve() / DEFAULT_STORE_DIR / DB_NAME)


def sqlite_uri(path: str | Path) -> str:
    return "sqlite:///" + str(Path(path).resolve())


def resolve_tracking_uri(uri: str | None = None, workdir: str | Path | None = None) -> str:
    """The tracking URI to use: `uri`, else $MLFLOW_TRACKING_URI, else the embedded store."""
    chosen = uri or env.tracking_uri()
    if not chosen:
        return default_tracking_uri(workdir)
    if "://" in chosen or chosen.startswith(("sqlite:", "databricks")):
        return chosen
    path = Path(chosen).expanduser()
    if path.suffix == ".db":
        return sqlite_uri(path)
    return sqlite_uri(path / DB_NAME)


def local_store_dir(uri: str) -> Path | None:
    """The directory holding a local SQLite store (None for servers and other backends)."""
    if not uri.startswith("sqlite:///"):
        return None
    db = uri[len("sqlite:///"):]
    if db in ("", ":memory:"):
        return None
    return Path(db if db.startswith("/") else Path.cwd() / db).parent


def artifact_location(uri: str) -> str | None:
    """Artifact root for new experiments: beside a local store; None lets a server decide."""
    store = local_store_dir(uri)
    return (store / ARTIFACT_DIR).resolve().as_uri() if store is not None else None


def prepare_store(uri: str) -> None:
    """Create the directory of a local store (mlflow creates the database itself)."""
    store = local_store_dir(uri)
    if store is not None:
        store.mkdir(parents=True, exist_ok=True)


def is_server(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def ui_hint(uri: str) -> str:
    """How a person looks at the runs of `uri`."""
    if is_server(uri):
        return f"open {uri} in a browser"
    return f"mlflow ui --backend-store-uri {shlex.quote(uri)}"
