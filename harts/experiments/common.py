"""What every study shares: result and table types, progress, plots, and logging to mlflow.

A `Table` is a list of row dicts with typed columns; a column is a row key ("key"), one
of our measurements ("ours") or the paper's number ("paper"), so the CLI and the HTML
report both print the paper's numbers next to ours the same way. A `StudyResult` becomes
one parent mlflow run (the study: config as params, summary metrics, results.json,
table.json/.txt, plots/*.png) with one nested child run per variant (its own params,
metrics and artifacts such as plans/*.json and schedules/*.txt).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harts.track.params import to_plain

EXPERIMENT_PREFIX = "harts-"


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    kind: str = "ours"  # "key" | "ours" | "paper"
    fmt: str = "{}"  # format() pattern for numbers, e.g. "{:.3f}x", "{:.2%}"

    def format(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return self.fmt.format(value)
        return str(value)


@dataclass(frozen=True)
class Table:
    title: str
    columns: tuple[Column, ...]
    rows: tuple[dict[str, Any], ...]
    note: str = ""

    def cells(self) -> list[list[str]]:
        return [[c.format(row.get(c.key)) for c in self.columns] for row in self.rows]

    def to_text(self) -> str:
        from harts.track.text import format_table

        out = [self.title, format_table([c.label for c in self.columns], self.cells())]
        if self.note:
            out.append(self.note)
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "columns": [{"key": c.key, "label": c.label, "kind": c.kind, "fmt": c.fmt} for c in self.columns],
            "rows": [to_plain({k: v for k, v in r.items() if not k.startswith("_")}) for r in self.rows],
            "cells": self.cells(),
            # a row may be the paper's own (a "_kind": "paper" entry), shaded like paper columns
            "row_kinds": [str(r.get("_kind", "")) for r in self.rows],
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Table:
        return cls(
            title=d["title"],
            columns=tuple(Column(**c) for c in d["columns"]),
            rows=tuple(dict(r) for r in d["rows"]),
            note=d.get("note", ""),
        )


@dataclass(frozen=True)
class Variant:
    """One child run: a point of the study's sweep."""

    name: str
    params: dict[str, Any]
    metrics: dict[str, float]
    artifacts: dict[str, bytes | str] = field(default_factory=dict)


@dataclass(frozen=True)
class StudyResult:
    metrics: dict[str, float]
    table: Table
    extra_tables: tuple[Table, ...] = ()
    variants: tuple[Variant, ...] = ()
    figures: dict[str, bytes] = field(default_factory=dict)  # name -> PNG
    artifacts: dict[str, bytes | str] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)  # everything else, JSON-able
    notes: tuple[str, ...] = ()
    # filled in by registry.run_study
    study: str = ""
    title: str = ""
    config_name: str = ""
    config: Any = None
    seconds: float = 0.0

    @property
    def tables(self) -> tuple[Table, ...]:
        return (self.table, *self.extra_tables)

    def summary(self) -> dict[str, Any]:
        return {
            "study": self.study,
            "title": self.title,
            "config_name": self.config_name,
            "config": to_plain(self.config),
            "seconds": self.seconds,
            "metrics": self.metrics,
            "table": self.table.to_dict(),
            "extra_tables": [t.to_dict() for t in self.extra_tables],
            "variants": [{"name": v.name, "params": to_plain(v.params), "metrics": v.metrics} for v in self.variants],
            "results": to_plain(self.results),
            "notes": list(self.notes),
        }


class Progress:
    """Steps of a study, reported to a callback `fn(done, total, label)` (the CLI draws it)."""

    def __init__(self, fn: Callable[[int, int, str], None] | None = None):
        self.fn = fn
        self.total = 0
        self.done = 0

    def start(self, total: int) -> None:
        self.total, self.done = total, 0

    def step(self, label: str) -> None:
        """Announce the step about to run."""
        if self.fn is not None:
            self.fn(self.done, self.total, label)
        self.done += 1

    def finish(self) -> None:
        if self.fn is not None:
            self.fn(self.total, self.total, "done")


def png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def metric_key(*parts: Any) -> str:
    return ".".join(str(p) for p in parts if p != "")


def experiment_name(study: str) -> str:
    return EXPERIMENT_PREFIX + study


def to_record(result: StudyResult) -> Any:
    """The mlflow runs of a study: parent + one nested child per variant."""
    from harts.track.record import RunRecord

    artifacts: dict[str, bytes | str] = {
        "results.json": json.dumps(result.summary(), indent=2, default=str),
        "table.json": json.dumps(result.table.to_dict(), indent=2, default=str),
        "tables.json": json.dumps([t.to_dict() for t in result.tables], indent=2, default=str),
        "table.txt": "\n\n".join(t.to_text() for t in result.tables) + "\n",
        **{f"plots/{name}.png": data for name, data in result.figures.items()},
        "figures.json": json.dumps([f"plots/{name}.png" for name in result.figures]),
        **result.artifacts,
    }
    children = [
        RunRecord(name=v.name, params=v.params, metrics=v.metrics,
                  tags={"harts.kind": "variant", "harts.study": result.study, "harts.variant": v.name},
                  artifacts=v.artifacts)
        for v in result.variants
    ]
    return RunRecord(
        name=f"{result.study} ({result.config_name})",
        params=result.config,
        metrics={**result.metrics, "study_seconds": result.seconds},
        tags={"harts.kind": "study", "harts.study": result.study, "harts.config": result.config_name,
              "harts.title": result.title, "mlflow.note.content": "\n\n".join(result.notes)},
        artifacts=artifacts,
        children=children,
    )


def log_study(result: StudyResult, tracking_uri: str | None = None) -> str:
    """Log a study's result; returns the parent run id."""
    from harts.track.record import log_record

    return log_record(to_record(result), experiment_name(result.study), tracking_uri)


def fmt_x(value: float) -> str:
    return f"{value:.2f}x"


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")
