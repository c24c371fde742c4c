"""Exact execution over a rollout tree's compact layout: the tree `MixingContext`.

Legend: R compact rows, H heads, K/V/D/E feature dims, W conv window, S KDA sequences.

The model runs token-wise work once per compact row; this context supplies the three
places where rows see each other, each restricted to a row's own root path:

- full attention: one masked attention over the compact rows with the DFS interval mask
  `k <= q <= row_end[k]` (ancestor-or-self). On CPU a dense boolean mask; the GPU fast
  path plugs in behind `attention` with the same contract.
- short convolution: a row's window is its previous W-1 rows along its path, gathered
  through parent pointers (so windows cross forks correctly).
- KDA: the rounds of a `KDASchedule`. Each round is ONE packed varlen chunkwise call.
  A sequence gathers its replay rows (ancestor tokens [a, s_v1), state only) and its own
  rows; only its own rows' outputs are kept. Its initial state is a boundary state that
  an earlier round's call returned (still in the autograd graph, so gradients flow back
  into the producer) or zeros. Every row's output is written by exactly one sequence; the
  outputs of all rounds are concatenated and put back in row order with one gather.

Two schedules: `replay` (the minimum-call plan of harts.plan.kda_calls: sequences start
at chunk-aligned positions, so each trajectory's chunk grid is reproduced and handoffs
are bit-exact) and `node` (the no-replay ablation: every node is its own sequence,
starting mid-chunk at its fork from its parent's final state; fewer tokens, different
rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from harts.plan.kda_calls import KDACallPlan, plan_kda_calls_for
from harts.tree.forest import RolloutForest


@dataclass(frozen=True)
class KDARound:
    """One packed call: which rows go in, which outputs come out, where states come from."""

    gather_rows: np.ndarray  # int64 [Tr]: compact rows, sequence after sequence
    cu_seqlens: np.ndarray  # int64 [Sr + 1]
    keep: np.ndarray  # int64: positions in gather_rows whose outputs are written
    # per sequence: (round, index into that round's handed-off states) or (-1, -1) = zeros
    init_round: np.ndarray  # int64 [Sr]
    init_index: np.ndarray  # int64 [Sr]


@dataclass(frozen=True)
class KDASchedule:
    mode: str  # "replay" | "node"
    chunk_size: int
    rounds: tuple[KDARound, ...]
    # states handed to later rounds come from chunk boundaries ("replay") or from each
    # sequence's final state ("node")
    handoff: str  # "chunk" | "final"
    replay_tokens: int
    written_rows: np.ndarray  # int64 [R]: rows in the order the rounds write them

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)


def _replay_rows(forest: RolloutForest, first_row: int, count: int) -> list[int]:
    rows = []
    r = first_row
    parent = forest.row_parent
    for _ in range(count):
        r = int(parent[r])
        rows.append(r)
    return rows[::-1]


def replay_schedule(forest: RolloutForest, chunk_size: int = 64, plan: KDACallPlan | None = None) -> KDASchedule:
    """Rounds of the minimum-call plan, as gather/scatter indices over compact rows."""
    plan = plan if plan is not None else plan_kda_calls_for(forest, chunk_size)
    B = plan.chunk_size
    rs = forest.node_row_start
    # where each sequence's boundary states land in its round's chunk_states tensor
    state_base: dict[int, tuple[int, int]] = {}
    rounds = []
    written = []
    for r, seqs in enumerate(plan.rounds):
        gather, cu, keep, init_r, init_i = [], [0], [], [], []
        num_states = 0
        for s in seqs.tolist():
            head = int(plan.seq_head[s])
            replay = int(plan.seq_replay[s])
            own = np.concatenate([np.arange(rs[v], rs[v + 1]) for v in plan.chain(s).tolist()])
            rows = _replay_rows(forest, int(rs[head]), replay) + own.tolist()
            base = len(gather)
            gather.extend(rows)
            keep.extend(range(base + replay, base + len(rows)))
            written.append(own)
            cu.append(len(gather))
            state_base[s] = (r, num_states)
            num_states += len(rows) // B
            p = int(plan.seq_producer[s])
            if p < 0:
                init_r.append(-1)
                init_i.append(-1)
            else:
                pr, pbase = state_base[p]
                offset = (int(plan.seq_start[s]) - int(plan.seq_start[p])) // B - 1
                init_r.append(pr)
                init_i.append(pbase + offset)
        rounds.append(
            KDARound(
                np.asarray(gather, np.int64), np.asarray(cu, np.int64), np.asarray(keep, np.int64),
                np.asarray(init_r, np.int64), np.asarray(init_i, np.int64),
            )
        )
    return KDASchedule("replay", B, tuple(rounds), "chunk", int(plan.replay_tokens),
                       np.concatenate(written) if written else np.zeros(0, np.int64))


def node_schedule(forest: RolloutForest, chunk_size: int = 64) -> KDASchedule:
    """The no-replay ablation: one sequence per node, started from its parent's final state."""
    level = forest.node_level
    rs = forest.node_row_start
    rounds = []
    written = []
    index_in_round: dict[int, int] = {}
    for lv in range(int(level.max()) + 1 if forest.num_nodes else 0):
        nodes = np.flatnonzero(level == lv)
        gather, cu, init_r, init_i = [], [0], [], []
        for i, v in enumerate(nodes.tolist()):
            gather.extend(range(int(rs[v]), int(rs[v + 1])))
            cu.append(len(gather))
            index_in_round[v] = i
            p = int(forest.node_parent[v])
            init_r.append(-1 if p < 0 else lv - 1)
            init_i.append(-1 if p < 0 else index_in_round[p])
        g = np.asarray(gather, np.int64)
        written.append(g)
        rounds.append(KDARound(g, np.asarray(cu, np.int64), np.arange(g.size, dtype=np.int64),
                               np.asarray(init_r, np.int64), np.asarray(init_i, np.int64)))
    return KDASchedule("node", chunk_size, tuple(rounds), "final", 0,
                       np.concatenate(written) if written else np.zeros(0, np.int64))


