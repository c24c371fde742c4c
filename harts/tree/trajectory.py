"""One rollout trajectory as training sees it.

Per-position arrays are as long as `tokens`. Token p is trained on when `loss_mask[p]` is
set; its log-prob comes from the logits at p-1, so `loss_mask[0]` is always 0.
`old_logprobs[p]` is the rollout policy's log-prob of token p (ignored where the mask is 0).
A scalar advantage is broadcast to every position at construction, so downstream code sees
one shape.

A trajectory of a multi-turn (agentic) rollout may carry its step structure: `turns`, one
`Turn` per action the policy took, in order. A turn's `[start, end)` is the token range of
the action within `tokens` (the tool call the policy emitted, not the environment's
observation after it); ranges are non-empty, inside the trajectory and non-overlapping.
`tool` names the tool called, `args` are its arguments (a string or a JSON value) and
`outcome` is what the environment reported (e.g. "ok", "error"). `turns` is None when the
rollout has no step structure (plain single-response rollouts) and `()` for an agentic
rollout that took no action. Per-step credit assignment (harts.rl.rtmc) and prefix
allocation (harts.rl.trace) read it; training itself does not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class TrajectoryError(ValueError):
    """A trajectory that breaks the input contract; the message names the field."""


class TurnError(TrajectoryError):
    """A turn that breaks the step-structure contract. The message reads
    `turns: trajectory 'ID' turn I field 'NAME': ...`; `trajectory`, `turn` (0-based index,
    None when the turns list as a whole is wrong) and `turn_field` (None likewise) carry the same."""

    def __init__(self, trajectory: str, turn: int | None, turn_field: str | None, message: str):
        where = f"trajectory {trajectory!r}"
        if turn is not None:
            where += f" turn {turn}"
        if turn_field is not None:
            where += f" field {turn_field!r}"
        super().__init__(f"turns: {where}: {message}")
        self.trajectory = trajectory
        self.turn = turn
        self.turn_field = turn_field


TURN_FIELDS = ("start", "end", "tool", "args", "outcome")


@dataclass(frozen=True)
class Turn:
    """One action of a multi-turn rollout: tokens `[start, end)` of the trajectory are the
    action; `tool`, `args` and `outcome` describe the call and what the environment answered.
    `args` is a string or a JSON value (object, list, number, bool, null). `Turn.make` (and
    so `Trajectory.make` and the JSONL reader) validates a turn and stores a plain copy of
    its arguments (dicts, lists, Python numbers), so the turn does not share them."""

    start: int
    end: int
    tool: str
    args: Any
    outcome: str

    @classmethod
    def make(cls, value: Turn | Mapping[str, Any], trajectory: str = "?", index: int = 0) -> Turn:
        """A validated Turn from a mapping with the five fields (extra keys refused) or an
        object with the five attributes (a Turn, or an environment's own turn record).
        Bounds against the trajectory are checked by `validate_turns`. Raises TurnError."""
        if isinstance(value, Mapping):
            rec: Mapping[str, Any] = value
        elif all(hasattr(value, f) for f in TURN_FIELDS):
            rec = {f: getattr(value, f) for f in TURN_FIELDS}
        else:
            raise TurnError(trajectory, index, None, f"must be an object with fields {', '.join(TURN_FIELDS)}")
        for key in TURN_FIELDS:
            if key not in rec:
                raise TurnError(trajectory, index, key, "missing")
        unknown = sorted(str(k) for k in rec if k not in TURN_FIELDS)
        if unknown:
            raise TurnError(trajectory, index, unknown[0], "unknown turn field")
        for key in ("start", "end"):
            v = rec[key]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TurnError(trajectory, index, key, f"must be an integer ({v!r})")
        for key in ("tool", "outcome"):
            if not isinstance(rec[key], str):
                raise TurnError(trajectory, index, key, f"must be a string ({rec[key]!r})")
        if not rec["tool"].strip():
            raise TurnError(trajectory, index, "tool", "must be a non-empty string")
        problem = _json_problem(rec["args"])
        if problem:
            raise TurnError(trajectory, index, "args", problem)
        return cls(int(rec["start"]), int(rec["end"]), rec["tool"], _plain_json(rec["args"]), rec["outcome"])

    def to_record(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "tool": self.tool, "args": self.args, "outcome": self.outcome}


def validate_turns(trajectory: str, turns: Any, length: int) -> tuple[Turn, ...]:
    """Validated turns of trajectory `trajectory` (id, for messages) with `length` tokens:
    every turn well-formed, `0 <= start < end <= length`, in order and non-overlapping
    (`start >= previous end`). Raises TurnError naming the trajectory, the turn and the field."""
    if isinstance(turns, (str, bytes, Mapping)) or not isinstance(turns, Sequence):
        raise TurnError(trajectory, None, None, "must be a list of turns")
    out: list[Turn] = []
    prev_end = 0
    for i, value in enumerate(turns):
        turn = Turn.make(value, trajectory, i)
        if turn.start < 0:
            raise TurnError(trajectory, i, "start", f"negative ({turn.start})")
        if turn.end <= turn.start:
            raise TurnError(trajectory, i, "end", f"{turn.end} must be greater than start {turn.start} (empty action)")
        if turn.end > length:
            raise TurnError(trajectory, i, "end", f"{turn.end} is past the trajectory's {length} tokens")
        if turn.start < prev_end:
            raise TurnError(trajectory, i, "start",
                            f"{turn.start} overlaps or precedes the previous turn (which ends at {prev_end})")
        prev_end = turn.end
        out.append(turn)
    return tuple(out)


def _plain_json(value: Any) -> Any:
    """A copy of a validated JSON value in plain Python types (tuples become lists)."""
    if isinstance(value, Mapping):
        return {k: _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _json_problem(value: Any, depth: int = 0) -> str | None:
    """Why `value` is not a JSON value with finite numbers and string keys (None if it is)."""
    if depth > 64:
        return "nested too deeply"
    if value is None or isinstance(value, (str, bool)):
        return None
    if isinstance(value, (int, np.integer)):
        return None
    if isinstance(value, (float, np.floating)):
        return None if math.isfinite(value) else "contains NaN or infinity"
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"object key {k!r} is not a string"
            if (p := _json_problem(v, depth + 1)):
                return p
        return None
    if isinstance(value, (list, tuple)):
        for v in value:
            if (p := _json_problem(v, depth + 1)):
                return p
        return None
    return f"must be a string or a JSON value ({type(value).__name__})"


@dataclass(frozen=True, eq=False)
class Trajectory:
    id: str
    group: str
    tokens: np.ndarray  # int64 [L]
    loss_mask: np.ndarray  # bool [L]
    advantage: np.ndarray  # float64 [L]
    old_logprobs: np.ndarray  # float64 [L]
    ref_logprobs: np.ndarray | None = None  # float64 [L]
    extra: dict[str, Any] = field(default_factory=dict)
    turns: tuple[Turn, ...] | None = None  # step structure, None when the rollout has none

    @classmethod
    def make(
        cls,
        id: str,
        group: str,
        tokens: Any,
        loss_mask: Any = None,
        advantage: Any = 0.0,
        old_logprobs: Any = None,
        ref_logprobs: Any = None,
        extra: dict[str, Any] | None = None,
        turns: Any = None,
    ) -> Trajectory:
        """Build and validate a trajectory from Python values or arrays.

        Defaults: loss mask all ones after position 0, zero advantage, zero old log-probs,
        no step structure. `turns` is a list of `Turn`s or mappings with their fields.
        Raises TrajectoryError naming the offending field (TurnError for turns, naming the
        trajectory, the turn and the field too).
        """
        if not isinstance(id, str) or not id:
            raise TrajectoryError("id: must be a non-empty string")
        if not isinstance(group, str) or not group:
            raise TrajectoryError("group: must be a non-empty string")
        tok = _int_tokens(tokens)
        n = tok.size
        if loss_mask is None:
            mask = np.ones(n, dtype=bool)
            mask[:1] = False
        else:
            mask = _mask(loss_mask, n)
        adv = _float_array("advantage", advantage, n, allow_scalar=True)
        old = np.zeros(n) if old_logprobs is None else _float_array("old_logprobs", old_logprobs, n)
        ref = None if ref_logprobs is None else _float_array("ref_logprobs", ref_logprobs, n)
        steps = None if turns is None else validate_turns(id, turns, n)
        return cls(id, group, tok, mask, adv, old, ref, dict(extra or {}), steps)

    def __len__(self) -> int:
        return int(self.tokens.size)

    def same_as(self, other: Trajectory) -> bool:
        """Exact equality of every field (arrays compared element-wise, NaN-free by contract)."""
        if (self.id, self.group, self.extra, self.turns) != (other.id, other.group, other.extra, other.turns):
            return False
        if (self.ref_logprobs is None) != (other.ref_logprobs is None):
            return False
        pairs = [
            (self.tokens, other.tokens),
            (self.loss_mask, other.loss_mask),
            (self.advantage, other.advantage),
            (self.old_logprobs, other.old_logprobs),
        ]
        if self.ref_logprobs is not None:
            pairs.append((self.ref_logprobs, other.ref_logprobs))
        return all(a.shape == b.shape and np.array_equal(a, b) for a, b in pairs)


def _int_tokens(tokens: Any) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise TrajectoryError("tokens: must be a flat list of integers")
    if arr.size == 0:
        raise TrajectoryError("tokens: trajectory is empty")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TrajectoryError("tokens: every token must be an integer")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise TrajectoryError(f"tokens: negative token id {int(arr[arr < 0][0])}")
    return arr


def _mask(value: Any, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.size != n:
        raise TrajectoryError(f"loss_mask: length {arr.size} does not match {n} tokens")
    values = set(np.unique(arr).tolist()) if arr.size else set()
    if not values <= {0, 1} or arr.dtype.kind not in "biu":
        raise TrajectoryError("loss_mask: values must be 0 or 1")
    mask = arr.astype(bool)
    if mask[0]:
        raise TrajectoryError("loss_mask: position 0 cannot be trained on (no logits precede it)")
    return mask


def _float_array(name: str, value: Any, n: int, allow_scalar: bool = False) -> np.ndarray:
    if allow_scalar and np.ndim(value) == 0:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TrajectoryError(f"{name}: must be a number or a list of numbers")
        arr = np.full(n, float(value))
    else:
        arr = np.asarray(value)
        if arr.ndim != 1 or arr.size != n:
            raise TrajectoryError(f"{name}: length {arr.size} does not match {n} tokens")
        if arr.dtype.kind not in "iuf":
            raise TrajectoryError(f"{name}: values must be numbers")
        arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise TrajectoryError(f"{name}: contains NaN or infinity")
    return arr
