"""Work of one training step, tree vs expanded: the FLOP ratio and the ideal speedup.

The token-compression ratio (expanded tokens over compact rows plus KDA replay tokens)
bounds the speedup of every per-token op (projections, experts, KDA, the LM head), but
attention compresses less: a compact row deep in a tree attends as many keys as the
trajectory token it stands for, so attended pairs shrink by less than rows do. The
FLOP ratio here is the ratio of matrix-product FLOPs (GEMMs of every layer,
forward + backward, counted by `harts.sim.ops.StageCounter` on one GPU, with or without
the recomputed forward) plus attention FLOPs (attended pairs x heads x 2 x (qk + v) dims, forward,
and 2.5x that backward), expanded over tree. KDA's chunkwise FLOPs scale with its tokens
(the token ratio, up to replay) and are left out, stated so in the output. The FLOP
ratio is a summary of work, not a ceiling: KDA, replay, elementwise work, gathers and the
optimizer are not in it, and a measured speedup can exceed it.

The ideal speedup (`ideal_speedup`): every op's expanded time
(measured per op on the GPU, or the simulator's per-op prices) scaled by the ratio of its
own work, tree over expanded (`WorkKind`: rows for token-wise ops, attended pairs for
attention, executed KDA tokens with replay, sequential chunk steps for the recurrence,
kernel launches for fixed per-call costs, parameters for the optimizer). A tree op that
costs at least its share of work at the expanded step's price keeps the speedup at or below
it, so the simulator, whose prices are per unit of work, never exceeds it (`simulated_ideal`,
tests/sim/test_ideal.py). It is no bound on a measured step: a GPU kernel can do a unit of
work more cheaply at the tree's shapes than at the baseline's, and the H200's step-wise
step has measured 1.01-1.03x of it (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from harts.config.models import ModelConfig
from harts.config.param_counts import parameter_counts
from harts.plan.stages import stage_layers
from harts.plan.work import (
    KDARound,
    MicrobatchWork,
    chain_pairs,
    expanded_microbatch,
    segment_pairs,
)
from harts.sim.ops import OpCall, OpKind, Phase, StageCounter
from harts.sim.parallel import default_parallel
from harts.tree.forest import RolloutForest

__all__ = ["IdealSpeedup", "StepFlops", "WorkKind", "flop_ratio", "ideal_speedup", "simulated_ideal",
           "simulated_op_seconds", "step_flops", "step_work", "work_counts"]

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


def flop_ratio(forest: RolloutForest, model: ModelConfig, recompute: bool = True) -> dict[str, float]:
    """{'flop_ratio', 'gemm_ratio', 'attention_ratio', 'attention_share_expanded'};
    `recompute` counts the backward's re-run forward (what the benchmarked steps execute)."""
    tree = step_flops(forest, model, "tree", recompute)
    exp = step_flops(forest, model, "expanded", recompute)
    return {
        "flop_ratio": exp.total / tree.total,
        "gemm_ratio": exp.gemm / tree.gemm,
        "attention_ratio": exp.attention / tree.attention if tree.attention else float("nan"),
        "attention_share_expanded": exp.attention / exp.total,
    }


# ---------------------------------------------------------------------------- the ideal


class WorkKind(StrEnum):
    """What an op's time scales with, for the ideal speedup (`ideal_speedup`)."""

    TOKENS = "tokens"  # token-wise ops (projections, norms, experts, conv, LM head): computed rows
    ATTENTION_PAIRS = "attention_pairs"  # attention: attended (query, key) pairs
    KDA_TOKENS = "kda_tokens"  # the chunkwise KDA kernels: executed KDA tokens, replay included
    KDA_CHUNK_STEPS = "kda_chunk_steps"  # the KDA state recurrence: sequential chunk steps
    KERNEL_CALLS = "kernel_calls"  # fixed per-launch cost: kernel launches
    PARAMETERS = "parameters"  # the optimizer and gradient clipping: parameters


