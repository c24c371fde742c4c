"""Output that is not the command's own: no mlflow download progress bars in `harts report`
(unless the user asks for them), and scripts/bootstrap.sh says one line per phase while
pip itself stays quiet."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from harts.config import env

ROOT = Path(__file__).resolve().parents[2]
VAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


class _Client:
    """What `harts.track.query._fetch` asks of an mlflow client; records the progress-bar
    setting mlflow would read at each download."""

    def __init__(self):
        self.seen: list[str | None] = []

    def list_artifacts(self, run_id, path=None):
        return [SimpleNamespace(path="table.txt", is_dir=False)]

    def download_artifacts(self, run_id, path, dst):
        from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

        self.seen.append(os.environ.get(VAR))
        assert MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() is (os.environ.get(VAR) != "false")
        local = Path(dst) / path
        local.write_text("x")
        return str(local)


@pytest.mark.parametrize("user", [None, "true", "false"])
def test_report_downloads_show_no_progress_bars_unless_asked(user, monkeypatch):
    from harts.track.query import _fetch

    if user is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, user)
    client = _Client()
    assert _fetch(client, "run", ("table.txt",), ()) == {"table.txt": b"x"}
    assert client.seen == ["false" if user is None else user]
    assert os.environ.get(VAR) == user  # restored


def test_progress_bars_off_restores_the_environment(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    with env.mlflow_progress_bars_off():
        assert os.environ[VAR] == "false"
    assert VAR not in os.environ


_FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip $*" >> "$PIP_LOG"; exit 0; fi
if [ "$1" = "-c" ] && [ -n "${NO_TORCH:-}" ]; then exit 1; fi
if [ "$1" = "-c" ]; then echo 2.13.0; exit 0; fi
exit 1
"""


@pytest.mark.parametrize("has_torch", [True, False])
def test_bootstrap_says_each_phase_and_keeps_pip_quiet(has_torch, tmp_path):
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "pip.log"
    env_ = {**os.environ, "PYTHON": str(fake), "PIP_LOG": str(log)}
    if not has_torch:
        env_["NO_TORCH"] = "1"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap.sh")], env=env_, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == ("bootstrap: keeping torch 2.13.0" if has_torch
                        else "bootstrap: installing torch==2.13.0 (CPU build)...")
    assert lines[1].startswith("bootstrap: installing harts and its test dependencies")
    assert lines[2].startswith("bootstrap: done in ") and lines[2].endswith(" s") and len(lines) == 3
    pips = log.read_text().splitlines()
    assert len(pips) == (1 if has_torch else 2)
    for pip in pips:
        assert " -q " in pip and "--progress-bar off" in pip
    assert pips[-1].endswith("-e .[test]")
