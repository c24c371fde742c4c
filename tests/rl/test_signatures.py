"""State-action signatures: invariant to every formatting the normaliser documents,
distinct for values that differ, and an unreadable step names its trajectory and turn."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.rl.signatures import (
    StepSignature,
    normalise_args,
    signature,
    states_and_actions,
    trajectory_signatures,
)
from harts.tree.trajectory import Trajectory, Turn, TurnError
from tests.strategies import formatted_json, json_args


def _strict(a, b) -> bool:
    """Equality that tells True from 1 and 1 from 1.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_strict(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_strict(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@given(st.data(), json_args())
def test_arguments_are_invariant_to_documented_formatting(data, value):
    text = data.draw(formatted_json(value))
    assert normalise_args(text) == normalise_args(value)


@given(json_args())
def test_normalised_arguments_are_canonical_json(value):
    out = normalise_args(value)
    assert normalise_args(out) == out  # idempotent
    assert json.dumps(json.loads(out), ensure_ascii=False, separators=(",", ":"), sort_keys=True) == out


def _canonical_values():
    """Values already in normal form (strings normalised, numbers integral as ints)."""
    words = st.sampled_from(("a", "b c", "Foo", "foo", "caf\u00e9", "1", "true"))
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-50, 50),
                       st.sampled_from((0.5, -0.25, 1e-7, 3.3)), words)
    return st.recursive(leaves, lambda k: st.one_of(st.lists(k, max_size=3),
                                                    st.dictionaries(st.sampled_from("abc"), k, max_size=3)),
                        max_leaves=6)


@given(_canonical_values(), _canonical_values())
def test_different_values_give_different_arguments(a, b):
    # json.loads of the normal form gives the value back, so distinct values stay distinct.
    # Wrapped in a list: a top-level string is read as JSON text when it is valid JSON
    # (documented; test_documented_cases), a nested one never.
    assert _strict(json.loads(normalise_args([a])), [a])
    assert (normalise_args([a]) == normalise_args([b])) == _strict(a, b)


def test_documented_cases():
    assert normalise_args({"b": 1, "a": [1.0, "x"]}) == '{"a":[1,"x"],"b":1}'
    assert normalise_args('{ "a" : [ 1e0 , " x " ], "b":1 }') == normalise_args({"b": 1, "a": [1.0, "x"]})
    assert normalise_args(-0.0) == normalise_args(0) == "0"
    assert normalise_args(0.1) == normalise_args("0.10000000000000001") == "0.1"
    assert normalise_args("  free   text\n") == normalise_args("free text") == '"free text"'
    assert normalise_args('"abc"') == normalise_args("abc")
    assert normalise_args("1") == normalise_args(1) != normalise_args(["1"])  # top-level text is JSON if valid
    assert normalise_args("Abc") != normalise_args("abc")  # case is kept in arguments
    assert normalise_args(True) != normalise_args(1)
    assert normalise_args([1, 2]) != normalise_args([2, 1])  # list order kept
    assert normalise_args("NaN") == '"NaN"'  # not strict JSON: one text value
    for bad in ({"x": math.nan}, [math.inf], {1: "a"}, {"a": {1, 2}}):
        with pytest.raises(ValueError):
            normalise_args(bad)


def test_tool_and_outcome_are_case_and_whitespace_insensitive():
    a = signature(Turn(1, 2, " Search\t", '{"q": "x"}', "OK\n"))
    b = signature(Turn(1, 2, "search", {"q": "x"}, "ok"))
    assert a == b == StepSignature("search", '{"q":"x"}', "ok")
    assert signature(Turn(1, 2, "search", {"q": "x"}, "error")) != b
    assert signature(Turn(1, 2, "open", {"q": "x"}, "ok")) != b


def test_states_are_the_signatures_before_each_step():
    t = Trajectory.make("t", "g", list(range(8)), turns=[
        {"start": 1, "end": 2, "tool": "a", "args": "1", "outcome": "ok"},
        {"start": 3, "end": 5, "tool": "b", "args": "2", "outcome": "ok"},
        {"start": 5, "end": 6, "tool": "c", "args": "3", "outcome": "error"},
    ])
    sigs = trajectory_signatures(t)
    pairs = states_and_actions(sigs)
    assert [len(s) for s, _ in pairs] == [0, 1, 2]
    assert pairs[2] == ((sigs[0], sigs[1]), sigs[2])


def test_unreadable_steps_name_the_trajectory_and_the_turn():
    plain = Trajectory.make("plain-7", "g", [1, 2, 3])
    with pytest.raises(TurnError, match="trajectory 'plain-7'.*no step structure") as err:
        trajectory_signatures(plain)
    assert err.value.trajectory == "plain-7" and err.value.turn is None
    # turns that bypassed validation (the dataclass built directly)
    ok = Turn(1, 2, "a", "x", "ok")
    base = Trajectory.make("t-3", "g", [1, 2, 3, 4])
    overlapping = dataclasses.replace(base, turns=(ok, Turn(1, 3, "b", "y", "ok")))
    with pytest.raises(TurnError, match=r"trajectory 't-3' turn 1 field 'start'") as err:
        trajectory_signatures(overlapping)
    assert (err.value.trajectory, err.value.turn, err.value.turn_field) == ("t-3", 1, "start")
    nan_args = dataclasses.replace(base, turns=(ok, Turn(2, 3, "b", {"x": math.nan}, "ok")))
    with pytest.raises(TurnError, match=r"trajectory 't-3' turn 1 field 'args'"):
        trajectory_signatures(nan_args)
