"""Tracking: URI resolution, config flattening, logging runs and reading them back."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import pytest

from harts.track import (
    RunRecord,
    default_tracking_uri,
    flatten_params,
    latest_runs,
    log_main_run,
    log_record,
    read_run,
    resolve_tracking_uri,
    ui_hint,
)
from harts.track.params import MAX_PARAM_VALUE, flatten_metrics
from tests.track.store_util import fresh_store


class Color(StrEnum):
    RED = "red"


@dataclass(frozen=True)
class Inner:
    model: str
    gpus: int


@dataclass(frozen=True)
class Outer:
    cases: tuple[Inner, ...] = (Inner("tiny", 8), Inner("flash", 32))
    dtypes: tuple[str, ...] = ("float32", "float64")
    overrides: dict = field(default_factory=lambda: {"turns_range": (6, 12), "max": None})
    color: Color = Color.RED
    rate: float = 0.5
    blob: str = "x" * (MAX_PARAM_VALUE + 10)


def test_flatten_params_dotted_keys_and_values():
    p = flatten_params(Outer())
    assert p["cases.0.model"] == "tiny" and p["cases.1.gpus"] == "32"
    assert json.loads(p["dtypes"]) == ["float32", "float64"]  # a list of scalars stays one param
    assert json.loads(p["overrides.turns_range"]) == [6, 12]
    assert p["overrides.max"] == "null" and p["color"] == "red" and p["rate"] == "0.5"
    assert len(p["blob"]) == MAX_PARAM_VALUE and p["blob"].endswith("[truncated]")


def test_flatten_metrics_keeps_finite_numbers_only():
    m = flatten_metrics({"a": {"b": 1, "ok": True, "name": "x", "nan": float("nan")}, "l": [2.5, "s"]})
    assert m == {"a.b": 1.0, "a.ok": 1.0, "l.0": 2.5}


def test_uri_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    default = resolve_tracking_uri(None)
    assert default == default_tracking_uri() == "sqlite:///" + str(tmp_path.resolve() / "harts-runs" / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    assert resolve_tracking_uri(None) == "http://127.0.0.1:9"
    assert resolve_tracking_uri("sqlite:////x/y.db") == "sqlite:////x/y.db"  # the flag wins
    assert resolve_tracking_uri("runs") == "sqlite:///" + str(tmp_path.resolve() / "runs" / "mlflow.db")
    assert resolve_tracking_uri("a/b.db") == "sqlite:///" + str(tmp_path.resolve() / "a" / "b.db")
    assert ui_hint(default).startswith("mlflow ui --backend-store-uri sqlite:///")
    assert "browser" in ui_hint("http://127.0.0.1:9")


def _record() -> RunRecord:
    child = RunRecord("child-a", params={"k": 1}, metrics={"m": 2.0}, artifacts={"plans/a.json": "{}"})
    return RunRecord(
        "parent", params=Outer(), metrics={"x.y": 1.25, "bad key!": 3.0}, tags={"harts.kind": "study",
                                                                               "harts.study": "demo"},
        artifacts={"results.json": json.dumps({"a": 1}), "plots/p.png": b"\x89PNG\r\n"},
        children=[child, RunRecord("child-b", metrics={"m": 3.0})],
    )


def test_log_record_round_trip(store_uri):
    run_id = log_record(_record(), "harts-demo", store_uri)
    run = read_run(run_id, store_uri, artifacts=("results.json",), artifact_dirs=("plots",))
    assert run.status == "FINISHED" and run.experiment == "harts-demo" and run.name == "parent"
    assert run.params["cases.1.model"] == "flash"
    assert run.metrics == {"x.y": 1.25, "bad key_": 3.0}
    assert json.loads(run.files["results.json"]) == {"a": 1}
    assert run.files["plots/p.png"] == b"\x89PNG\r\n"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                          text=True).stdout.strip()
    assert run.tags["harts.git_commit"] == head == run.tags["mlflow.source.git.commit"]
    assert [c.name for c in run.children] == ["child-a", "child-b"]
    assert [c.metrics["m"] for c in run.children] == [2.0, 3.0]
    assert all(c.tags["mlflow.parentRunId"] == run_id and c.status == "FINISHED" for c in run.children)
    a = read_run(run.children[0].run_id, store_uri, artifact_dirs=("plans",))
    assert a.files["plans/a.json"] == b"{}"


def test_failed_logging_marks_the_run_failed(store_uri):
    bad = RunRecord("escape", metrics={"m": 1.0}, tags={"harts.kind": "study", "harts.study": "demo"},
                    artifacts={"../outside.txt": "x"})
    with pytest.raises(ValueError, match="leaves"):
        log_record(bad, "harts-demo", store_uri)
    from harts.track.record import client_for

    runs = client_for(store_uri).search_runs(
        [client_for(store_uri).get_experiment_by_name("harts-demo").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    # a failed run is never "the latest" one
    assert latest_runs(store_uri, kind="study", group_by="harts.study") == {}


def test_latest_runs_takes_the_newest_finished_parent(store_uri):
    first = log_record(_record(), "harts-demo", store_uri)
    second = log_record(_record(), "harts-demo", store_uri)
    other = log_record(RunRecord("o", tags={"harts.kind": "study", "harts.study": "other"}), "harts-other",
                       store_uri)
    got = latest_runs(store_uri, kind="study", group_by="harts.study", artifacts=("results.json",))
    assert {k: r.run_id for k, r in got.items()} == {"demo": second, "other": other}
    assert first != second and got["demo"].files["results.json"] == b'{"a": 1}'


def test_log_main_run_into_the_embedded_default_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = fresh_store(tmp_path / "harts-runs")  # the default location, pre-created (fast)
    assert uri == default_tracking_uri()
    summary = {"workload": "tiny-treestep", "model": "tiny-cpu", "seed": 0, "equivalent": True,
               "tree": {"compression": 2.5, "nodes": 14}, "verify": {"loss_abs_err": {"loss": 0.0}, "dtype": "f64"}}
    hint = log_main_run(summary, None)
    assert hint == f"mlflow ui --backend-store-uri {uri}"
    from harts.track.record import client_for

    client = client_for(uri)
    exp = client.get_experiment_by_name("harts-run")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params == {"workload": "tiny-treestep", "model": "tiny-cpu", "seed": "0", "equivalent": "true"}
    assert run.data.metrics["tree.compression"] == 2.5 and run.data.metrics["verify.loss_abs_err.loss"] == 0.0
    assert run.data.metrics["equivalent"] == 1.0
    assert run.data.tags["harts.kind"] == "main-run" and run.info.status == "FINISHED"
    art = Path(exp.artifact_location.removeprefix("file://")) / run.info.run_id / "artifacts" / "summary.json"
    assert json.loads(art.read_text())["tree"]["nodes"] == 14
    assert art.is_relative_to(tmp_path / "harts-runs")