class TreeContext:
    """`MixingContext` over the compact layout of a forest (one microbatch of whole trees)."""

    allows_token_dropping = False

    def __init__(self, forest: RolloutForest, *, chunk_size: int = 64, kda_mode: str = "replay",
                 device: torch.device | str = "cpu"):
        if kda_mode not in ("replay", "node"):
            raise ValueError(f"kda_mode must be 'replay' or 'node', got {kda_mode!r}")
        self.forest = forest
        self.num_rows = forest.num_rows
        self.chunk_size = chunk_size
        dev = torch.device(device)
        self.device = dev
        self.row_weight = torch.as_tensor(forest.row_occurrence, dtype=torch.float64, device=dev)
        self.position_ids = torch.as_tensor(forest.row_position, dtype=torch.int64, device=dev)
        self.row_parent = torch.as_tensor(forest.row_parent, dtype=torch.int64, device=dev)
        row_end = torch.as_tensor(forest.row_end, dtype=torch.int64, device=dev)
        idx = torch.arange(self.num_rows, device=dev)
        # [R_q, R_k]: k is an ancestor-or-self of q
        self.attn_mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] <= row_end[None, :])
        self.schedule = (replay_schedule(forest, chunk_size) if kda_mode == "replay"
                         else node_schedule(forest, chunk_size))
        self._rounds = [
            (torch.as_tensor(r.gather_rows, device=dev), torch.as_tensor(r.cu_seqlens, device=dev),
             torch.as_tensor(r.keep, device=dev), r.init_round.tolist(), r.init_index.tolist())
            for r in self.schedule.rounds
        ]
        inverse = np.empty(self.num_rows, dtype=np.int64)
        inverse[self.schedule.written_rows] = np.arange(self.num_rows)
        if not np.array_equal(np.sort(self.schedule.written_rows), np.arange(self.num_rows)):
            raise AssertionError("KDA schedule must write every row exactly once")
        self._unpermute = torch.as_tensor(inverse, device=dev)
        self._windows: dict[int, Tensor] = {}

    @property
    def kda_rounds(self) -> int:
        return self.schedule.num_rounds

    @property
    def replay_tokens(self) -> int:
        return self.schedule.replay_tokens

    def attention(self, layer: int, q_THD: Tensor, k_THD: Tensor, v_THE: Tensor, scale: float) -> Tensor:
        q, k, v = (x.transpose(0, 1) for x in (q_THD, k_THD, v_THE))
        o_HTE = F.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask, scale=scale)
        return o_HTE.transpose(0, 1)

    def short_conv(self, layer: int, name: str, x_TD: Tensor, weight_DW: Tensor, bias_D: Tensor | None) -> Tensor:
        from harts.exec.ops.conv import short_conv, window_from_parents

        W = weight_DW.shape[1]
        if W not in self._windows:
            self._windows[W] = window_from_parents(self.row_parent, W)
        return short_conv(x_TD, weight_DW, bias_D, window_TW=self._windows[W], activation="silu")

    def kda(self, layer: int, q_THK: Tensor, k_THK: Tensor, v_THV: Tensor, g_THK: Tensor,
            beta_TH: Tensor, scale: float) -> Tensor:
        from harts.exec.ops.kda import chunk_kda

        H, K, V = q_THK.shape[1], q_THK.shape[2], v_THV.shape[2]
        handed: list[Tensor] = []  # per round: the states later rounds may start from
        outputs: list[Tensor] = []
        chunk = self.schedule.handoff == "chunk"
        for gather, cu, keep, init_round, init_index in self._rounds:
            if all(r < 0 for r in init_round):
                h0 = None
            else:
                ref = handed[next(r for r in init_round if r >= 0)]
                zero = ref.new_zeros(H, K, V)
                h0 = torch.stack([zero if r < 0 else handed[r][i] for r, i in zip(init_round, init_index, strict=True)])
            out = chunk_kda(
                q_THK[gather], k_THK[gather], v_THV[gather], g_THK[gather], beta_TH[gather],
                scale=scale, initial_state=h0, cu_seqlens=cu, chunk_size=self.chunk_size,
                output_final_state=not chunk, output_chunk_states=chunk,
            )
            handed.append(out.chunk_states if chunk else out.final_state)
            outputs.append(out.o[keep])
        return torch.cat(outputs, dim=0)[self._unpermute]
