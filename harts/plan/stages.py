"""Pipeline stages of a model: which layers each of `pp` stages runs (contiguous, as even as
possible; the embedding on stage 0, the LM head on the last), with the counts of each
layer kind. The one split both the simulator prices (`harts.sim.ops`, `harts.sim.costs`) and
the pipeline executor builds (`harts.distributed.pipeline`)."""

from __future__ import annotations

from dataclasses import dataclass

from harts.config.models import FFNKind, LayerKind, ModelConfig

__all__ = ["StageLayers", "stage_layers"]


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
