"""The parallel layout of a step: DP replicas x PP stages, EP carved out of each stage's DP
group (TP = 1). Rank placement and the stage split live in `harts.sim.parallel`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel config: {name} must be >= 1")
        if self.dp % self.ep:
            raise ValueError(f"parallel config: ep={self.ep} must divide dp={self.dp}")

    @property
    def gpus(self) -> int:
        return self.dp * self.pp

    def dp_spans_nodes(self, gpus_per_node: int) -> bool:
        return self.dp > gpus_per_node

    def ep_spans_nodes(self, gpus_per_node: int) -> bool:
        return self.ep > gpus_per_node

    def pp_spans_nodes(self, gpus_per_node: int) -> bool:
        return self.pp > 1 and self.dp * self.pp > gpus_per_node

    def describe(self) -> str:
        return f"DP{self.dp}/PP{self.pp}/EP{self.ep}"
