"""The JSONL rollout format: round trip, and a clear error for every kind of bad input."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings

from harts.tree import RolloutFormatError, from_records, load_jsonl, save_jsonl
from harts.tree.trajectory import Trajectory, Turn, TurnError
from tests.strategies import trajectory_sets


def _good(i: int = 0, **over):
    rec = {
        "id": f"t{i}",
        "group": "g",
        "tokens": [5, 6, 7],
        "loss_mask": [0, 1, 1],
        "advantage": 0.5,
        "old_logprobs": [0.0, -1.0, -2.0],
    }
    rec.update(over)
    return rec


def _write(tmp_path, lines):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@settings(max_examples=15)
@given(trajectory_sets())
def test_save_load_round_trip(tmp_path_factory, trajs):
    path = tmp_path_factory.mktemp("io") / "rt.jsonl"
    save_jsonl(trajs, path)
    back = load_jsonl(path)
    assert len(back) == len(trajs)
    for a, b in zip(trajs, back, strict=True):
        assert a.same_as(b)


def test_extra_fields_are_kept_and_per_token_advantage(tmp_path):
    path = _write(tmp_path, [_good(0, reward=1.0, advantage=[0.0, 1.0, 2.0])])
    (t,) = load_jsonl(path)
    assert t.extra == {"reward": 1.0}
    assert np.array_equal(t.advantage, [0.0, 1.0, 2.0])


BAD = [
    ("tokens", {"tokens": [1, 2]}, r"line 2: field 'loss_mask': length 3 does not match 2 tokens"),
    ("loss_mask", {"loss_mask": [0, 1]}, r"line 2: field 'loss_mask': length 2 does not match 3"),
    ("old_logprobs", {"old_logprobs": [0.0]}, r"line 2: field 'old_logprobs': length 1 does not"),
    ("ref", {"ref_logprobs": [0.0, 1.0]}, r"line 2: field 'ref_logprobs': length 2"),
    ("adv-list", {"advantage": [1.0]}, r"line 2: field 'advantage': length 1"),
    ("float-token", {"tokens": [1, 2.5, 3]}, r"line 2: field 'tokens': position 1 is not an integer"),
    ("str-token", {"tokens": [1, "a", 3]}, r"line 2: field 'tokens': position 1 is not an integer"),
    ("bool-token", {"tokens": [1, True, 3]}, r"line 2: field 'tokens': position 1 is not an integer"),
    ("negative", {"tokens": [1, -2, 3]}, r"line 2: field 'tokens': position 1 is negative"),
    ("empty", {"tokens": [], "loss_mask": [], "old_logprobs": []}, r"line 2: field 'tokens': trajectory is empty"),
    ("mask-value", {"loss_mask": [0, 2, 1]}, r"line 2: field 'loss_mask': position 1 is not 0 or 1"),
    ("mask-first", {"loss_mask": [1, 1, 1]}, r"line 2: field 'loss_mask': position 0 cannot be trained"),
    ("nan-adv", {"advantage": float("nan")}, r"line 2: field 'advantage': position 0 is NaN or infinite"),
    ("inf-lp", {"old_logprobs": [0.0, float("-inf"), 0.0]}, r"line 2: field 'old_logprobs': position 1 is NaN"),
    ("str-adv", {"advantage": "high"}, r"line 2: field 'advantage': position 0 is not a number"),
    ("id", {"id": ""}, r"line 2: field 'id': must be a non-empty string"),
    ("group", {"group": 3}, r"line 2: field 'group': must be a non-empty string"),
    ("dup", {"id": "t0"}, r"line 2: field 'id': duplicate id 't0' \(first at .* line 1\)"),
]


@pytest.mark.parametrize("name,override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_field_names_line_and_field(tmp_path, name, override, message):
    rec = _good(1, **override)
    path = _write(tmp_path, [_good(0), rec])
    with pytest.raises(RolloutFormatError, match=message) as info:
        load_jsonl(path)
    assert info.value.line == 2


def test_missing_field_malformed_json_and_non_objects(tmp_path):
    rec = _good(1)
    del rec["old_logprobs"]
    with pytest.raises(RolloutFormatError, match=r"line 2: field 'old_logprobs': missing"):
        load_jsonl(_write(tmp_path, [_good(0), rec]))
    with pytest.raises(RolloutFormatError, match=r"line 3: malformed JSON"):
        load_jsonl(_write(tmp_path, [_good(0), _good(1), '{"id": "x", ']))
    with pytest.raises(RolloutFormatError, match=r"line 1: each line must be a JSON object"):
        load_jsonl(_write(tmp_path, ["[1, 2, 3]"]))
    with pytest.raises(RolloutFormatError, match="no trajectories"):
        load_jsonl(_write(tmp_path, [""]))
    with pytest.raises(RolloutFormatError, match="cannot read file"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_python_api_uses_the_same_checks():
    assert len(from_records([_good(0), _good(1)])) == 2
    with pytest.raises(RolloutFormatError, match=r"record 2: field 'tokens': position 0 is negative"):
        from_records([_good(0), _good(1, tokens=[-1, 1, 2])])


def test_errors_carry_file_line_and_field(tmp_path):
    path = _write(tmp_path, [_good(0), _good(1, loss_mask=[0, 1])])
    with pytest.raises(RolloutFormatError) as info:
        load_jsonl(path)
    assert (info.value.file, info.value.line, info.value.field) == (str(path), 2, "loss_mask")


def test_malformed_json_names_one_line_number(tmp_path):
    path = _write(tmp_path, [_good(0), _good(1), '{"id": "x", '])
    with pytest.raises(RolloutFormatError) as info:
        load_jsonl(path)
    msg = str(info.value)
    assert msg.startswith(f"{path} line 3: malformed JSON at column ") and msg.count("line") == 1
    assert info.value.line == 3


def test_out_of_vocabulary_token_by_file_line_and_trajectory(tmp_path):
    path = _write(tmp_path, [_good(0), _good(1, tokens=[5, 99, 7])])
    assert len(load_jsonl(path, vocab_size=100)) == 2
    with pytest.raises(RolloutFormatError) as info:
        load_jsonl(path, vocab_size=99)
    assert str(info.value) == (f"{path} line 2: field 'tokens': trajectory 't1': token id 99 at position 1 "
                               "is outside the vocabulary (size 99)")
    assert (info.value.line, info.value.field) == (2, "tokens")


def test_save_leaves_no_temporary_file(tmp_path):
    save_jsonl(from_records([_good(0)]), tmp_path / "a.jsonl")
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]
    with pytest.raises(IsADirectoryError):
        save_jsonl(from_records([_good(0)]), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


# ---- step structure (turns) -------------------------------------------------------------

def _turns(**over):
    turns = [
        {"start": 1, "end": 2, "tool": "search", "args": {"q": "x", "n": 2}, "outcome": "ok"},
        {"start": 2, "end": 3, "tool": "answer", "args": "42", "outcome": "error"},
    ]
    turns[1].update(over)
    return turns


def test_turns_round_trip_and_old_files_load_without_them(tmp_path):
    path = _write(tmp_path, [_good(0, turns=_turns()), _good(1), _good(2, turns=[])])
    a, b, c = load_jsonl(path)
    assert [(t.start, t.end, t.tool, t.args, t.outcome) for t in a.turns] == [
        (1, 2, "search", {"q": "x", "n": 2}, "ok"), (2, 3, "answer", "42", "error")]
    assert b.turns is None and b.extra == {} and c.turns == ()
    save_jsonl([a, b, c], tmp_path / "back.jsonl")
    back = load_jsonl(tmp_path / "back.jsonl")
    assert all(x.same_as(y) for x, y in zip((a, b, c), back, strict=True))
    assert "turns" not in json.loads((tmp_path / "back.jsonl").read_text().splitlines()[1])
    assert not a.same_as(dataclasses.replace(a, turns=a.turns[:1]))


def test_turns_survive_the_forest():
    from harts.tree.build import build_forest

    trajs = from_records([_good(0, turns=_turns()), _good(1, tokens=[5, 6, 8]), _good(2, turns=[])])
    out = {t.id: t for t in build_forest(trajs).expand()}
    assert all(t.same_as(out[t.id]) for t in trajs)


BAD_TURNS = [
    ("start-type", {"start": 1.5}, "turn 1 field 'start': must be an integer"),
    ("end-past", {"end": 4}, "turn 1 field 'end': 4 is past the trajectory's 3 tokens"),
    ("empty", {"start": 2, "end": 2}, "turn 1 field 'end': 2 must be greater than start 2"),
    ("overlap", {"start": 1}, "turn 1 field 'start': 1 overlaps or precedes the previous turn"),
    ("negative", {"start": -1}, "turn 1 field 'start': negative"),
    ("tool", {"tool": ""}, "turn 1 field 'tool': must be a non-empty string"),
    ("tool-type", {"tool": 3}, "turn 1 field 'tool': must be a string"),
    ("outcome", {"outcome": None}, "turn 1 field 'outcome': must be a string"),
    ("args-key", {"args": {"a": [1, {"b": float("nan")}]}}, "turn 1 field 'args': contains NaN"),
    ("unknown", {"why": 1}, "turn 1 field 'why': unknown turn field"),
]


@pytest.mark.parametrize("name,override,message", BAD_TURNS, ids=[b[0] for b in BAD_TURNS])
def test_bad_turns_name_line_trajectory_turn_and_field(tmp_path, name, override, message):
    path = tmp_path / "r.jsonl"
    # NaN is written as JSON's non-standard NaN, which Python's reader accepts
    path.write_text(json.dumps(_good(0)) + "\n" + json.dumps(_good(1, turns=_turns(**override))) + "\n")
    with pytest.raises(RolloutFormatError, match=r"line 2: field 'turns': trajectory 't1' " + message) as info:
        load_jsonl(path)
    assert (info.value.line, info.value.field) == (2, "turns")


def test_bad_turn_lists_and_missing_turn_fields():
    with pytest.raises(RolloutFormatError, match=r"field 'turns': trajectory 't0': must be a list of turns"):
        from_records([_good(0, turns={"start": 1})])
    bad = _turns()
    del bad[0]["outcome"]
    with pytest.raises(RolloutFormatError, match=r"trajectory 't0' turn 0 field 'outcome': missing"):
        from_records([_good(0, turns=bad)])
    with pytest.raises(RolloutFormatError, match=r"trajectory 't0' turn 1: must be an object"):
        from_records([_good(0, turns=[_turns()[0], 7])])
    with pytest.raises(TurnError) as info:
        Trajectory.make("x", "g", [1, 2, 3], turns=_turns(end=9))
    assert (info.value.trajectory, info.value.turn, info.value.turn_field) == ("x", 1, "end")


def test_turn_arguments_are_stored_as_plain_json_copies(tmp_path):
    args = {"n": np.int64(3), "xs": (np.float64(0.5), 1)}
    t = Trajectory.make("x", "g", [1, 2, 3], loss_mask=[0, 1, 1],
                        turns=[{"start": 1, "end": 3, "tool": "t", "args": args, "outcome": "ok"}])
    args["n"] = 4
    assert t.turns[0].args == {"n": 3, "xs": [0.5, 1]} and type(t.turns[0].args["n"]) is int
    save_jsonl([t], tmp_path / "a.jsonl")
    assert load_jsonl(tmp_path / "a.jsonl")[0].same_as(t)


def test_turns_from_objects_with_the_turn_attributes():
    @dataclasses.dataclass(frozen=True)
    class EnvTurn:  # an environment's own record of a turn
        start: int
        end: int
        tool: str
        args: dict
        outcome: str
        latency: float = 0.0

    t = Trajectory.make("x", "g", [1, 2, 3], turns=[EnvTurn(1, 2, "t", {"a": 1}, "ok")])
    assert t.turns[0] == Turn(1, 2, "t", {"a": 1}, "ok")
    with pytest.raises(TurnError, match="turn 0: must be an object"):
        Trajectory.make("x", "g", [1, 2, 3], turns=[(1, 2, "t", {}, "ok")])
