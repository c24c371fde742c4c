"""A real `mlflow server` on loopback: a study is logged over HTTP and read back.

The server gets a free port and its own temporary backend store and artifact directory;
start-up is bounded, and the server (its whole process group: the CLI starts uvicorn
workers) is always stopped in the fixture's teardown. The study's numbers are computed
while the server starts, so the test costs about one server start-up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.track.store_util import template_db

STARTUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


class Server:
    def __init__(self, root: Path):
        self.root = root
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.artifacts = root / "server-artifacts"
        db = root / "server.db"
        db.write_bytes(template_db().read_bytes())
        self.log = (root / "server.log").open("wb")
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        # no background job workers (huey): nothing here uses them, and they double start-up
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db}",
             "--artifacts-destination", str(self.artifacts), "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root, env=env,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {self.proc.returncode}:\n{self.output()}")
            if _healthy(self.url):
                return
            time.sleep(0.25)
        pytest.fail(f"mlflow server not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.root / "server.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            # the process group we created (start_new_session): the CLI and its uvicorn worker
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def mlflow_server(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    server = Server(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_study_logged_to_a_real_tracking_server(mlflow_server):
    from harts.experiments.common import experiment_name, log_study
    from harts.experiments.registry import run_study
    from harts.track import latest_runs, read_run

    result = run_study("compression", "tiny")  # computed while the server starts
    mlflow_server.wait_ready()
    run_id = log_study(result, mlflow_server.url)

    run = read_run(run_id, mlflow_server.url, artifacts=("tables.json",), artifact_dirs=("plots",))
    assert run.status == "FINISHED" and run.experiment == experiment_name("compression")
    assert run.tags["harts.study"] == "compression" and run.tags["harts.config"] == "tiny"
    for key, value in result.metrics.items():
        assert run.metrics[key] == pytest.approx(value, rel=1e-12)
    assert run.params["cases.0.model"] == "tiny"
    assert [c.name for c in run.children] == [v.name for v in result.variants]
    tables = json.loads(run.files["tables.json"])
    assert tables[0]["title"].startswith("Table 3")
    assert run.files["plots/compression.png"].startswith(b"\x89PNG")
    # artifacts went through the server's proxy into its own destination, not a local store
    stored = list(mlflow_server.artifacts.rglob("compression.png"))
    assert len(stored) == 1 and stored[0].read_bytes() == run.files["plots/compression.png"]
    latest = latest_runs(mlflow_server.url, kind="study", group_by="harts.study")
    assert latest["compression"].run_id == run_id
