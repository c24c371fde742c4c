"""Load (cost) functions for step planning: what a microbatch costs to run.

A cost model prices *segments*: runs of computed rows with consecutive depths `[s, e)`
along one path (a node, a piece of a node, or a whole expanded trajectory). Costs are
additive over the segments of a microbatch plus one fixed per-microbatch overhead, which
is what lets planners move subtrees between microbatches and update loads incrementally.
The depth matters because full attention is quadratic in context: a row at depth d
attends its d ancestors and itself, in a rollout tree exactly as in its trajectory, so the
attention work of a segment does not change when it is shared (only the number of times
it is executed does).

The default, `TokenPairCost`, is a FLOP-proportional estimate in *token equivalents*:

    cost([s, e)) = (e - s) + pair_weight * sum_{d=s}^{e-1} (d + 1)

`pair_weight` is the fwd+bwd FLOPs of one attention (query, key) pair summed over the MLA
layers, divided by the fwd+bwd FLOPs of one token through the token-wise layers (6 x the
active parameters, plus KDA's per-token chunk work). For the Tiny model that is
~1.2e-5, so a token at depth 64k costs ~1.75 token equivalents. The simulator supplies a
calibrated model (seconds, measured kernels) through the same interface later.

Every model also states `forward_fraction`, the share of a microbatch's cost spent in its
forward pass: a producer's forward runs in the slot of its first consumer and its backward
after its last consumer, so the metrics split a producer's cost between those two slots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from harts.registry import Registry


@runtime_checkable
class CostModel(Protocol):
    """A pluggable load function. Implementations must be additive over segments."""

    name: str
    forward_fraction: float
    microbatch_overhead: float

    def segment_cost(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Cost of computing rows at depths [start[i], end[i]) (element-wise, float64)."""
        ...

    def spec(self) -> dict[str, Any]:
        """JSON-able parameters; `make_cost_model(**spec)` rebuilds the model."""
        ...


class CostModelName(StrEnum):
    TOKEN_PAIR = "token-pair"
    TOKENS = "tokens"


# Tiny (Table 1): 6 MLA layers x 8 heads x (qk 128+64, v 128), 1.31e9 active parameters,
# 18 KDA layers x 16 heads x 128x128. Derived by `TokenPairCost.for_model`; kept as a
# constant so planning never needs the model package.
TINY_PAIR_WEIGHT = 1.1531e-05


@dataclass(frozen=True)
class TokenPairCost:
    """Tokens plus weighted attention pairs, in token equivalents (see the module doc)."""

    pair_weight: float = TINY_PAIR_WEIGHT
    token_weight: float = 1.0
    microbatch_overhead: float = 0.0
    forward_fraction: float = 1.0 / 3.0
    name: str = CostModelName.TOKEN_PAIR.value

    def segment_cost(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        s = np.asarray(start, dtype=np.float64)
        e = np.asarray(end, dtype=np.float64)
        # sum_{d=s}^{e-1} (d + 1) = (e(e+1) - s(s+1)) / 2
        pairs = 0.5 * (e * (e + 1.0) - s * (s + 1.0))
        return self.token_weight * (e - s) + self.pair_weight * pairs

    def spec(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def for_model(cls, config: Any, active_params: int) -> TokenPairCost:
        """Derive `pair_weight` from a model config (duck-typed `harts.config.ModelConfig`)
        and its active parameter count (`parameter_counts(config).active`)."""
        c = config
        heads = c.mla_num_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        # forward: 2 FLOPs per multiply-add for QK^T and for PV; backward ~2x forward
        pair_flops = 3.0 * c.num_mla_layers * heads * 2.0 * (qk + c.v_head_dim)
        h, k, v, b = c.kda_num_heads, c.kda_head_dim, c.kda_head_v_dim, c.chunk_size
        # chunkwise KDA per token: state read/update (~3 K x V products) and the
        # intra-chunk attention over B positions (K + V), forward; backward ~2x
        kda_flops = 3.0 * c.num_kda_layers * h * 2.0 * (3 * k * v + b * (k + v))
        token_flops = 6.0 * active_params + kda_flops
        return cls(pair_weight=pair_flops / token_flops)


@dataclass(frozen=True)
class TokenCost:
    """Plain token counts: the load a token-budget packer sees."""

    microbatch_overhead: float = 0.0
    forward_fraction: float = 1.0 / 3.0
    name: str = CostModelName.TOKENS.value

    def segment_cost(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        return np.asarray(end, dtype=np.float64) - np.asarray(start, dtype=np.float64)

    def spec(self) -> dict[str, Any]:
        return asdict(self)


_COST_MODELS: Registry[CostModelName, type] = Registry("cost model", CostModelName, ValueError)


def register_cost_model(name: CostModelName, cls: type) -> None:
    _COST_MODELS.register(name, cls)


register_cost_model(CostModelName.TOKEN_PAIR, TokenPairCost)
register_cost_model(CostModelName.TOKENS, TokenCost)


def known_cost_models() -> list[str]:
    return _COST_MODELS.known()


def make_cost_model(name: str = CostModelName.TOKEN_PAIR.value, **params: Any) -> CostModel:
    """The registered cost model `name` built with `params` (a `spec()` round-trips)."""
    cls = _COST_MODELS.get(name)
    params = {k: v for k, v in params.items() if k != "name"}
    return cls(**params)


def default_cost_model() -> CostModel:
    return TokenPairCost()