@dataclass(frozen=True)
class IdealSpeedup:
    """The ideal speedup of a step and what it is made of.

    `ideal` = T / sum_k T_k * (tree work_k / expanded work_k), with T_k the expanded step's
    time in the ops whose time scales with work kind k and T their sum: the speedup the
    tree step reaches if every op costs the tree exactly its share of work at the expanded
    step's measured per-unit price. An op that costs the tree at least that share (a fixed
    part per call, a tree-mask attention that is dearer per pair than causal attention, the
    same launches over fewer rows) keeps the tree step's speedup at or below it; an op
    that runs a unit of work more cheaply at the tree's shapes takes it above (measured
    on the GPU's step-wise step), so it is a yardstick, not a bound."""

    ideal: float
    expanded_seconds: tuple[tuple[WorkKind, float], ...]  # T_k
    work_ratio: tuple[tuple[WorkKind, float], ...]  # tree work_k / expanded work_k

    def ideal_tree_seconds(self) -> float:
        ratio = dict(self.work_ratio)
        return sum(t * ratio[k] for k, t in self.expanded_seconds)

    def to_dict(self) -> dict[str, object]:
        return {"ideal": self.ideal,
                "expanded_seconds": {k.value: t for k, t in self.expanded_seconds},
                "work_ratio": {k.value: r for k, r in self.work_ratio}}


def ideal_speedup(expanded_seconds: Mapping[WorkKind | str, float], expanded_work: Mapping[WorkKind | str, float],
                  tree_work: Mapping[WorkKind | str, float]) -> IdealSpeedup:
    """The ideal speedup (`IdealSpeedup`) from the expanded step's time per work kind and
    both steps' work per kind. A kind with time but no work count on either side, or zero
    expanded work under positive time, is an error: its ratio would be a guess."""
    secs = {WorkKind(k): float(t) for k, t in expanded_seconds.items()}
    ew = {WorkKind(k): float(w) for k, w in expanded_work.items()}
    tw = {WorkKind(k): float(w) for k, w in tree_work.items()}
    if any(t < 0 for t in secs.values()) or not sum(secs.values()) > 0:
        raise ValueError("expanded per-op seconds must be >= 0 with a positive sum")
    times, ratios = [], []
    for kind in WorkKind:
        t = secs.get(kind, 0.0)
        if t == 0.0:
            continue
        if kind not in ew or kind not in tw:
            raise ValueError(f"{kind.value}: the expanded step spends {t:.3g} s on it but its work count is missing")
        if not ew[kind] > 0 or tw[kind] < 0:
            raise ValueError(f"{kind.value}: expanded work must be > 0 and tree work >= 0 "
                             f"(got {ew[kind]}, {tw[kind]})")
        times.append((kind, t))
        ratios.append((kind, tw[kind] / ew[kind]))
    ideal_tree = sum(t * r for (_, t), (_, r) in zip(times, ratios, strict=True))
    total = sum(t for _, t in times)
    return IdealSpeedup(total / ideal_tree if ideal_tree > 0 else float("inf"), tuple(times), tuple(ratios))


