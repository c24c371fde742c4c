"""Experiment files: a study and its parameters as a TOML file (`experiments/*.toml`, one
per table or figure of the paper), run with ``harts experiment run FILE``.

    reproduces = "Table 4: two-level scheduling (compression, balance, planning time)"
    study = "planners"          # a registered study (`harts experiment list`)
    config = "default"          # the named config the parameters start from (default: "default")

    [parameters]                # fields of the study's config dataclass
    planners = ["ortools-ffd", "l1", "l1l2"]
    cases = [{model = "flash", gpus = 32, scheme = "treestep"}]

A parameter replaces the field of that name in the named config; a field the file leaves
out keeps the named config's value (TOML has no null, so a field whose value is None
there stays None). Values are checked against the field's type: TOML arrays become
tuples, tables become the field's dataclass (a `Case`) or dict, integers are accepted
where a float is expected. A key the file does not know (at the top or among the
parameters, at any depth) is refused naming it, as is a value of the wrong type: an
`ExperimentFileError`, which the CLI prints in one line (exit code 2).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harts.experiments.registry import get_study, known_studies

TOP_KEYS = ("reproduces", "study", "config", "parameters")


class ExperimentFileError(ValueError):
    """A problem with an experiment file: `file`, `line` (1-based, where the key is found)
    and `field` (dotted, e.g. "parameters.cases[0].gpus") say where."""

    def __init__(self, message: str, *, file: str, field: str | None = None, line: int | None = None):
        super().__init__(f"{file}: {message}")
        self.file, self.field, self.line = file, field, line


@dataclass(frozen=True)
class ExperimentFile:
    path: Path
    text: str
    reproduces: str
    study: str
    config_name: str  # the named config the parameters start from
    parameters: dict[str, Any]  # as the file gives them
    config: Any  # the study's config with the parameters applied


def load_experiment(path: str | Path) -> ExperimentFile:
    """Read, check and resolve an experiment file (see the module docstring)."""
    path = Path(path)
    name = str(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ExperimentFileError(f"cannot read it ({err.strerror or err})", file=name) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        line = getattr(err, "lineno", None)
        raise ExperimentFileError(f"not valid TOML ({err})", file=name, line=line) from None

    def fail(message: str, field: str | None = None, key: str | None = None) -> ExperimentFileError:
        return ExperimentFileError(message, file=name, field=field, line=_line_of(text, key or field))

    for key in data:
        if key not in TOP_KEYS:
            raise fail(f"unknown key {key!r}; an experiment file has {', '.join(TOP_KEYS)}", key, key)
    for key in ("reproduces", "study"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise fail(f"{key!r} must be a non-empty string", key, key)
    config_name = data.get("config", "default")
    if not isinstance(config_name, str):
        raise fail("'config' must be a string (the name of one of the study's configs)", "config", "config")
    parameters = data.get("parameters", {})
    if not isinstance(parameters, dict):
        raise fail("'parameters' must be a table", "parameters", "parameters")
    if data["study"] not in known_studies():
        raise fail(f"unknown study {data['study']!r}; known studies: {', '.join(known_studies())}", "study", "study")
    study = get_study(data["study"])
    if config_name not in study.configs:
        raise fail(f"study {study.name.value} has no config {config_name!r}; its configs: "
                   f"{', '.join(study.configs)}", "config", "config")
    base = study.config(config_name)
    try:
        config = _replace(base, parameters, "parameters")
    except _ValueProblem as err:
        raise fail(err.message, err.field, err.key) from None
    return ExperimentFile(path, text, data["reproduces"], study.name.value, config_name, parameters, config)


class _ValueProblem(Exception):
    def __init__(self, message: str, field: str, key: str):
        self.message, self.field, self.key = message, field, key


def _replace(base: Any, table: dict[str, Any], where: str) -> Any:
    """`base` (a dataclass) with the fields `table` names converted and replaced."""
    return dataclasses.replace(base, **_fields(type(base), table, where))


def _fields(cls: type, table: dict[str, Any], where: str) -> dict[str, Any]:
    """`table`'s entries converted to the types of `cls`'s fields; a key that is no field
    of `cls` is refused naming it."""
    names = [f.name for f in dataclasses.fields(cls)]
    hints = typing.get_type_hints(cls)
    for key in table:
        if key not in names:
            raise _ValueProblem(f"unknown key {key!r} in {where} ({cls.__name__}: {', '.join(names)})",
                                f"{where}.{key}", key)
    return {key: _convert(value, hints[key], f"{where}.{key}", key) for key, value in table.items()}


def _convert(value: Any, tp: Any, field: str, key: str) -> Any:
    """A TOML value as type `tp`, or `_ValueProblem`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def wrong(expected: str) -> _ValueProblem:
        return _ValueProblem(f"{field} must be {expected}, got {value!r}", field, key)

    if tp is Any:
        return _frozen(value)
    if origin in (typing.Union, types.UnionType):
        # TOML has no null: the value is one of the other members
        options = [a for a in args if a is not type(None)]
        problems = []
        for option in options:
            try:
                return _convert(value, option, field, key)
            except _ValueProblem as err:
                problems.append(err)
        raise problems[0]
    if origin is tuple:
        if not isinstance(value, list):
            raise wrong("an array")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{field}[{i}]", key) for i, v in enumerate(value))
        if len(value) != len(args):
            raise wrong(f"an array of {len(args)} values")
        return tuple(_convert(v, a, f"{field}[{i}]", key) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong("a table")
        return {k: _convert(v, args[1], f"{field}.{k}", k) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise wrong(f"a table of {tp.__name__} fields")
        missing = [f.name for f in dataclasses.fields(tp) if f.name not in value
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise wrong(f"a {tp.__name__} table with {', '.join(missing)}")
        return tp(**_fields(tp, value, field))
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong("a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    raise wrong(f"a {tp!r}, which an experiment file cannot give")


def _frozen(value: Any) -> Any:
    """Arrays as tuples, at any depth (what the configs hold)."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _line_of(text: str, key: str | None) -> int | None:
    """The first line that assigns `key` (as a bare key), or None."""
    if not key:
        return None
    key = key.rsplit(".", 1)[-1].split("[", 1)[0]
    pattern = re.compile(rf"(^|[{{,\s]){re.escape(key)}\s*=")
    for i, line in enumerate(text.splitlines(), 1):
        if pattern.search(line.split("#", 1)[0]):
            return i
    return None
