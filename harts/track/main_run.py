"""Logging `harts run` (the README's main command) to the tracking store."""

from __future__ import annotations

import json
from typing import Any

from harts.track.params import flatten_metrics, to_plain
from harts.track.record import RunRecord, log_record
from harts.track.store import resolve_tracking_uri, ui_hint

MAIN_EXPERIMENT = "harts-run"


def log_main_run(summary: dict[str, Any], tracking_uri: str | None = None) -> str:
    """Log one `harts run` summary and return how to look at it: the
    ``mlflow ui --backend-store-uri ...`` command for a local store (``open URL in a
    browser`` for a server).

    Top-level scalars (workload, model, seed, ...) become params, every numeric leaf of
    the nested sections a metric (``verify.max_rel_grad_err``, ``tree.compression``; bools as
    0/1), and the whole summary is kept as ``summary.json``."""
    uri = resolve_tracking_uri(tracking_uri)
    plain = to_plain(summary)
    params = {k: v for k, v in plain.items() if not isinstance(v, (dict, list))}
    nested = {k: v for k, v in plain.items() if isinstance(v, (dict, list))}
    metrics = flatten_metrics(nested)
    metrics.update({k: v for k, v in flatten_metrics(params).items() if k not in ("seed",)})
    name = " ".join(str(params[k]) for k in ("workload", "model") if k in params) or "harts run"
    record = RunRecord(
        name=name,
        params=params,
        metrics=metrics,
        tags={"harts.kind": "main-run"},
        artifacts={"summary.json": json.dumps(plain, indent=2, default=str, allow_nan=True)},
    )
    log_record(record, MAIN_EXPERIMENT, uri)
    return ui_hint(uri)