def step_work(forest: RolloutForest, mode: str, chunk_size: int = 64) -> MicrobatchWork:
    """The whole step as one microbatch: 'tree' (compact rows, ancestor pairs, the KDA
    rounds of the minimum-call plan with their replay), 'expanded' (every trajectory
    token, causal pairs, one KDA call over independent sequences) or 'prefix-merged' (the
    expanded layout of the hosts only, `harts.tree.prefix`: every sequence that is a
    prefix of another runs inside it)."""
    if mode == "tree":
        from harts.plan.kda_calls import plan_kda_calls_for

        kp = plan_kda_calls_for(forest, chunk_size)
        seq_tokens = kp.seq_end - kp.seq_start
        seq_chunks = -(-seq_tokens // chunk_size)
        rounds = tuple(KDARound(int(seq_tokens[ids].sum()), int(seq_chunks[ids].max()), int(ids.size))
                       for ids in kp.rounds if ids.size)
        # a row attends its root path (position + 1 rows); a tree without a fork is one
        # causal sequence (as `harts.plan.step` prices it), a tree with one needs the mask
        root = np.arange(forest.num_nodes)
        for v in range(forest.num_nodes):  # preorder: a parent's root is known first
            if forest.node_parent[v] >= 0:
                root[v] = root[forest.node_parent[v]]
        forked = np.zeros(forest.num_nodes, bool)
        forked[np.unique(root[forest.node_num_children > 1])] = True
        node_pairs = segment_pairs(forest.node_start, forest.node_end)
        tree_pairs = int(node_pairs[forked[root]].sum())
        causal_pairs = int(node_pairs.sum()) - tree_pairs
        return MicrobatchWork(mb=0, replica=0, tokens=int(forest.num_rows), kda_rounds=rounds,
                              attn_pairs_causal=causal_pairs, attn_pairs_tree=tree_pairs,
                              expanded_tokens=forest.expanded_tokens)
    if mode == "expanded":
        return expanded_microbatch(0, 0, forest.traj_length.tolist(), chunk_size)
    if mode == "prefix-merged":
        from harts.tree.prefix import forest_host_lengths

        w = expanded_microbatch(0, 0, forest_host_lengths(forest).tolist(), chunk_size)
        return replace(w, expanded_tokens=forest.expanded_tokens)
    raise ValueError(f"mode must be 'tree', 'expanded' or 'prefix-merged', got {mode!r}")


def work_counts(model: ModelConfig, work: MicrobatchWork, recompute: bool = True) -> dict[WorkKind, float]:
    """Work per kind of one step over `work` on one GPU (kernel calls as the simulator's op
    lists count them: forward, backward, optimizer)."""
    counter = _counter(model, recompute)
    calls = sum(op.calls * c for phase in (Phase.FWD, Phase.BWD) for op, c in counter.pass_op_counts(phase, [work]))
    calls += sum(op.calls for op in counter.step_ops())
    return {
        WorkKind.TOKENS: float(work.tokens),
        WorkKind.ATTENTION_PAIRS: float(work.attn_pairs),
        WorkKind.KDA_TOKENS: float(work.kda_tokens),
        WorkKind.KDA_CHUNK_STEPS: float(sum(r.max_chunks for r in work.kda_rounds)),
        WorkKind.KERNEL_CALLS: float(calls),
        WorkKind.PARAMETERS: float(parameter_counts(model).total),
    }


def _counter(model: ModelConfig, recompute: bool) -> StageCounter:
    return StageCounter(model, default_parallel(model, 1), stage_layers(model, 1)[0], gpus_per_node=8,
                        recompute=recompute)


def _split_price(op: OpCall, pricer) -> list[tuple[WorkKind, float]]:
    """An op's simulated seconds split by work kind: its launches (`calls` x the launch
    price) as kernel calls, the rest by what the op scales with (a KDA call by whichever of
    its tokens and its chunk steps sets its price)."""
    total = pricer.seconds(op)
    body = pricer.seconds(replace(op, calls=0))
    parts = [(WorkKind.KERNEL_CALLS, total - body)]
    if op.kind in (OpKind.ATTENTION_CAUSAL, OpKind.ATTENTION_TREE):
        parts.append((WorkKind.ATTENTION_PAIRS, body))
    elif op.kind == OpKind.KDA_CHUNK:
        tokens_only = pricer.seconds(replace(op, calls=0, chunk_steps=0.0))
        parts.append((WorkKind.KDA_TOKENS if tokens_only >= body else WorkKind.KDA_CHUNK_STEPS, body))
    elif op.kind == OpKind.OPTIMIZER:
        parts.append((WorkKind.PARAMETERS, body))
    else:
        parts.append((WorkKind.TOKENS, body))
    return parts


def simulated_op_seconds(model: ModelConfig, work: MicrobatchWork, hardware, recompute: bool = True
                         ) -> dict[WorkKind, float]:
    """The simulator's (roofline) seconds of one step over `work` on one GPU, by work kind:
    forward and backward passes plus the optimizer, the per-op times the ideal is weighted
    with when no measured profile is at hand (CPU tests, `harts sim`)."""
    from harts.sim.costs import RooflinePricer

    pricer = RooflinePricer(hardware)
    counter = _counter(model, recompute)
    out = dict.fromkeys(WorkKind, 0.0)
    ops = [(op, c) for phase in (Phase.FWD, Phase.BWD) for op, c in counter.pass_op_counts(phase, [work])]
    ops += [(op, 1) for op in counter.step_ops()]
    for op, count in ops:
        for kind, t in _split_price(op, pricer):
            out[kind] += t * count
    return out


def simulated_ideal(forest: RolloutForest, model: ModelConfig, hardware, recompute: bool = True,
                    baseline: str = "expanded") -> tuple[IdealSpeedup, float]:
    """(the ideal weighted by the simulator's per-op times of the baseline step, the
    simulator's own speedup of the one-microbatch tree step over the one-microbatch
    baseline step); `baseline` is 'expanded' (packed) or 'prefix-merged'."""
    exp, tree = step_work(forest, baseline, model.chunk_size), step_work(forest, "tree", model.chunk_size)
    exp_secs = simulated_op_seconds(model, exp, hardware, recompute)
    tree_secs = simulated_op_seconds(model, tree, hardware, recompute)
    ideal = ideal_speedup(exp_secs, work_counts(model, exp, recompute), work_counts(model, tree, recompute))
    return ideal, sum(exp_secs.values()) / sum(tree_secs.values())
