"""What `harts report` shows beside the paper's numbers: bar axes from 0 (a cut axis makes
small gaps look large) and a caveat above a study measured on its tiny config."""

from __future__ import annotations

from html import escape
from types import SimpleNamespace

import pytest

from harts.cli.report import TINY_CAVEAT, render_html
from harts.experiments.planners import study as planners
from harts.experiments.pp_schedules import study as pp_schedules


@pytest.fixture
def captured(monkeypatch):
    """The figures a study's `_plot` makes, kept open instead of rendered to PNG."""
    figs = []

    def keep(fig):
        figs.append(fig)
        return b""

    for module in (planners, pp_schedules):
        monkeypatch.setattr(module, "png", keep)
    yield figs
    import matplotlib.pyplot as plt

    for fig in figs:
        plt.close(fig)


def test_planner_bars_start_at_zero(captured):
    # balances of 52-99%: the old axis started near 47%
    rows = [{"case": "Tiny / 8 GPUs", "_case": "tiny-8", "_key": p, "c": c, "paper_c": pc, "b": b, "paper_b": pb,
             "t": 0.1, "paper_t": 0.2}
            for p, c, pc, b, pb in (("ortools-ffd", 2.0, 2.1, 0.52, 0.60), ("l1", 2.5, 2.4, 0.97, 0.95),
                                    ("l1l2", 2.6, 2.7, 0.99, 0.98))]
    planners._plot(rows, planners.PlannersConfig(planners=("ortools-ffd", "l1", "l1l2")))
    (fig,) = captured
    compression, balance, seconds = fig.axes[:3]
    assert balance.get_ylim()[0] == 0.0 and balance.get_ylim()[1] >= 100
    assert compression.get_ylim()[0] == 0.0 and seconds.get_ylim()[0] == 0.0


def test_pp_schedule_bars_start_at_zero(captured):
    cfg = pp_schedules.PPSchedulesConfig(microbatch_tokens=(98_304,))
    rows = [{"_schedule": s, "budget": 98_304, "rel": rel, "paper_rel": paper}
            for s, rel, paper in zip(cfg.schedules, (1.0, 1.08, 1.12), (1.0, 1.05, 1.1), strict=True)]
    pp_schedules._plot(rows, cfg)
    (fig,) = captured
    assert fig.axes[0].get_ylim()[0] == 0.0


def _run(config: str, table: dict) -> SimpleNamespace:
    import json

    return SimpleNamespace(run_id="r1", experiment="harts-planners", start_time=0, metrics={},
                           tags={"harts.config": config, "harts.title": "Table 4"},
                           files={"tables.json": json.dumps([table]).encode()})


PAPER_TABLE = {"title": "Table 4", "columns": [{"key": "planner", "label": "planner", "kind": "key"},
                                               {"key": "paper_b", "label": "paper balance", "kind": "paper"},
                                               {"key": "b", "label": "ours balance", "kind": "ours"}],
               "cells": [["l1l2", "97.50%", "96.10%"]], "row_kinds": [""]}
OURS_TABLE = {**PAPER_TABLE, "columns": [PAPER_TABLE["columns"][0], PAPER_TABLE["columns"][2]],
              "cells": [["l1l2", "96.10%"]]}


@pytest.mark.parametrize("config, table, shown", [
    ("tiny", PAPER_TABLE, True),       # tiny-config numbers beside the paper's
    ("default", PAPER_TABLE, False),   # the study's own scale
    ("tiny", OURS_TABLE, False),       # nothing of the paper's beside them
])
def test_tiny_config_caveat_beside_paper_numbers(config, table, shown):
    page = render_html({"planners": _run(config, table)}, ["planners"], "sqlite:///x.db")
    assert (escape(TINY_CAVEAT) in page) is shown
    if shown:  # above the table it qualifies, once
        assert page.count('class="caveat"') == 1 and page.index("Caveat:") < page.index("<table>")
