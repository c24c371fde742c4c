"""An EP group's joint events (`harts.plan.lockstep`): each replica's passes in its window
run's order, producers paired in forward and backward alike, the merge never blocked, and
replicas whose chains differ in depth sharing their producers' events."""

from __future__ import annotations

from hypothesis import given, settings

from harts.plan.lockstep import MERGES, _merge, joint_events, sequences, window_rows
from tests.strategies import LockstepMicrobatch as _Mb
from tests.strategies import nested_windows


def _chain(first_id: int, replica: int, depth: int, slot: int, rows: int) -> list[_Mb]:
    """`depth` producers, each the only consumer of the one before, and a last piece."""
    return [_Mb(first_id + k, replica, k, slot, first_id + k - 1 if k else None, rows) for k in range(depth + 1)]


def test_chains_of_different_depth_share_their_producers_events():
    """A replica's chain of 4 producers beside another's of 2 (all in slot 0): the merge
    pairs the shallower chain's producers with the deeper one's innermost, so there are as
    many producer forward events as the deeper chain has producers, not one per producer
    (the backwards come nearest first, and a forward must share its event with those of
    the backward it meets)."""
    mbs = _chain(0, 0, 4, 0, 4000) + _chain(10, 1, 2, 0, 4000)
    events = joint_events(mbs, [0, 1])
    fwd = [e.members for e in events if e.kind == "F"]
    assert len(fwd) == 4 and sum(len(m) == 2 for m in fwd) == 2
    assert len([e for e in events if e.kind == "FB"]) == 1
    assert sorted(map(sorted, (m.items() for m in fwd))) == \
        sorted(sorted(e.members.items()) for e in events if e.kind == "B")


@settings(max_examples=200, deadline=None)
@given(nested_windows())
def test_joint_events_keep_each_replicas_order_and_pair_forwards_with_backwards(case):
    """Every merge `joint_events` chooses from, on drawn nested windows."""
    mbs, replicas = case
    group = list(range(replicas))
    seqs = sequences(mbs, group)
    size = {m.id: float(m.executed_tokens) for m in mbs}
    chosen = joint_events(mbs, group)
    work = {p: w for seq in seqs.values() for p, w in window_rows(seq, size).items()}
    merges = [_merge(seqs, work, across, alpha) for across, alpha in MERGES]
    assert chosen in merges
    for events in merges:
        _check(mbs, group, seqs, events)


def _check(mbs, group, seqs, events) -> None:
    for r in group:
        assert [(e.kind, e.members[r]) for e in events if r in e.members] == [(k, m) for k, m, _ in seqs[r]]
    fwd = sorted(sorted(e.members.items()) for e in events if e.kind == "F")
    assert fwd == sorted(sorted(e.members.items()) for e in events if e.kind == "B")
    # a forward event's members meet again in one backward event after every consumer
    position = {(e.kind, mb): i for i, e in enumerate(events) for mb in e.members.values()}
    for m in mbs:
        if m.producer is not None:
            kind = "F" if ("F", m.id) in position else "FB"
            assert position[("F", m.producer)] < position[(kind, m.id)] < position[("B", m.producer)]
    # never more events than the replicas' passes run one replica at a time
    assert max(len(s) for s in seqs.values()) <= len(events) <= sum(len(s) for s in seqs.values())


def test_window_rows_are_a_windows_own_and_inner_rows():
    mbs = _chain(0, 0, 2, 0, 100) + [_Mb(3, 0, 3, 1, 0, 7)]
    seq = sequences(mbs, [0])[0]
    assert [k for k, _, _ in seq] == ["F", "F", "FB", "B", "FB", "B"]
    assert window_rows(seq, {m.id: float(m.executed_tokens) for m in mbs}) == {1: 200.0, 0: 307.0}
