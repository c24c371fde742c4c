"""Model FLOPs of one training step, tree vs expanded: the FLOP-compression limit.

The token-compression ratio (expanded tokens over compact rows plus KDA replay tokens)
bounds the speedup of every per-token op (projections, experts, KDA, the LM head), but
attention compresses less: a compact row deep in a tree attends as many keys as the
trajectory token it stands for, so attended pairs shrink by less than rows do. The
FLOP-compression limit here is the ratio of matrix-product FLOPs (GEMMs of every layer,
forward + backward, counted by `harts.sim.ops.StageCounter` on one GPU, with or without
the recomputed forward) plus attention FLOPs (attended pairs x heads x 2 x (qk + v) dims, forward,
and 2.5x that backward), expanded over tree. KDA's chunkwise FLOPs scale with its tokens
(the token ratio, up to replay) and are left out, stated so in the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.config.models import ModelConfig
from harts.sim.ops import OpKind, Phase, StageCounter
from harts.sim.parallel import default_parallel, stage_layers
from harts.sim.work import MicrobatchWork, chain_pairs
from harts.tree.forest import RolloutForest

__all__ = ["StepFlops", "step_flops", "flop_limit"]

ATTENTION_BWD_OVER_FWD = 2.5  # flash-attention backward: 5 tile products against 2


@dataclass(frozen=True)
class StepFlops:
    gemm: float
    attention: float

    @property
    def total(self) -> float:
        return self.gemm + self.attention


def _flops(model: ModelConfig, work: MicrobatchWork, recompute: bool) -> StepFlops:
    par = default_parallel(model, 1)
    counter = StageCounter(model, par, stage_layers(model, 1)[0], gpus_per_node=8, recompute=recompute)
    gemm = attn = 0.0
    for phase in (Phase.FWD, Phase.BWD):
        for op, count in counter.pass_op_counts(phase, [work]):
            if op.kind == OpKind.GEMM:
                gemm += op.flops * count
            elif op.kind in (OpKind.ATTENTION_CAUSAL, OpKind.ATTENTION_TREE):
                f = op.pair_heads * 2.0 * op.qk_v_dim
                attn += (f if phase == Phase.FWD else ATTENTION_BWD_OVER_FWD * f) * count
    return StepFlops(gemm, attn)


def step_flops(forest: RolloutForest, model: ModelConfig, mode: str, recompute: bool = True) -> StepFlops:
    """FLOPs of one step over the whole forest, 'tree' (compact rows, ancestor pairs) or
    'expanded' (every trajectory token, causal pairs), as one microbatch."""
    if mode == "tree":
        pairs = int((forest.row_end.astype(np.int64) - np.arange(forest.num_rows) + 1).sum())
        work = MicrobatchWork(mb=0, replica=0, tokens=int(forest.num_rows), kda_rounds=(),
                              attn_pairs_causal=0, attn_pairs_tree=pairs)
    elif mode == "expanded":
        lengths = forest.traj_length.astype(np.int64)
        total = int(lengths.sum())
        work = MicrobatchWork(mb=0, replica=0, tokens=total, kda_rounds=(),
                              attn_pairs_causal=chain_pairs(lengths))
    else:
        raise ValueError(f"mode must be 'tree' or 'expanded', got {mode!r}")
    return _flops(model, work, recompute)


def flop_limit(forest: RolloutForest, model: ModelConfig, recompute: bool = True) -> dict[str, float]:
    """{'flop_limit', 'gemm_ratio', 'attention_ratio', 'attention_share_expanded'};
    `recompute` counts the backward's re-run forward (what the benchmarked steps execute)."""
    tree = step_flops(forest, model, "tree", recompute)
    exp = step_flops(forest, model, "expanded", recompute)
    return {
        "flop_limit": exp.total / tree.total,
        "gemm_ratio": exp.gemm / tree.gemm,
        "attention_ratio": exp.attention / tree.attention if tree.attention else float("nan"),
        "attention_share_expanded": exp.attention / exp.total,
    }
