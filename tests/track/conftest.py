import pytest

from tests.track.store_util import fresh_store


@pytest.fixture
def store_uri(tmp_path, monkeypatch):
    """A temporary, empty SQLite tracking store; $MLFLOW_TRACKING_URI cleared."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return fresh_store(tmp_path / "store")
