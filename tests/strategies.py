"""Hypothesis strategies shared by the test suite (one section per owner; add yours with a
targeted edit, never rewrite the file)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

# KDA call planner (harts/plan/kda_calls.py): small rollout forests whose segment lengths
# put forks on chunk boundaries, inside a chain's first chunk, or mid-chunk further down.


@dataclass(frozen=True)
class KDATreeCase:
    """A forest in DFS preorder plus a chunk size; has the attributes plan_kda_calls_for reads."""

    node_parent: tuple[int, ...]
    node_start: tuple[int, ...]
    node_end: tuple[int, ...]
    chunk_size: int


def kda_tree_from_lengths(
    parents: list[int] | tuple[int, ...], lengths: list[int] | tuple[int, ...], chunk_size: int
) -> KDATreeCase:
    """Build a case from parent ids (parents first) and segment lengths (token counts)."""
    starts: list[int] = []
    ends: list[int] = []
    for p, length in zip(parents, lengths, strict=True):
        s = 0 if p < 0 else ends[p]
        starts.append(s)
        ends.append(s + length)
    return KDATreeCase(tuple(parents), tuple(starts), tuple(ends), chunk_size)


_KDA_SHAPES = ("bushy", "binary", "forest", "chain", "fan", "caterpillar")


@st.composite
def small_kda_trees(
    draw: st.DrawFn, max_nodes: int = 12, chunk_sizes: tuple[int, ...] = (2, 3, 4, 8)
) -> KDATreeCase:
    """Small forests for exhaustive checks of the KDA call planner.

    Shapes: bushy trees (0-3 children per node), full binary trees (the shape that needs
    the most rounds), forests (several roots), deep chains, wide fans (all children of the
    root) and caterpillars (each spine node has a leaf first, then the next spine node, so
    the better continuation is not the first child). Each segment length is drawn to end
    exactly on a chunk boundary, stay inside its chunk, cross one boundary, or be long.
    """
    B = draw(st.sampled_from(chunk_sizes))
    shape = draw(st.sampled_from(_KDA_SHAPES))
    parents: list[int] = []
    if shape in ("bushy", "binary"):
        # Preorder by a stack of open child slots; a slot is only opened if it can be filled.
        slots = [-1]
        while slots:
            p = slots.pop()
            v = len(parents)
            parents.append(p)
            room = max_nodes - len(parents) - len(slots)
            fanout = draw(st.sampled_from((0, 2) if shape == "binary" else (0, 1, 2, 3)))
            if fanout <= room:
                slots.extend([v] * fanout)
    else:
        n = draw(st.integers(1, max_nodes))
        path: list[int] = []
        for v in range(n):
            if v == 0:
                depth = 0
            elif shape == "chain":
                depth = len(path)
            elif shape == "fan":
                depth = 1
            elif shape == "caterpillar":
                depth = len(path) if v % 2 else len(path) - 1
            else:
                depth = draw(st.integers(0, len(path)))
            parents.append(path[depth - 1] if depth else -1)
            del path[depth:]
            path.append(v)
    lengths: list[int] = []
    ends: list[int] = []
    for p in parents:
        s = 0 if p < 0 else ends[p]
        to_boundary = B - s % B
        kind = draw(st.sampled_from(("boundary", "inside", "cross", "long")))
        if kind == "boundary":
            length = to_boundary + B * draw(st.integers(0, 1))
        elif kind == "inside" and to_boundary > 1:
            length = draw(st.integers(1, to_boundary - 1))
        elif kind == "cross" and B > 1:
            length = to_boundary + draw(st.integers(1, B - 1))
        else:
            length = draw(st.integers(1, 3 * B))
        lengths.append(length)
        ends.append(s + length)
    return kda_tree_from_lengths(parents, lengths, B)


# Rollout-tree core (harts/tree): trajectory sets built to share prefixes. Tokens come from
# a tiny alphabet and many trajectories extend earlier ones, so prefixes, duplicates, forks
# at position 0 and forks deep inside segments all appear often.


@st.composite
def trajectory_sets(
    draw: st.DrawFn,
    max_groups: int = 3,
    max_per_group: int = 6,
    max_len: int = 24,
    alphabet: int = 3,
    with_ref: bool | None = None,
):
    import numpy as np

    from harts.tree.trajectory import Trajectory

    num_groups = draw(st.integers(1, max_groups))
    ref = draw(st.booleans()) if with_ref is None else with_ref
    out = []
    for g in range(num_groups):
        seqs: list[list[int]] = []
        for _ in range(draw(st.integers(1, max_per_group))):
            how = draw(st.sampled_from(("fresh", "extend", "prefix", "duplicate")))
            if seqs and how != "fresh":
                base = draw(st.sampled_from(seqs))
                if how == "extend":
                    cut = draw(st.integers(0, len(base)))
                    tail = draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_len // 2))
                    seq = base[:cut] + tail
                elif how == "prefix":
                    seq = base[: draw(st.integers(1, len(base)))]
                else:
                    seq = list(base)
            else:
                seq = draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_len))
            seqs.append(seq[:max_len] or [0])
        for i, seq in enumerate(seqs):
            n = len(seq)
            mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
            mask[0] = False
            scalar = draw(st.booleans())
            floats = st.floats(-5, 5, allow_nan=False, width=32)
            adv = draw(floats) if scalar else draw(st.lists(floats, min_size=n, max_size=n))
            old = draw(st.lists(st.floats(-9, 0, allow_nan=False, width=32), min_size=n, max_size=n))
            refl = (
                draw(st.lists(st.floats(-9, 0, allow_nan=False, width=32), min_size=n, max_size=n))
                if ref
                else None
            )
            out.append(
                Trajectory.make(f"g{g}-t{i}", f"g{g}", np.asarray(seq), np.asarray(mask), adv, old, refl)
            )
    # shuffle across groups so the builder cannot rely on input order
    return draw(st.permutations(out))
