"""State-action signatures: the compact form in which steps of different rollouts match.

A step of a multi-turn rollout (a `harts.tree.trajectory.Turn`) is summarised by its
`StepSignature`: the tool category, the normalised arguments and the normalised outcome.
Two steps are the same action when their signatures are equal. A *state* is the tuple of
signatures of the steps before a step (the interaction history, compressed; optionally
only the last few of them, `states_and_actions(..., window=w)`); the step's own signature
is the *action* taken in that state. Rollouts of one group that share a
history therefore share a state whatever their token-level differences (sampling noise in
whitespace, key order in a JSON tool call), which is what lets harts.rl.rtmc pool their
returns.

Normalisation (what `normalise_args`, `normalise_tool` and `normalise_outcome` make equal):

- **Text** (free-text arguments, JSON string values, tool names, outcomes): Unicode NFC,
  leading and trailing whitespace removed, every inner run of whitespace made one space.
  Case is kept in arguments; tool names and outcomes are case-insensitive (casefolded).
- **Arguments given as a string** are parsed as JSON when the whole string is valid strict
  JSON (`'{"q": "x"}'` is the object, `'3'` the number 3; `NaN` and `Infinity` are not
  JSON); otherwise the string is one text value. So an object, its JSON text in any formatting and key order, and the same text
  with extra whitespace between tokens all normalise alike; `"abc"` (a JSON string) and
  `abc` (free text) too.
- **Objects**: keys sorted (keys are NFC-normalised but otherwise exact), no whitespace
  between tokens.
- **Numbers** by value: an integer, or a float with an integral value (`1`, `1.0`,
  `1e0`, `-0.0`), is written as a decimal integer; other floats as Python's shortest
  round-trip repr (`0.1`, `1e-07`). Booleans and null stay JSON `true`, `false`, `null`
  (never numbers). NaN and infinite numbers in non-string arguments are refused
  (ValueError).
- **Lists** keep their order (argument order can matter to a tool).

The result of `normalise_args` is canonical JSON text, so it is also a stable string key.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.tree.trajectory import Trajectory, Turn, TurnError, validate_turns

_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class StepSignature:
    """One step as matching sees it: normalised tool name, arguments (canonical JSON text)
    and outcome. Hashable and ordered, so signatures key dictionaries and sort."""

    tool: str
    args: str
    outcome: str


State = tuple[StepSignature, ...]


def normalise_text(text: str) -> str:
    """NFC, stripped, inner whitespace runs made one space (case kept)."""
    return _WS.sub(" ", unicodedata.normalize("NFC", text)).strip()


def normalise_tool(tool: str) -> str:
    """A tool name's category: normalised text, casefolded."""
    return normalise_text(tool).casefold()


def normalise_outcome(outcome: str) -> str:
    """An outcome: normalised text, casefolded."""
    return normalise_text(outcome).casefold()


def normalise_args(args: Any) -> str:
    """Canonical JSON text of a step's arguments (rules in the module docstring).

    Raises ValueError for NaN or infinite numbers, non-string object keys, keys that
    collide after NFC, and values that are not JSON (sets, bytes, objects).
    """
    if isinstance(args, str):
        try:
            value = json.loads(args, parse_constant=_refuse_constant)
        except (json.JSONDecodeError, _NonFinite):
            value = args
    else:
        value = args
    return json.dumps(_canonical(value), ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                      allow_nan=False)


def signature(turn: Turn) -> StepSignature:
    """The signature of one step."""
    return StepSignature(normalise_tool(turn.tool), normalise_args(turn.args), normalise_outcome(turn.outcome))


def trajectory_signatures(trajectory: Trajectory) -> tuple[StepSignature, ...]:
    """Every step's signature, in order. A trajectory without a readable step structure
    (no `turns`, a malformed turn, arguments that do not normalise) raises TurnError naming
    the trajectory and the turn."""
    if trajectory.turns is None:
        raise TurnError(trajectory.id, None, None,
                        "the rollout has no step structure (no turns); per-step credit needs turns")
    turns = validate_turns(trajectory.id, trajectory.turns, len(trajectory))
    out = []
    for i, turn in enumerate(turns):
        try:
            out.append(signature(turn))
        except ValueError as err:
            raise TurnError(trajectory.id, i, "args", f"cannot be normalised ({err})") from None
    return tuple(out)


def states_and_actions(signatures: Sequence[StepSignature], window: int | None = None
                       ) -> list[tuple[State, StepSignature]]:
    """(state, action) of every step: the state of step t is the signatures of steps
    0..t-1, or with `window` = w only the last w of them (a coarser state: rollouts that
    reach the same recent steps by different routes share it, and one rollout can revisit
    a state)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window: must be None or an integer >= 0 (got {window!r})")
    sigs = tuple(signatures)
    return [(sigs[:t] if window is None else sigs[max(0, t - window):t], sigs[t]) for t in range(len(sigs))]


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(f"non-finite number {name} in arguments")


def _canonical(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return normalise_text(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        x = float(value)
        if not math.isfinite(x):
            raise ValueError(f"non-finite number {x!r} in arguments")
        if x.is_integer():
            return int(x)
        return x
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"object key {k!r} is not a string")
            key = unicodedata.normalize("NFC", k)
            if key in out:
                raise ValueError(f"object keys collide after normalisation ({key!r})")
            out[key] = _canonical(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    raise ValueError(f"not a JSON value ({type(value).__name__})")

