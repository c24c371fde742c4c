"""The parallel layout of a step: DP replicas x PP stages x TP ranks, EP carved out of each
stage's DP group. Rank placement and the stage split of the simulator live in
`harts.sim.parallel`; the torch.distributed mesh of a run in `harts.distributed.mesh` (ranks laid
out as pp x dp x tp, tp innermost)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "ep", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel config: {name} must be >= 1")
        if self.dp % self.ep:
            raise ValueError(f"parallel config: ep={self.ep} must divide dp={self.dp}")

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def world_size(self) -> int:
        """Ranks of the mesh: dp x pp x tp (EP reuses the DP ranks)."""
        return self.dp * self.pp * self.tp

    def dp_spans_nodes(self, gpus_per_node: int) -> bool:
        return self.dp > gpus_per_node

    def ep_spans_nodes(self, gpus_per_node: int) -> bool:
        return self.ep > gpus_per_node

    def pp_spans_nodes(self, gpus_per_node: int) -> bool:
        return self.pp > 1 and self.dp * self.pp > gpus_per_node

    def describe(self) -> str:
        return f"DP{self.dp}/PP{self.pp}/EP{self.ep}" + (f"/TP{self.tp}" if self.tp > 1 else "")

    def spec(self) -> str:
        """The `--parallel` form: dp=2,pp=1,ep=2,tp=1."""
        return f"dp={self.dp},pp={self.pp},ep={self.ep},tp={self.tp}"
