"""Configs to mlflow params: nested dataclasses, dicts and sequences flattened to dotted keys.

mlflow params are strings of bounded length, keyed by names from a small alphabet. A
config is flattened so that every leaf is one param (``cases.0.model = tiny``); a list of
plain scalars stays one param (``dtypes = ["float32", "float64"]``), so a sweep's axis reads
as one value in the UI. Values longer than mlflow's limit are cut with a marker (the full
config is always logged as a JSON artifact too).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from collections.abc import Mapping
from typing import Any

# mlflow's limits (mlflow.utils.validation); kept here so flattening needs no mlflow import
MAX_PARAM_VALUE = 6000
MAX_KEY = 250
_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /:]")


def clean_key(key: str) -> str:
    """A name mlflow accepts for params and metrics (alphanumerics, _ - . space / :)."""
    return _BAD_KEY_CHARS.sub("_", str(key))[:MAX_KEY]


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, enum.Enum))


def _text(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def to_plain(obj: Any) -> Any:
    """Dataclasses, enums, tuples and numpy scalars as JSON-ready dicts, lists and scalars."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return obj


def flatten_params(obj: Any, prefix: str = "") -> dict[str, str]:
    """Every leaf of a (nested) config as ``dotted.key -> string``."""
    out: dict[str, str] = {}
    _flatten(to_plain(obj), prefix, out)
    return out


def _flatten(obj: Any, key: str, out: dict[str, str]) -> None:
    if isinstance(obj, dict):
        if not obj and key:
            out[clean_key(key)] = "{}"
        for k, v in obj.items():
            _flatten(v, f"{key}.{k}" if key else str(k), out)
        return
    if isinstance(obj, list) and not all(_scalar(v) for v in obj):
        for i, v in enumerate(obj):
            _flatten(v, f"{key}.{i}" if key else str(i), out)
        return
    text = _text(obj)
    if len(text) > MAX_PARAM_VALUE:
        marker = "...[truncated]"
        text = text[: MAX_PARAM_VALUE - len(marker)] + marker
    out[clean_key(key or "value")] = text


def flatten_metrics(obj: Any, prefix: str = "") -> dict[str, float]:
    """Every finite numeric leaf (bools as 0/1) of a nested dict as ``dotted.key -> float``;
    strings, None and non-finite values are skipped (mlflow metrics are numbers)."""
    out: dict[str, float] = {}
    _flatten_numbers(to_plain(obj), prefix, out)
    return out


def _flatten_numbers(obj: Any, key: str, out: dict[str, float]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten_numbers(v, f"{key}.{k}" if key else str(k), out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _flatten_numbers(v, f"{key}.{i}" if key else str(i), out)
    elif isinstance(obj, bool):
        out[clean_key(key)] = float(obj)
    elif isinstance(obj, (int, float)) and math.isfinite(float(obj)):
        out[clean_key(key)] = float(obj)
