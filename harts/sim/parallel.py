"""Parallel layout of a simulated cluster: DP replicas x PP stages, expert parallelism carved
out of each stage's DP group (Megatron's expert-data-parallel), TP = 1.

Global rank = stage * dp + replica, so a stage's DP (and EP) group is contiguous and stays in
one node while it fits; pipeline neighbours are `dp` ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from harts.config.models import FFNKind, LayerKind, ModelConfig
from harts.config.parallel import ParallelConfig  # noqa: F401  (importers of harts.sim.parallel)

__all__ = ["StageLayers", "default_ep", "default_parallel", "stage_layers"]


def default_parallel(model: ModelConfig, gpus: int) -> ParallelConfig:
    """The layout the simulator uses when none is given (an assumption, stated in the
    JSON output): Tiny pipelines over 2 stages once there are 8 GPUs (the paper's Table 6
    is a PP ablation on Tiny/8), Flash over 4 (124B parameters do not fit fewer stages
    with the optimizer state sharded over DP); EP = DP up to one node."""
    if gpus < 1:
        raise ValueError("gpus must be >= 1")
    if model.num_layers >= 40:
        pp = 4 if gpus >= 16 else (2 if gpus >= 2 and gpus % 2 == 0 else 1)
    else:
        pp = 2 if gpus >= 8 and gpus % 2 == 0 else 1
    dp = gpus // pp
    if dp * pp != gpus:
        raise ValueError(f"{gpus} GPUs do not split into {pp} stages")
    return ParallelConfig(dp=dp, pp=pp, ep=default_ep(model, dp))


def default_ep(model: ModelConfig, dp: int) -> int:
    """The largest power of two that divides DP and the expert count, up to one node (8)."""
    ep = 1
    while ep * 2 <= min(dp, 8) and dp % (ep * 2) == 0 and model.num_experts % (ep * 2) == 0:
        ep *= 2
    return ep


@dataclass(frozen=True)
class StageLayers:
    stage: int
    layers: tuple[int, ...]
    num_kda: int
    num_mla: int
    num_dense_ffn: int
    num_moe: int
    has_embedding: bool
    has_lm_head: bool
    num_gdn: int = 0  # Qwen3-Next's Gated DeltaNet layers
    num_gated_attention: int = 0  # and its gated full-attention layers


def stage_layers(model: ModelConfig, pp: int) -> tuple[StageLayers, ...]:
    """Contiguous, as even as possible; the embedding sits on stage 0, the head on the last."""
    n = model.num_layers
    if pp > n:
        raise ValueError(f"{pp} pipeline stages for {n} layers")
    kinds, ffn = model.layer_kinds, model.ffn_kinds
    out = []
    for s in range(pp):
        lo, hi = s * n // pp, (s + 1) * n // pp
        idx = tuple(range(lo, hi))
        out.append(
            StageLayers(
                stage=s,
                layers=idx,
                num_kda=sum(kinds[i] == LayerKind.KDA for i in idx),
                num_mla=sum(kinds[i] == LayerKind.MLA for i in idx),
                num_dense_ffn=sum(ffn[i] == FFNKind.DENSE for i in idx),
                num_moe=sum(ffn[i] == FFNKind.MOE for i in idx),
                has_embedding=s == 0,
                has_lm_head=s == pp - 1,
                num_gdn=sum(kinds[i] == LayerKind.GDN for i in idx),
                num_gated_attention=sum(kinds[i] == LayerKind.GATED_ATTENTION for i in idx),
            )
        )
    return tuple(out)
