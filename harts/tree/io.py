"""Rollouts in and out: the JSONL schema, one trajectory per line.

    {"id": str, "group": str, "tokens": [int], "loss_mask": [0|1],
     "advantage": float or [float], "old_logprobs": [float],
     "ref_logprobs": [float]  (optional),
     "turns": [{"start": int, "end": int, "tool": str, "args": str or JSON value,
                "outcome": str}]  (optional)}

Per-position arrays are as long as `tokens`. `loss_mask[p] = 1` when token p was generated
by the policy and is trained on; its log-prob comes from the logits at p-1, so
`loss_mask[0]` is 0. `old_logprobs[p]` is the rollout log-prob of token p. `turns` is the
step structure of a multi-turn rollout (harts.tree.trajectory.Turn: each action's token
range `[start, end)` within `tokens`, in order and non-overlapping, with its tool, arguments
and outcome); a bad turn's error names the trajectory, the turn index and the turn's
field. Files without `turns` load with `Trajectory.turns` None. Extra fields are
kept (in `Trajectory.extra`) and otherwise ignored. Loading is all-or-nothing: the first
bad line raises `RolloutFormatError` naming the line and the field, and nothing is returned.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

import numpy as np

from harts.tree.trajectory import Trajectory, TrajectoryError

REQUIRED = ("id", "group", "tokens", "loss_mask", "advantage", "old_logprobs")
KNOWN = (*REQUIRED, "ref_logprobs", "turns")


class RolloutFormatError(ValueError):
    """Bad rollout input. `line` is 1-based (0 for records given through the Python API or
    a problem with the file as a whole); `file` is the file's path (None for records);
    `field` is the record field the message names (its messages say `field 'NAME': ...`),
    else None."""

    def __init__(self, where: str, message: str, line: int = 0, file: str | None = None):
        super().__init__(f"{where}: {message}")
        self.line = line
        self.file = file
        match = _FIELD.match(message)
        self.field = match.group(1) if match else None


_FIELD = re.compile(r"field '([^']+)'")


def from_records(records: Iterable[Mapping[str, Any]], source: str = "record",
                 vocab_size: int | None = None) -> list[Trajectory]:
    """Validate records with the JSONL schema and return trajectories (all or nothing);
    with `vocab_size`, token ids must also be below it."""
    return _convert(((n, rec) for n, rec in enumerate(records, start=1)), lambda n: f"{source} {n}", source,
                    vocab_size)


def load_jsonl(path: str | os.PathLike[str], vocab_size: int | None = None) -> list[Trajectory]:
    """Load a JSONL rollout file; raises RolloutFormatError naming the file, line and field.
    With `vocab_size`, a token id outside the vocabulary is such an error too."""
    name = os.fspath(path)
    records = []
    try:
        with open(name, encoding="utf-8") as fh:
            for n, text in enumerate(fh, start=1):
                if not text.strip():
                    continue
                try:
                    records.append((n, json.loads(text)))
                except json.JSONDecodeError as err:
                    # err's own text counts lines within this one line: name the column only
                    raise RolloutFormatError(f"{name} line {n}", f"malformed JSON at column {err.colno}: {err.msg}",
                                             n, file=name) from None
    except OSError as err:
        raise RolloutFormatError(name, f"cannot read file ({err.strerror})", file=name) from None
    except UnicodeDecodeError as err:
        raise RolloutFormatError(name, f"not UTF-8 text ({err.reason})", file=name) from None
    try:
        return _convert(records, lambda n: f"{name} line {n}", name, vocab_size)
    except RolloutFormatError as err:
        err.file = name
        raise


def _convert(numbered: Iterable[tuple[int, Any]], where_of, source: str,
             vocab_size: int | None = None) -> list[Trajectory]:
    out: list[Trajectory] = []
    seen: dict[str, int] = {}
    for n, rec in numbered:
        where = where_of(n)
        traj = _record_to_trajectory(rec, where, n)
        if vocab_size is not None and traj.tokens.size and int(traj.tokens.max()) >= vocab_size:
            p = int(np.argmax(traj.tokens >= vocab_size))
            raise RolloutFormatError(
                where, f"field 'tokens': trajectory {traj.id!r}: token id {int(traj.tokens[p])} at position {p} "
                f"is outside the vocabulary (size {vocab_size})", n)
        if traj.id in seen:
            raise RolloutFormatError(
                where, f"field 'id': duplicate id {traj.id!r} (first at {where_of(seen[traj.id])})", n
            )
        seen[traj.id] = n
        out.append(traj)
    if not out:
        raise RolloutFormatError(source, "no trajectories")
    return out


def save_jsonl(trajectories: Iterable[Trajectory], path: str | os.PathLike[str]) -> None:
    """Write trajectories as JSONL, atomically: a temporary file in the target's folder,
    fsynced and renamed over `path`; on any failure it is removed and `path` is untouched."""
    target = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target) or ".", prefix=f".{os.path.basename(target)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            write_jsonl(trajectories, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_jsonl(trajectories: Iterable[Trajectory], fh: TextIO) -> None:
    """Trajectories as JSONL records onto an open text file."""
    for t in trajectories:
        fh.write(json.dumps(to_record(t), separators=(",", ":")))
        fh.write("\n")


def to_record(t: Trajectory) -> dict[str, Any]:
    adv = t.advantage
    rec: dict[str, Any] = dict(t.extra)
    rec.update(
        id=t.id,
        group=t.group,
        tokens=t.tokens.tolist(),
        loss_mask=t.loss_mask.astype(int).tolist(),
        advantage=float(adv[0]) if adv.size and (adv == adv[0]).all() else adv.tolist(),
        old_logprobs=t.old_logprobs.tolist(),
    )
    if t.ref_logprobs is not None:
        rec["ref_logprobs"] = t.ref_logprobs.tolist()
    if t.turns is not None:
        rec["turns"] = [turn.to_record() for turn in t.turns]
    return rec


def _record_to_trajectory(rec: Any, where: str, line: int) -> Trajectory:
    if not isinstance(rec, Mapping):
        raise RolloutFormatError(where, "each line must be a JSON object", line)
    for key in REQUIRED:
        if key not in rec:
            raise RolloutFormatError(where, f"field {key!r}: missing", line)
    for key in ("id", "group"):
        if not isinstance(rec[key], str) or not rec[key]:
            raise RolloutFormatError(where, f"field {key!r}: must be a non-empty string", line)
    for key in ("tokens", "loss_mask", "old_logprobs", "ref_logprobs"):
        if key in rec and rec[key] is not None and not isinstance(rec[key], list):
            raise RolloutFormatError(where, f"field {key!r}: must be a list", line)
    tokens = rec["tokens"]
    if not tokens:
        raise RolloutFormatError(where, "field 'tokens': trajectory is empty", line)
    for p, tok in enumerate(tokens):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise RolloutFormatError(where, f"field 'tokens': position {p} is not an integer ({tok!r})", line)
        if tok < 0:
            raise RolloutFormatError(where, f"field 'tokens': position {p} is negative ({tok})", line)
        if tok >= 2**62:
            raise RolloutFormatError(where, f"field 'tokens': position {p} is too large ({tok})", line)
    n = len(tokens)
    for key in ("loss_mask", "old_logprobs", "ref_logprobs"):
        val = rec.get(key)
        if val is not None and len(val) != n:
            raise RolloutFormatError(
                where, f"field {key!r}: length {len(val)} does not match {n} tokens", line
            )
    for p, m in enumerate(rec["loss_mask"]):
        if isinstance(m, bool) or m not in (0, 1):
            raise RolloutFormatError(where, f"field 'loss_mask': position {p} is not 0 or 1 ({m!r})", line)
    adv = rec["advantage"]
    if isinstance(adv, list):
        if len(adv) != n:
            raise RolloutFormatError(
                where, f"field 'advantage': length {len(adv)} does not match {n} tokens", line
            )
        _check_numbers(adv, "advantage", where, line)
    else:
        _check_numbers([adv], "advantage", where, line)
    for key in ("old_logprobs", "ref_logprobs"):
        if rec.get(key) is not None:
            _check_numbers(rec[key], key, where, line)
    extra = {k: v for k, v in rec.items() if k not in KNOWN}
    try:
        return Trajectory.make(
            rec["id"],
            rec["group"],
            np.asarray(tokens, dtype=np.int64),
            loss_mask=np.asarray(rec["loss_mask"], dtype=np.int8),
            advantage=adv if not isinstance(adv, list) else np.asarray(adv, dtype=np.float64),
            old_logprobs=np.asarray(rec["old_logprobs"], dtype=np.float64),
            ref_logprobs=None if rec.get("ref_logprobs") is None else np.asarray(rec["ref_logprobs"], dtype=np.float64),
            extra=extra,
            turns=rec.get("turns"),
        )
    except TrajectoryError as err:
        field, _, msg = str(err).partition(": ")
        raise RolloutFormatError(where, f"field {field!r}: {msg}", line) from None


def _check_numbers(values: list[Any], key: str, where: str, line: int) -> None:
    for p, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise RolloutFormatError(where, f"field {key!r}: position {p} is not a number ({x!r})", line)
        if not math.isfinite(x):
            raise RolloutFormatError(where, f"field {key!r}: position {p} is NaN or infinite", line)
