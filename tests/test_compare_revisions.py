"""scripts/compare_revisions.py's comparison: equal only when every step number and every
checkpoint tensor (value, dtype, shape, name) is; NaN step values compare equal to NaN."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "compare_revisions", Path(__file__).resolve().parents[1] / "scripts" / "compare_revisions.py")
cr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cr)


def _run(loss=0.5, w=None, extra=None):
    records = [{"step": 1, "loss": loss, "grad_norm": float("nan")}]
    tensors = cr._flatten({"model": {"w": torch.ones(3) if w is None else w}, "optim": [torch.zeros(2)], **(extra or {})})
    return records, tensors


def test_equal_runs_are_equal_and_nan_matches_nan():
    assert cr._compare(_run(), _run())["equal"]


def test_any_difference_is_reported():
    assert cr._compare(_run(), _run(loss=0.5 + 1e-16))["records_differ"]
    bumped = torch.ones(3)
    bumped[1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    out = cr._compare(_run(), _run(w=bumped))
    assert not out["equal"] and out["tensors_differ"] == [f"model.w: max |diff| {bumped[1].item() - 1.0}"]
    assert not cr._compare(_run(), _run(w=torch.ones(3, dtype=torch.float64)))["equal"]  # dtype
    assert not cr._compare(_run(), _run(w=torch.ones(4)))["equal"]  # shape
    assert not cr._compare(_run(), _run(extra={"x": torch.ones(1)}))["equal"]  # a tensor only one side has


def test_last_json_skips_lines_printed_before_it():
    assert cr._last_json('{"a": 1}') == {"a": 1}
    assert cr._last_json('wrote x\n{"steps": [1]}\n') == {"steps": [1]}
