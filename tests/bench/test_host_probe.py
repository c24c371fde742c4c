"""harts.bench.host_probe: the host's seconds per small dispatched op."""

from __future__ import annotations

import math

import pytest

from harts.bench.host_probe import cpu_model, probe


def test_probe_counts_the_ops_of_one_iteration_and_reports_a_rate():
    out = probe("cpu", iters=5, warmup=1, repeats=2)
    # forward (norm, product, gate, gather, cat, loss), backward and accumulation
    assert out["ops_per_iteration"] >= 20
    assert len(out["repeats_s"]) == 2 and all(s > 0 for s in out["repeats_s"])
    assert math.isclose(out["s_per_op"], min(out["repeats_s"]) / (5 * out["ops_per_iteration"]))
    assert out["device"] == "cpu" and out["python"] and out["torch"]
    assert out["cpu"] == cpu_model()


def test_the_op_count_does_not_depend_on_the_sizes():
    assert probe("cpu", iters=1, warmup=0, repeats=1, width=8, rows=4)["ops_per_iteration"] == \
        probe("cpu", iters=1, warmup=0, repeats=1)["ops_per_iteration"]


@pytest.mark.parametrize("bad", [dict(iters=0), dict(width=0), dict(rows=0), dict(repeats=0), dict(warmup=-1)])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="host probe"):
        probe("cpu", **bad)
