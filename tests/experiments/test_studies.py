"""Every study runs with its tiny config, logs to a temporary store, and what is read back
from mlflow is what the study computed; plus one property per study that could fail."""

from __future__ import annotations

import json
import math

import pytest

from harts.experiments.common import experiment_name, log_study
from harts.experiments.registry import (
    StudyName,
    get_study,
    known_studies,
    register_study,
    run_study,
)
from harts.track import read_run
from harts.track.params import flatten_params


def _check(name: str, r) -> None:
    m = r.metrics
    if name == "compression":
        for case in ("tiny-8-treestep", "flash-32-stepwise"):
            assert 1.0 < m[f"{case}.l1_compression"] <= m[f"{case}.forest_compression"] * (1 + 1e-12)
            # cross-microbatch sharing never loses compression
            assert m[f"{case}.l1l2_compression"] >= m[f"{case}.l1_compression"] * (1 - 1e-12)
    elif name == "planners":
        assert m["tiny-8-treestep.expanded-ffd.compression"] == 1.0
        for p in ("ortools-ffd", "l1", "l1l2"):
            assert m[f"tiny-8-treestep.{p}.compression"] > 1.0
            assert 0.0 < m[f"tiny-8-treestep.{p}.balance_p5"] <= m[f"tiny-8-treestep.{p}.slot_balance"] <= 1.0
    elif name == "dp-balance":
        for dp in (2, 4):
            for p in ("l1l2", "ortools-ffd"):
                assert m[f"dp{dp}.{p}.slots"] >= 2  # at least one slot per step
                assert 0.0 < m[f"dp{dp}.{p}.balance_p5"] <= m[f"dp{dp}.{p}.slot_balance_mean"] <= 1.0
                assert m[f"dp{dp}.{p}.step_total_min"] <= m[f"dp{dp}.{p}.step_total_mean"] <= 1.0
    elif name == "pp-schedules":
        base = "mb98304.non-overlap"
        assert m[f"{base}.relative_to_first"] == 1.0 and m[f"{base}.producers"] > 0
        for s in ("overlap-bwd-first", "consumer-1f1b"):
            assert m[f"mb98304.{s}.throughput"] > 0 and 0 <= m[f"mb98304.{s}.bubble_fraction"] < 1
        assert {"pp_schedules", "gantt-consumer-1f1b"} <= set(r.figures)
    elif name == "fidelity":
        # float64: the tree step is the expanded step to rounding; replay is bit-exact in KDA
        assert m["float64.verify.max_rel_logprob_err"] < 1e-12 and m["float64.verify.max_rel_grad_err"] < 1e-10
        assert m["float64.verify.kda_layer.replay.bit_identical"] == 1.0
        assert m["float32.verify.kda_layer.replay.bit_identical"] == 1.0
        assert m["float32.depth0.harts.bit_identical_frac"] == 1.0
        # replay keeps the tree on the baseline's numerical path; no replay leaves it
        for k in (1, 2):
            assert m[f"float32.depth{k}.harts.abs_nll"] < m[f"float32.depth{k}.noreplay.abs_nll"]
            assert m[f"float32.depth{k}.noreplay.bit_identical_frac"] < m[f"float32.depth{k}.harts.bit_identical_frac"]
        assert m["float32.rerun.bit_identical_frac"] == 1.0  # CPU reruns are deterministic
    elif name == "throughput":
        for case in ("tiny-8-treestep", "flash-32-stepwise"):
            assert m[f"{case}.l1l2.speedup"] > 1.0 and m[f"{case}.expanded-ffd.speedup"] == 1.0
        assert "tiny-8-treestep.nodewise.speedup" in m and "flash-32-stepwise.nodewise.speedup" not in m


@pytest.mark.parametrize("name", known_studies())
def test_study_tiny_logged_and_read_back(name, store_uri):
    result = run_study(name, "tiny")
    assert result.study == name and result.config_name == "tiny" and result.seconds > 0
    assert result.metrics and all(isinstance(v, float) and not math.isnan(v) for v in result.metrics.values())
    _check(name, result)

    run_id = log_study(result, store_uri)
    run = read_run(run_id, store_uri, artifacts=("tables.json", "results.json", "figures.json"),
                   artifact_dirs=("plots",))
    assert run.experiment == experiment_name(name) and run.status == "FINISHED"
    assert run.tags["harts.kind"] == "study" and run.tags["harts.study"] == name
    assert run.params == flatten_params(get_study(name).config("tiny"))
    assert {k: v for k, v in run.metrics.items() if k != "study_seconds"} == pytest.approx(result.metrics, rel=1e-15)
    assert [c.name for c in run.children] == [v.name for v in result.variants]
    for child, variant in zip(run.children, result.variants, strict=True):
        assert child.metrics == pytest.approx(variant.metrics, rel=1e-15)
        assert child.tags["mlflow.parentRunId"] == run_id
    tables = json.loads(run.files["tables.json"])
    assert [t["title"] for t in tables] == [t.title for t in result.tables]
    assert all(len(t["cells"]) == len(t["rows"]) > 0 for t in tables)
    # the paper's numbers next to ours: a paper column, or a paper row
    assert any(c["kind"] == "paper" for c in tables[0]["columns"]) or "paper" in tables[0]["row_kinds"]
    assert json.loads(run.files["figures.json"]) == [f"plots/{f}.png" for f in result.figures]
    for f in result.figures:
        assert run.files[f"plots/{f}.png"][:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(run.files["results.json"])["metrics"] == pytest.approx(result.metrics, rel=1e-15)


def test_registry_fails_loudly():
    with pytest.raises(ValueError, match="unknown study 'nope'; known studies: compression"):
        get_study("nope")
    study = get_study("compression")
    with pytest.raises(ValueError, match="registered twice"):
        register_study(study)
    with pytest.raises(ValueError, match="unknown config 'huge'"):
        study.config("huge")
    assert known_studies() == [n.value for n in StudyName]
