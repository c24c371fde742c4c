"""The parallel layout of a step: DP replicas x PP stages x TP ranks, EP carved out of each
stage's DP group. Rank placement and the stage split of the simulator live in
`harts.sim.parallel`; the torch.distributed mesh of a run in `harts.distributed.mesh` (ranks laid
out as pp x dp x tp, tp innermost)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DIMS", "ParallelConfig", "ParallelizeConfig", "parse_degrees"]

DIMS = ("dp", "pp", "ep", "tp")


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


def parse_degrees(text: str) -> dict[str, int]:
    """The degrees a `--parallel` spec names ("dp=2,pp=2" -> {"dp": 2, "pp": 2}); a bad part
    raises ValueError of one line, quoting the spec."""
    degrees: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in DIMS:
            raise ValueError(f"--parallel {text!r}: each part is NAME=N with NAME one of {', '.join(DIMS)}")
        if name in degrees:
            raise ValueError(f"--parallel {text!r}: {name} given twice")
        try:
            degrees[name] = int(value)
        except ValueError:
            raise ValueError(f"--parallel {text!r}: {name}={value.strip()!r} is not an integer") from None
        if degrees[name] < 1:
            raise ValueError(f"--parallel {text!r}: {name} must be >= 1")
    return degrees


@dataclass(frozen=True)
class ParallelizeConfig:
    """How `harts.distributed.parallelize.parallelize` lays a model over a mesh (the degrees
    are the mesh's `ParallelConfig`)."""

    # tp > 1: the residual stream row-sharded over TP between the mixers and FFNs
    sequence_parallel: bool = True
