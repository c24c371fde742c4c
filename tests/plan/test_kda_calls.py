"""KDA call planner: optimality against exhaustive search, paper-like cases, validation.

The reference below re-derives rounds and replay from the call-model definitions
(DESIGN.md §4) without sharing code with the planner: chains by following the chosen
continuations, each producer by walking up to the node u with s_u < a <= e_u, rounds as
the longest dependency chain.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from harts.plan.kda_calls import (
    KDACallPlan,
    build_kda_plan,
    plan_kda_calls,
    plan_kda_calls_for,
)
from tests.strategies import KDATreeCase, kda_tree_from_lengths, small_kda_trees


def reference_cost(case: KDATreeCase, nxt: tuple[int, ...]) -> tuple[int, int]:
    """(rounds, replay) of one continuation choice, straight from the definitions."""
    parent, start, end, B = case.node_parent, case.node_start, case.node_end, case.chunk_size
    n = len(parent)
    continued = {c for c in nxt if c >= 0}
    heads = [v for v in range(n) if v not in continued]
    seq_of = [-1] * n
    for q, head in enumerate(heads):
        v = head
        while v >= 0:
            assert seq_of[v] == -1
            seq_of[v] = q
            v = nxt[v]
    assert -1 not in seq_of
    aligned = [start[h] // B * B for h in heads]
    producer = []
    for head, a in zip(heads, aligned, strict=True):
        if a == 0:
            producer.append(-1)
            continue
        u = parent[head]
        while not (start[u] < a <= end[u]):
            u = parent[u]
        producer.append(seq_of[u])
    memo: dict[int, int] = {}

    def round_of(q: int) -> int:
        if q not in memo:
            memo[q] = 0 if producer[q] < 0 else 1 + round_of(producer[q])
        return memo[q]

    rounds = 1 + max(round_of(q) for q in range(len(heads)))
    replay = sum(start[h] - a for h, a in zip(heads, aligned, strict=True))
    return rounds, replay


def full_state_min_rounds(case: KDATreeCase) -> int:
    """Minimum rounds by a DP whose state is the chain's actual aligned start a.

    g(v, a): fewest rounds after the chain's own, over the sequences started below v, when
    v's chain starts at a; every continuation child is tried. A child c that starts its
    own sequence has aligned start a_c: a_c == a means the chain's producer gives S(a_c)
    (same round), otherwise the chain itself does (one round later). No IN/OUT reduction
    and no argmax rule, so it checks both on trees too large to enumerate.
    """
    parent, start, B = case.node_parent, case.node_start, case.chunk_size
    children: list[list[int]] = [[] for _ in parent]
    for v, p in enumerate(parent):
        if p >= 0:
            children[p].append(v)
    memo: dict[tuple[int, int], int] = {}

    def g(v: int, a: int) -> int:
        if (v, a) not in memo:
            kids = children[v]
            branch = {}
            for c in kids:
                a_c = start[c] // B * B
                branch[c] = (a_c != a) + g(c, a_c)
            best = max(branch.values(), default=0)
            for k in kids:
                others = [branch[c] for c in kids if c != k]
                best = min(best, max([g(k, a), *others]))
            memo[v, a] = best
        return memo[v, a]

    return 1 + max(g(r, 0) for r, p in enumerate(parent) if p < 0)


def all_choices(case: KDATreeCase) -> list[tuple[int, ...]]:
    children: list[list[int]] = [[] for _ in case.node_parent]
    for v, p in enumerate(case.node_parent):
        if p >= 0:
            children[p].append(v)
    return list(itertools.product(*[[-1, *kids] for kids in children]))


def lengths_case(parents: list[int], lengths: list[int], B: int) -> KDATreeCase:
    return kda_tree_from_lengths(parents, lengths, B)


# Hand-made cases, B = 4: fork exactly on a boundary, fork inside the chain's first chunk,
# fork mid-chunk after the first chunk, forks at the end of a deep chain, a wide fan, a
# caterpillar whose better continuation is the second child, two roots, and a tie on f_out
# that only the IN state breaks (first child [4, 5) forks inside its first chunk, second
# child [4, 8) forks on the next boundary: continuing into the first costs a third call).
FORK_ON_BOUNDARY = lengths_case([-1, 0, 0], [4, 3, 5], 4)
FORK_IN_FIRST_CHUNK = lengths_case([-1, 0, 1, 1, 0], [1, 6, 2, 1, 2], 4)
FORK_MID_CHUNK = lengths_case([-1, 0, 1, 1, 1], [3, 3, 1, 2, 4], 4)
DEEP_CHAIN = lengths_case([-1, 0, 1, 2, 3, 4, 5, 5, 6], [3, 2, 4, 1, 1, 5, 2, 3, 1], 4)
WIDE_FAN = lengths_case([-1, 0, 0, 0, 0, 0, 0, 0, 0], [6, 1, 2, 3, 4, 5, 1, 2, 3], 4)
CATERPILLAR = lengths_case([-1, 0, 0, 2, 2, 4, 4, 6, 6], [4, 1, 4, 1, 4, 2, 4, 3, 4], 4)
TWO_ROOTS = lengths_case([-1, 0, 0, -1, 3, 3], [5, 3, 4, 2, 9, 1], 4)
IN_STATE_TIE = lengths_case([-1, 0, 1, 1, 0, 4, 4], [4, 1, 1, 2, 4, 1, 2], 4)
# Complete binary tree of depth 3, every fork on a boundary (B = 2): four calls.
FOUR_CALLS = lengths_case([-1, 0, 1, 2, 2, 1, 5, 5, 0, 8, 9, 9, 8, 12, 12], [2] * 15, 2)


def check_against_exhaustive(case: KDATreeCase) -> None:
    plan = plan_kda_calls_for(case, case.chunk_size)
    plan.validate()
    costs = {nxt: reference_cost(case, nxt) for nxt in all_choices(case)}
    min_rounds = min(r for r, _ in costs.values())
    min_replay_at_min_rounds = min(rp for r, rp in costs.values() if r == min_rounds)
    assert plan.num_rounds == min_rounds
    assert reference_cost(case, tuple(plan.node_next.tolist())) == (
        plan.num_rounds,
        plan.replay_tokens,
    )
    # Stronger than the tie-break promises: R is the smallest over every choice.
    assert plan.replay_tokens == min_replay_at_min_rounds
    assert plan.replay_tokens == min(rp for _, rp in costs.values())


# Several trees per example: one exhaustive check costs a few ms, and the configurations
# where the DP's IN state decides the choice are rare (~0.6% of drawn trees).
@given(st.lists(small_kda_trees(), min_size=1, max_size=16))
@example([FORK_ON_BOUNDARY])
@example([FORK_IN_FIRST_CHUNK])
@example([FORK_MID_CHUNK])
@example([DEEP_CHAIN])
@example([WIDE_FAN])
@example([CATERPILLAR])
@example([TWO_ROOTS])
@example([IN_STATE_TIE])
@example([FOUR_CALLS])
def test_planner_matches_exhaustive_minimum(cases: list[KDATreeCase]) -> None:
    for case in cases:
        check_against_exhaustive(case)


@given(small_kda_trees(max_nodes=8))
@example(CATERPILLAR)
@example(IN_STATE_TIE)
def test_build_agrees_with_reference_for_every_choice(case: KDATreeCase) -> None:
    for nxt in all_choices(case):
        plan = build_kda_plan(
            case.node_parent, case.node_start, case.node_end, np.array(nxt), case.chunk_size
        )
        plan.validate()
        assert (plan.num_rounds, plan.replay_tokens) == reference_cost(case, nxt)


@given(small_kda_trees(max_nodes=60, chunk_sizes=(1, 4, 8, 64)))
@example(FOUR_CALLS)
@example(IN_STATE_TIE)
def test_larger_forests_match_the_full_state_dp(case: KDATreeCase) -> None:
    plan = plan_kda_calls_for(case, case.chunk_size)
    plan.validate()
    assert reference_cost(case, tuple(plan.node_next.tolist())) == (
        plan.num_rounds,
        plan.replay_tokens,
    )
    assert plan.num_rounds == full_state_min_rounds(case)
    assert plan.num_rounds <= 1 + math.floor(math.log2(len(case.node_parent)))
    # Every node with children continues its chain (minimum replay).
    has_child = np.zeros(plan.num_nodes, dtype=bool)
    parents = np.asarray(case.node_parent)
    has_child[parents[parents >= 0]] = True
    assert np.array_equal(plan.node_next >= 0, has_child)


def chains(plan: KDACallPlan) -> list[list[int]]:
    return [plan.chain(q).tolist() for q in range(plan.num_sequences)]


def test_fork_inside_first_chunk_runs_in_round_zero_with_replay_from_zero() -> None:
    # Root [0, 10) forks into [10, 30) and [10, 15): the side branch replays 10 tokens
    # from position 0 and packs into the same first call.
    plan = plan_kda_calls([-1, 0, 0], [0, 10, 10], [10, 30, 15], 64)
    plan.validate()
    assert plan.num_rounds == 1
    assert chains(plan) == [[0, 1], [2]]
    assert plan.seq_round.tolist() == [0, 0]
    assert plan.seq_start.tolist() == [0, 0]
    assert plan.seq_replay.tolist() == [0, 10]
    assert plan.seq_producer.tolist() == [-1, -1]
    assert plan.replay_tokens == 10


def test_fork_on_chunk_boundary_hands_over_without_replay() -> None:
    plan = plan_kda_calls([-1, 0, 0], [0, 64, 64], [64, 100, 90], 64)
    plan.validate()
    assert plan.num_rounds == 2
    assert chains(plan) == [[0, 1], [2]]
    assert plan.seq_start.tolist() == [0, 64]
    assert plan.seq_init_boundary.tolist() == [0, 64]
    assert plan.seq_replay.tolist() == [0, 0]
    assert plan.seq_producer.tolist() == [-1, 0]
    assert [r.tolist() for r in plan.rounds] == [[0], [1]]


def test_figure_c1_side_branches_replay_p1_from_h0() -> None:
    # P0 [0, 64), P1 [64, 100), then A, B, C: A continues; B and C start from S(64)
    # (produced by the P0-P1-A call) and replay P1's 36 tokens in round 1.
    plan = plan_kda_calls([-1, 0, 1, 1, 1], [0, 64, 100, 100, 100], [64, 100, 180, 130, 150])
    plan.validate()
    assert chains(plan) == [[0, 1, 2], [3], [4]]
    assert plan.seq_round.tolist() == [0, 1, 1]
    assert plan.seq_start.tolist() == [0, 64, 64]
    assert plan.seq_replay.tolist() == [0, 36, 36]
    assert plan.seq_producer.tolist() == [-1, 0, 0]
    assert (plan.num_rounds, plan.replay_tokens) == (2, 72)


def test_figure_2_two_calls() -> None:
    # v0 [0, 20) -> v1 [20, 150) -> v3 [150, 200); v2 [20, 40) forks inside the first
    # chunk (round 0, replay 20 from 0); v4 [150, 170) forks later (round 1 from S(128)).
    plan = plan_kda_calls([-1, 0, 1, 1, 0], [0, 20, 150, 150, 20], [20, 150, 200, 170, 40], 64)
    plan.validate()
    assert chains(plan) == [[0, 1, 2], [3], [4]]
    assert plan.seq_round.tolist() == [0, 1, 0]
    assert plan.seq_start.tolist() == [0, 128, 0]
    assert plan.seq_replay.tolist() == [0, 22, 20]
    assert plan.seq_producer.tolist() == [-1, 0, -1]
    assert [r.tolist() for r in plan.rounds] == [[0, 2], [1]]
    assert plan.node_seq.tolist() == [0, 0, 0, 1, 2]


def test_continues_into_the_costlier_child_not_the_first() -> None:
    # Root [0, 64); X [64, 70) is a leaf; Y [64, 200) forks again at 200. Continuing
    # into X would put Y in round 1 and Y's side child in round 2 (3 calls).
    parent, start, end = [-1, 0, 0, 2, 2], [0, 64, 64, 200, 200], [64, 70, 200, 210, 220]
    plan = plan_kda_calls(parent, start, end, 64)
    plan.validate()
    assert plan.num_rounds == 2
    assert plan.node_next.tolist() == [2, -1, 3, -1, -1]
    first_child = build_kda_plan(parent, start, end, [1, -1, 3, -1, -1], 64)
    first_child.validate()
    assert first_child.num_rounds == 3


def test_forest_roots_all_start_in_round_zero() -> None:
    plan = plan_kda_calls([-1, -1, 1, 1], [0, 0, 70, 70], [5, 70, 80, 90], 64)
    plan.validate()
    assert plan.seq_round.tolist() == [0, 0, 1]
    assert plan.seq_producer.tolist() == [-1, -1, 1]
    assert plan.num_rounds == 2


def test_empty_forest() -> None:
    plan = plan_kda_calls([], [], [])
    plan.validate()
    assert (plan.num_rounds, plan.num_sequences, plan.replay_tokens) == (0, 0, 0)
    assert plan.rounds == ()


def test_wrapper_reads_forest_attributes() -> None:
    forest = SimpleNamespace(
        node_parent=np.array([-1, 0, 0]),
        node_start=np.array([0, 8, 8]),
        node_end=np.array([8, 9, 12]),
    )
    plan = plan_kda_calls_for(forest, chunk_size=4)
    assert plan.chunk_size == 4
    assert plan.num_rounds == 2
    assert plan.seq_replay.tolist() == [0, 0]


def test_plan_arrays_are_read_only_copies() -> None:
    parent = np.array([-1, 0])
    plan = plan_kda_calls(parent, [0, 3], [3, 5], 4)
    with pytest.raises(ValueError):
        plan.seq_round[0] = 5
    parent[1] = -1
    assert plan.node_parent.tolist() == [-1, 0]


@pytest.mark.parametrize(
    ("parent", "start", "end", "chunk_size", "message"),
    [
        ([-1, 1], [0, 3], [3, 5], 4, "earlier node"),
        ([-1, 0], [0, 2], [3, 5], 4, "parent's end"),
        ([1, -1], [0, 0], [3, 5], 4, "earlier node"),
        ([-1, 0], [0, 3], [3, 3], 4, "must exceed"),
        ([-1, -1], [0, 1], [3, 5], 4, "start 1 must be 0"),
        ([-1, 0], [0, 3], [3, 5], 0, "chunk_size"),
        ([-1, 0], [0, 3], [3], 4, "same length"),
        ([-1.0, 0.0], [0, 3], [3, 5], 4, "integer"),
    ],
)
def test_bad_forests_are_refused(parent, start, end, chunk_size, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_kda_calls(parent, start, end, chunk_size)


def test_build_refuses_a_continuation_that_is_not_a_child() -> None:
    with pytest.raises(ValueError, match="not a child"):
        build_kda_plan([-1, 0, 0], [0, 3, 3], [3, 5, 6], [1, 2, -1], 4)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a)
    a.flags.writeable = False
    return a


def _corruptions(plan: KDACallPlan) -> dict[str, dict]:
    # FIGURE_2 plan: chains [0, 1, 2], [3], [4]; rounds [0, 1, 0].
    later = plan.seq_round.copy()
    later[1] = 0
    seq_nodes = plan.seq_nodes.copy()
    seq_nodes[[1, 2]] = seq_nodes[[2, 1]]
    dup_nodes = plan.seq_nodes.copy()
    dup_nodes[4] = 3
    start = plan.seq_start.copy()
    start[1] = 64
    replay = plan.seq_replay.copy()
    replay[1] = 0
    producer = plan.seq_producer.copy()
    producer[1] = -1
    return {
        "comes from sequence": dict(seq_round=_frozen(later)),
        "not a child": dict(seq_nodes=_frozen(seq_nodes)),
        "exactly once": dict(seq_nodes=_frozen(dup_nodes)),
        "aligned start": dict(seq_start=_frozen(start)),
        "replay must be": dict(seq_replay=_frozen(replay)),
        "lies in node": dict(seq_producer=_frozen(producer)),
        "replay_tokens": dict(replay_tokens=plan.replay_tokens + 1),
        "num_rounds": dict(num_rounds=3),
        "another round": dict(rounds=(plan.rounds[1], plan.rounds[0])),
        "node_seq disagrees": dict(node_seq=_frozen(np.zeros(5, dtype=np.int64))),
        "node_next": dict(node_next=_frozen(np.full(5, -1))),
    }


@pytest.mark.parametrize(
    "message",
    [
        "comes from sequence",
        "not a child",
        "exactly once",
        "aligned start",
        "replay must be",
        "lies in node",
        "replay_tokens",
        "num_rounds",
        "another round",
        "node_seq disagrees",
        "node_next",
    ],
)
def test_validate_catches_each_broken_rule(message: str) -> None:
    plan = plan_kda_calls([-1, 0, 1, 1, 0], [0, 20, 150, 150, 20], [20, 150, 200, 170, 40], 64)
    plan.validate()
    broken = dataclasses.replace(plan, **_corruptions(plan)[message])
    with pytest.raises(ValueError, match=message):
        broken.validate()


def random_bushy_forest(rng: np.random.Generator, num_nodes: int, chunk_size: int) -> KDATreeCase:
    """A full-size random forest (hypothesis draws small data first; a seed does not)."""
    B = chunk_size
    parents: list[int] = []
    slots: list[int] = []
    while len(parents) < num_nodes:
        p = slots.pop() if slots else -1
        v = len(parents)
        parents.append(p)
        fanout = int(rng.choice([0, 0, 1, 2, 2, 3]))
        if fanout <= num_nodes - len(parents) - len(slots):
            slots.extend([v] * fanout)
    lengths: list[int] = []
    ends: list[int] = []
    for p in parents:
        s = 0 if p < 0 else ends[p]
        to_boundary = B - s % B
        kind = rng.choice(["boundary", "inside", "inside", "cross", "long"])
        if kind == "boundary":
            length = to_boundary + B * int(rng.integers(0, 2))
        elif kind == "inside" and to_boundary > 1:
            length = int(rng.integers(1, to_boundary))
        elif kind == "cross" and B > 1:
            length = to_boundary + int(rng.integers(1, B))
        else:
            length = int(rng.integers(1, 3 * B + 1))
        lengths.append(length)
        ends.append(s + length)
    return kda_tree_from_lengths(parents, lengths, B)


@given(st.integers(0, 2**32 - 1), st.sampled_from([4, 8, 64]))
def test_random_bushy_forests_match_the_full_state_dp(seed: int, chunk_size: int) -> None:
    case = random_bushy_forest(np.random.default_rng(seed), 300, chunk_size)
    plan = plan_kda_calls_for(case, chunk_size)
    plan.validate()
    assert plan.num_rounds == full_state_min_rounds(case)
    assert reference_cost(case, tuple(plan.node_next.tolist())) == (
        plan.num_rounds,
        plan.replay_tokens,
    )
