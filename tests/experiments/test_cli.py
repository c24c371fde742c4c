"""`harts experiment` and `harts report` end to end (in-process), against a temporary store."""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser

import pytest

from harts.cli.main import main
from harts.track import read_run


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.captions: list[str] = []
        self.ids: list[str] = []
        self._caption = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a["src"])
        if tag == "caption":
            self._caption = True
        if "id" in a:
            self.ids.append(a["id"])

    def handle_endtag(self, tag):
        if tag == "caption":
            self._caption = False

    def handle_data(self, data):
        if self._caption:
            self.captions.append(data)


def test_experiment_json_then_report(store_uri, tmp_path, capsys):
    assert main(["experiment", "compression", "--config", "tiny", "--tracking-uri", store_uri, "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["study"] == "compression" and out["tracking_uri"] == store_uri
    run = read_run(out["run_id"], store_uri)
    assert run.metrics["tiny-8-treestep.l1_compression"] == pytest.approx(out["metrics"]["tiny-8-treestep.l1_compression"])

    assert main(["experiment", "pp-schedules", "--config", "tiny", "--tracking-uri", store_uri]) == 0
    text = capsys.readouterr()
    assert "Table 6: PP scheduling ablation" in text.out and "paper k tok/s" in text.out
    assert "logged as run" in text.out and "mlflow ui --backend-store-uri" in text.out
    assert "[1/" in text.err  # progress lines on stderr (not a terminal: one per step)

    page = tmp_path / "report.html"
    assert main(["report", "--out", str(page), "--tracking-uri", store_uri, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep["studies"]) == {"compression", "pp-schedules"}
    assert rep["missing"] == ["planners", "dp-balance", "fidelity", "throughput", "rollout"]
    html = page.read_text()
    parsed = _Page()
    parsed.feed(html)
    assert parsed.ids == ["compression", "planners", "dp-balance", "pp-schedules", "fidelity", "throughput",
                          "rollout"]
    assert any(c.startswith("Table 3") for c in parsed.captions) and any(c.startswith("Table 6") for c in parsed.captions)
    # compression: 1 plot; pp-schedules: the ablation plot and three Gantt charts
    assert len(parsed.images) == rep["plots"] == 5
    for src in parsed.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"
    assert "No finished run yet" in html and "<script" not in html and "http" not in html.split("<body>")[1].split(
        "Browse every run")[0]


def test_experiment_errors(store_uri, capsys):
    assert main(["experiment", "nope", "--tracking-uri", store_uri]) == 2
    assert "unknown study 'nope'" in capsys.readouterr().err
    assert main(["experiment", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["study"] for s in listed][:2] == ["compression", "planners"]


def test_report_without_a_store(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["report"]) == 2
    assert "no tracking store" in capsys.readouterr().err
    assert not (tmp_path / "harts-runs" / "mlflow.db").exists()
