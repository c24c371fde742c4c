"""Temporary mlflow stores for tests, fast.

Creating an mlflow SQLite database runs its schema migrations (seconds). The first call
builds one empty database per test session; every store after that is a copy of it.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from harts.track.store import sqlite_uri

_TEMPLATE: list[Path] = []


def template_db() -> Path:
    if not _TEMPLATE:
        from harts.track.record import client_for

        root = Path(tempfile.mkdtemp(prefix="harts-mlflow-template-"))
        atexit.register(shutil.rmtree, root, True)
        db = root / "mlflow.db"
        client = client_for(sqlite_uri(db))
        client.search_experiments()  # creates and migrates the schema
        _TEMPLATE.append(db)
    return _TEMPLATE[0]


def fresh_store(directory: Path) -> str:
    """A new empty store in `directory` (its database a copy of the template); its URI."""
    directory.mkdir(parents=True, exist_ok=True)
    db = directory / "mlflow.db"
    shutil.copyfile(template_db(), db)
    return sqlite_uri(db)
