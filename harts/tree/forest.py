"""The rollout forest: one radix tree per group, laid out once in DFS preorder.

Legend: N nodes, R compact rows (= compact tokens), M trajectories, X expanded positions.

Nodes are fork-free segments: maximal runs of positions shared by the same set of
trajectories. Node ids are DFS preorder (a parent precedes its children, and a subtree is
a contiguous id range), and compact rows follow the same order, so the ancestor mask of
full attention is an interval test: row q attends row k iff `k <= q <= row_end[k]`.

Everything heavy is derived lazily from a handful of node arrays, so a structure-only
forest (no token ids: what the planners and the simulator need for steps of tens of
millions of expanded tokens) costs O(nodes + trajectories) memory, while execution-sized
forests also carry their compact token ids and the per-trajectory payload that makes
`expand(build(trajectories))` exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from harts.tree.trajectory import Trajectory


@dataclass(frozen=True, eq=False)
class Payload:
    """Per-trajectory training arrays, concatenated in trajectory order (X positions)."""

    offsets: np.ndarray  # int64 [M+1]
    loss_mask: np.ndarray  # bool [X]
    advantage: np.ndarray  # float64 [X]
    old_logprobs: np.ndarray  # float64 [X]
    ref_logprobs: np.ndarray | None  # float64 [X]
    extra: tuple[dict, ...]  # [M]
    turns: tuple = ()  # [M] each trajectory's step structure (tuple of Turn, or None); () if not kept


@dataclass(frozen=True, eq=False)
class Targets:
    """The expanded target list: one entry per (trajectory, position p >= 1).

    The logits of compact row `row` (the row of position p-1 on the trajectory's path)
    serve the label `label` = token p. A row at a fork serves several distinct labels.
    """

    row: np.ndarray  # int64 [X - M]
    label: np.ndarray  # int64
    traj: np.ndarray  # int64
    position: np.ndarray  # int64
    weight: np.ndarray  # float64: the loss mask of position p
    advantage: np.ndarray  # float64
    old_logprob: np.ndarray  # float64
    ref_logprob: np.ndarray | None  # float64

    def __len__(self) -> int:
        return int(self.row.size)


@dataclass(frozen=True, eq=False)
class RolloutForest:
    node_parent: np.ndarray  # int64 [N], -1 at a root
    node_start: np.ndarray  # int64 [N], first depth (position) of the segment
    node_end: np.ndarray  # int64 [N], one past the last depth
    node_group: np.ndarray  # int64 [N], index into `groups`
    groups: tuple[str, ...]
    traj_ids: tuple[str, ...]  # [M], input order
    traj_node: np.ndarray  # int64 [M], node where the trajectory ends
    token_ids: np.ndarray | None = None  # int64 [R], compact layout
    payload: Payload | None = None

    # ---- sizes ------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return int(self.node_parent.size)

    @property
    def num_trajectories(self) -> int:
        return int(self.traj_node.size)

    @cached_property
    def node_length(self) -> np.ndarray:
        return self.node_end - self.node_start

    @cached_property
    def node_row_start(self) -> np.ndarray:
        starts = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(self.node_length, out=starts[1:])
        return starts

    @property
    def num_rows(self) -> int:
        return int(self.node_row_start[-1])

    @cached_property
    def traj_length(self) -> np.ndarray:
        return self.node_end[self.traj_node]

    @cached_property
    def traj_group(self) -> np.ndarray:
        return self.node_group[self.traj_node]

    @property
    def expanded_tokens(self) -> int:
        return int(self.traj_length.sum())

    @property
    def compact_tokens(self) -> int:
        return self.num_rows

    @property
    def compression(self) -> float:
        return self.expanded_tokens / max(1, self.compact_tokens)

    # ---- node structure ---------------------------------------------------------------

    @cached_property
    def node_subtree_end(self) -> np.ndarray:
        """Last node id of each node's subtree (preorder makes subtrees contiguous)."""
        end = np.arange(self.num_nodes, dtype=np.int64)
        parent = self.node_parent
        # A reverse sweep: children have larger ids than parents. Plain Python over nodes
        # (not tokens); numpy has no segmented "max into parent" that respects the order.
        end_list = end.tolist()
        par_list = parent.tolist()
        for v in range(self.num_nodes - 1, -1, -1):
            p = par_list[v]
            if p >= 0 and end_list[v] > end_list[p]:
                end_list[p] = end_list[v]
        return np.asarray(end_list, dtype=np.int64)

    @cached_property
    def node_occurrence(self) -> np.ndarray:
        """Number of trajectories whose sequence contains the node (q_r of its rows)."""
        ends_here = np.bincount(self.traj_node, minlength=self.num_nodes)
        csum = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(ends_here, out=csum[1:])
        return csum[self.node_subtree_end + 1] - csum[:-1]

    @cached_property
    def node_children(self) -> list[np.ndarray]:
        order = np.argsort(self.node_parent, kind="stable")
        parents = self.node_parent[order]
        split = np.searchsorted(parents, np.arange(-1, self.num_nodes + 1))
        return [order[split[v + 1] : split[v + 2]] for v in range(self.num_nodes)]

    @cached_property
    def node_num_children(self) -> np.ndarray:
        valid = self.node_parent[self.node_parent >= 0]
        return np.bincount(valid, minlength=self.num_nodes)

    @cached_property
    def node_level(self) -> np.ndarray:
        """Number of ancestors of each node (0 at a root)."""
        # parents precede children in preorder, so one forward pass suffices
        lv = [0] * self.num_nodes
        for v, p in enumerate(self.node_parent.tolist()):
            if p >= 0:
                lv[v] = lv[p] + 1
        return np.asarray(lv, dtype=np.int64)

    @cached_property
    def roots(self) -> np.ndarray:
        return np.flatnonzero(self.node_parent < 0)

    # ---- compact rows -----------------------------------------------------------------

    @cached_property
    def row_node(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_nodes, dtype=np.int64), self.node_length)

    @cached_property
    def row_position(self) -> np.ndarray:
        """Position id of each compact row: its depth, the same in every trajectory."""
        within = np.arange(self.num_rows, dtype=np.int64) - self.node_row_start[self.row_node]
        return self.node_start[self.row_node] + within

    @cached_property
    def row_end(self) -> np.ndarray:
        """Last row of each row's subtree: row q attends row k iff k <= q <= row_end[k]."""
        last_row_of_subtree = self.node_row_start[self.node_subtree_end + 1] - 1
        return last_row_of_subtree[self.row_node]

    @cached_property
    def row_parent(self) -> np.ndarray:
        """Previous row along the path (-1 at the first row of a root)."""
        parent = np.arange(-1, self.num_rows - 1, dtype=np.int64)
        first = self.node_row_start[:-1]
        par = self.node_parent
        parent[first] = np.where(par >= 0, self.node_row_start[np.maximum(par, 0) + 1] - 1, -1)
        return parent

    @cached_property
    def row_occurrence(self) -> np.ndarray:
        return self.node_occurrence[self.row_node]

    # ---- trajectories -----------------------------------------------------------------

    @cached_property
    def traj_offsets(self) -> np.ndarray:
        off = np.zeros(self.num_trajectories + 1, dtype=np.int64)
        np.cumsum(self.traj_length, out=off[1:])
        return off

    def traj_paths(self) -> list[np.ndarray]:
        """Node ids from the root to the terminal node, per trajectory."""
        parent = self.node_parent.tolist()
        cache: dict[int, list[int]] = {}
        out = []
        for t in self.traj_node.tolist():
            if t not in cache:
                path = []
                v = t
                while v >= 0:
                    path.append(v)
                    v = parent[v]
                cache[t] = path[::-1]
            out.append(np.asarray(cache[t], dtype=np.int64))
        return out

    @cached_property
    def traj_rows(self) -> np.ndarray:
        """Expanded -> compact map: row of position p of trajectory i is
        `traj_rows[traj_offsets[i] + p]`."""
        paths = self.traj_paths()
        if not paths:
            return np.zeros(0, dtype=np.int64)
        nodes = np.concatenate(paths)
        lengths = self.node_length[nodes]
        total = int(lengths.sum())
        # ragged arange: for each node segment, rows row_start .. row_start + len
        seg_first = np.zeros(nodes.size, dtype=np.int64)
        np.cumsum(lengths[:-1], out=seg_first[1:])
        base = np.repeat(self.node_row_start[nodes] - seg_first, lengths)
        return base + np.arange(total, dtype=np.int64)

    def targets(self) -> Targets:
        """The expanded target list (needs the payload, i.e. a forest built from tokens)."""
        if self.payload is None or self.token_ids is None:
            raise ValueError("targets need a forest built from trajectories (tokens and payload)")
        rows = self.traj_rows
        off = self.traj_offsets
        keep = np.ones(rows.size, dtype=bool)
        keep[off[:-1]] = False  # position 0 of each trajectory is never a target
        pos_idx = np.flatnonzero(keep)
        traj = np.repeat(np.arange(self.num_trajectories, dtype=np.int64), self.traj_length)
        pl = self.payload
        return Targets(
            row=rows[pos_idx - 1],
            label=self.token_ids[rows[pos_idx]],
            traj=traj[pos_idx],
            position=pos_idx - off[traj[pos_idx]],
            weight=pl.loss_mask[pos_idx].astype(np.float64),
            advantage=pl.advantage[pos_idx],
            old_logprob=pl.old_logprobs[pos_idx],
            ref_logprob=None if pl.ref_logprobs is None else pl.ref_logprobs[pos_idx],
        )

    def expand(self) -> list[Trajectory]:
        """Rebuild the input trajectories exactly (tokens come from the compact layout)."""
        if self.payload is None or self.token_ids is None:
            raise ValueError("expand needs a forest built from trajectories")
        rows, off, pl = self.traj_rows, self.traj_offsets, self.payload
        out = []
        for i, tid in enumerate(self.traj_ids):
            a, b = int(off[i]), int(off[i + 1])
            out.append(
                Trajectory(
                    id=tid,
                    group=self.groups[int(self.traj_group[i])],
                    tokens=self.token_ids[rows[a:b]],
                    loss_mask=pl.loss_mask[a:b].copy(),
                    advantage=pl.advantage[a:b].copy(),
                    old_logprobs=pl.old_logprobs[a:b].copy(),
                    ref_logprobs=None if pl.ref_logprobs is None else pl.ref_logprobs[a:b].copy(),
                    extra=dict(pl.extra[i]),
                    turns=pl.turns[i] if pl.turns else None,
                )
            )
        return out

    # ---- statistics -------------------------------------------------------------------

    def stats(self) -> dict:
        forks = int((self.node_num_children > 1).sum())
        root_forks = int(
            sum(1 for g in range(len(self.groups)) if (self.node_group[self.roots] == g).sum() > 1)
        )
        return {
            "groups": len(self.groups),
            "trajectories": self.num_trajectories,
            "expanded_tokens": self.expanded_tokens,
            "compact_tokens": self.compact_tokens,
            "compression": self.compression,
            "nodes": self.num_nodes,
            "max_depth": int(self.traj_length.max()) if self.num_trajectories else 0,
            "max_node_levels": int(self.node_level.max()) + 1 if self.num_nodes else 0,
            "forks": forks + root_forks,
            "mean_trajectory_tokens": float(self.traj_length.mean()) if self.num_trajectories else 0.0,
        }

    def validate(self) -> None:
        """Check the structural invariants; raises ValueError naming the first broken one."""
        n = self.num_nodes
        par = self.node_parent
        if not (par < np.arange(n)).all():
            raise ValueError("node_parent: parents must precede children (DFS preorder)")
        if (self.node_length <= 0).any():
            raise ValueError("node lengths must be positive")
        has_par = par >= 0
        if not np.array_equal(self.node_start[has_par], self.node_end[par[has_par]]):
            raise ValueError("a child must start where its parent ends")
        if (self.node_start[~has_par] != 0).any():
            raise ValueError("roots must start at depth 0")
        sub_end = self.node_subtree_end
        # preorder: the node after v's subtree is not inside v's subtree
        if n and not (sub_end >= np.arange(n)).all():
            raise ValueError("subtree ranges are broken")
        if self.token_ids is not None and self.token_ids.size != self.num_rows:
            raise ValueError("token_ids must have one entry per compact row")
