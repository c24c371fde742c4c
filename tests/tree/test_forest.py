"""Properties of the rollout forest, each checked against an independent computation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from harts.tree import Trajectory, build_forest
from tests.strategies import trajectory_sets


def _prefix_sets(trajs: list[Trajectory]) -> dict[str, set[tuple[int, ...]]]:
    out: dict[str, set[tuple[int, ...]]] = {}
    for t in trajs:
        toks = tuple(t.tokens.tolist())
        out.setdefault(t.group, set()).update(toks[: p + 1] for p in range(len(toks)))
    return out


@given(trajectory_sets())
def test_round_trip_is_exact(trajs):
    forest = build_forest(trajs)
    forest.validate()
    back = forest.expand()
    assert [t.id for t in back] == [t.id for t in trajs]
    for a, b in zip(trajs, back, strict=True):
        assert a.same_as(b), a.id


@given(trajectory_sets())
def test_token_counts_match_distinct_prefixes(trajs):
    forest = build_forest(trajs)
    # every compact row is one distinct (group, prefix): count those independently
    distinct = sum(len(s) for s in _prefix_sets(trajs).values())
    assert forest.compact_tokens == distinct
    assert forest.expanded_tokens == sum(len(t) for t in trajs)
    assert forest.compression == forest.expanded_tokens / forest.compact_tokens


@given(trajectory_sets())
def test_rows_follow_each_trajectory(trajs):
    forest = build_forest(trajs)
    rows, off = forest.traj_rows, forest.traj_offsets
    for i, t in enumerate(trajs):
        r = rows[off[i] : off[i + 1]]
        assert np.array_equal(forest.token_ids[r], t.tokens)
        assert np.array_equal(forest.row_position[r], np.arange(len(t)))
        # consecutive positions are parent -> child rows
        assert forest.row_parent[r[0]] == -1
        assert np.array_equal(forest.row_parent[r[1:]], r[:-1])


@given(trajectory_sets())
def test_ancestor_interval_mask_equals_parent_walk(trajs):
    forest = build_forest(trajs)
    n = forest.num_rows
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    interval = (k <= q) & (q <= forest.row_end[None, :])
    walked = np.zeros((n, n), dtype=bool)
    parent = forest.row_parent.tolist()
    for row in range(n):
        v = row
        while v >= 0:
            walked[row, v] = True
            v = parent[v]
    assert np.array_equal(interval, walked)


@given(trajectory_sets())
def test_occurrence_counts_trajectories_through_each_row(trajs):
    forest = build_forest(trajs)
    counts = np.zeros(forest.num_rows, dtype=np.int64)
    for i in range(len(trajs)):
        counts[forest.traj_rows[forest.traj_offsets[i] : forest.traj_offsets[i + 1]]] += 1
    assert np.array_equal(forest.row_occurrence, counts)
    # and from the tokens alone: trajectories of the group that have the row's prefix
    prefix_of_row = {}
    for i, t in enumerate(trajs):
        r = forest.traj_rows[forest.traj_offsets[i] : forest.traj_offsets[i + 1]]
        for p, row in enumerate(r.tolist()):
            prefix_of_row[row] = (t.group, tuple(t.tokens[: p + 1].tolist()))
    for row, (g, pre) in prefix_of_row.items():
        expect = sum(1 for t in trajs if t.group == g and tuple(t.tokens[: len(pre)].tolist()) == pre)
        assert forest.row_occurrence[row] == expect


@given(trajectory_sets())
def test_nodes_are_maximal_fork_free_segments(trajs):
    forest = build_forest(trajs)
    ends_here = np.bincount(forest.traj_node, minlength=forest.num_nodes)
    for v in range(forest.num_nodes):
        kids = forest.node_children[v]
        # a node with one child exists only because some trajectory ends there
        if len(kids) == 1:
            assert ends_here[v] > 0
        if len(kids) == 0:
            assert ends_here[v] > 0
        first_tokens = forest.token_ids[forest.node_row_start[kids]]
        assert len(set(first_tokens.tolist())) == len(kids)
    # roots of one group start with distinct tokens too (forks at position 0)
    for g in range(len(forest.groups)):
        roots = forest.roots[forest.node_group[forest.roots] == g]
        firsts = forest.token_ids[forest.node_row_start[roots]]
        assert len(set(firsts.tolist())) == len(roots)


@given(trajectory_sets())
def test_targets_are_the_expanded_list(trajs):
    forest = build_forest(trajs)
    tg = forest.targets()
    assert len(tg) == sum(len(t) - 1 for t in trajs)
    for i, t in enumerate(trajs):
        sel = tg.traj == i
        assert np.array_equal(tg.position[sel], np.arange(1, len(t)))
        assert np.array_equal(tg.label[sel], t.tokens[1:])
        # the serving row holds token p-1 at depth p-1
        assert np.array_equal(forest.token_ids[tg.row[sel]], t.tokens[:-1])
        assert np.array_equal(forest.row_position[tg.row[sel]], np.arange(len(t) - 1))
        assert np.array_equal(tg.weight[sel], t.loss_mask[1:].astype(float))
        assert np.array_equal(tg.advantage[sel], t.advantage[1:])
        assert np.array_equal(tg.old_logprob[sel], t.old_logprobs[1:])


def test_fork_shapes_by_hand():
    T = Trajectory.make
    trajs = [
        T("long", "g", [1, 2, 3, 4, 5]),
        T("fork", "g", [1, 2, 3, 9]),
        T("prefix", "g", [1, 2]),
        T("dup", "g", [1, 2]),
        T("root-fork", "g", [7, 8]),
        T("other-group", "h", [1, 2, 3]),
    ]
    f = build_forest(trajs)
    assert f.compact_tokens == 2 + 1 + 2 + 1 + 2 + 3
    assert f.num_nodes == 6
    assert len(f.roots) == 3
    by_id = dict(zip(f.traj_ids, f.traj_node.tolist(), strict=True))
    assert by_id["prefix"] == by_id["dup"]
    assert f.node_occurrence[by_id["prefix"]] == 4
    assert f.stats()["forks"] == 2


def test_duplicate_ids_and_mixed_ref_are_refused():
    T = Trajectory.make
    with pytest.raises(ValueError, match="duplicate trajectory id 'a'"):
        build_forest([T("a", "g", [1]), T("a", "g", [2])])
    with pytest.raises(ValueError, match="ref_logprobs"):
        build_forest([T("a", "g", [1, 2], ref_logprobs=[0.0, 0.0]), T("b", "g", [2])])
    with pytest.raises(ValueError, match="no trajectories"):
        build_forest([])
