"""Names of the cost families, and the load models step planning prices microbatches with.

Two families, two names, one registry mechanism (`harts.config.registry`):
- `LoadModelName` (`token-pair`, `tokens`): the planners' load functions below, in token
  equivalents. Pure arithmetic over depths; `PlanConfig.cost_model` holds one, so they
  live beside the configuration rather than in `harts.plan`.
- `CostModelName` (`roofline`, `calibrated`, `executor`): the simulator's time-and-memory models; the
  models and their factory (`make_cost_model`) live in `harts.sim.costs`.

A load model prices *segments*: runs of computed rows with consecutive depths `[s, e)`
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
~1.2e-5, so a token at depth 64k costs ~1.75 token equivalents. The simulator prices
steps in seconds with its own models (`CostModelName`, `harts.sim.costs`).

Every model also states `forward_fraction`, the share of a microbatch's cost spent in its
forward pass: a producer's forward runs in the slot of its first consumer and its backward
after its last consumer, so the metrics split a producer's cost between those two slots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from harts.config.registry import Registry


@runtime_checkable
class LoadModel(Protocol):
    """A pluggable load function. Implementations must be additive over segments."""

    name: str
    forward_fraction: float
    microbatch_overhead: float

    def segment_cost(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Cost of computing rows at depths [start[i], end[i]) (element-wise, float64)."""
        ...

    def spec(self) -> dict[str, Any]:
        """JSON-able parameters; `make_load_model(**spec)` rebuilds the model."""
        ...


class LoadModelName(StrEnum):
    TOKEN_PAIR = "token-pair"
    TOKENS = "tokens"


class CostModelName(StrEnum):
    ROOFLINE = "roofline"
    CALIBRATED = "calibrated"
    EXECUTOR = "executor"


def _check_nonnegative(model: Any, *fields: str) -> None:
    for f in fields:
        value = getattr(model, f)
        if not value >= 0:
            raise ValueError(f"{type(model).__name__}.{f} must be >= 0, got {value!r}")


def _check_fraction(model: Any) -> None:
    if not 0.0 <= model.forward_fraction <= 1.0:
        raise ValueError(f"{type(model).__name__}.forward_fraction must lie in [0, 1], "
                         f"got {model.forward_fraction!r}")


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
    name: str = LoadModelName.TOKEN_PAIR.value

    def __post_init__(self) -> None:
        _check_nonnegative(self, "pair_weight", "token_weight", "microbatch_overhead")
        _check_fraction(self)

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
        # Qwen3-Next's layers, where the config has them: gated attention pairs over its query
        # heads (qk and v dims both attn_head_dim), GDN as the same chunkwise recurrence
        kinds = list(getattr(c, "layer_kinds", ()))
        n_ga, n_gdn = kinds.count("gated_attention"), kinds.count("gdn")
        if n_ga:
            pair_flops += 3.0 * n_ga * c.attn_num_heads * 2.0 * (2 * c.attn_head_dim)
        if n_gdn:
            gh, gk, gv = c.gdn_num_v_heads, c.gdn_head_k_dim, c.gdn_head_v_dim
            kda_flops += 3.0 * n_gdn * gh * 2.0 * (3 * gk * gv + b * (gk + gv))
        token_flops = 6.0 * active_params + kda_flops
        return cls(pair_weight=pair_flops / token_flops)


@dataclass(frozen=True)
class TokenCost:
    """Plain token counts: the load a token-budget packer sees."""

    microbatch_overhead: float = 0.0
    forward_fraction: float = 1.0 / 3.0
    name: str = LoadModelName.TOKENS.value

    def __post_init__(self) -> None:
        _check_nonnegative(self, "microbatch_overhead")
        _check_fraction(self)

    def segment_cost(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        return np.asarray(end, dtype=np.float64) - np.asarray(start, dtype=np.float64)

    def spec(self) -> dict[str, Any]:
        return asdict(self)


_LOAD_MODELS: Registry[LoadModelName, type] = Registry("cost model", LoadModelName, ValueError)


def register_load_model(name: LoadModelName, cls: type) -> None:
    _LOAD_MODELS.register(name, cls)


register_load_model(LoadModelName.TOKEN_PAIR, TokenPairCost)
register_load_model(LoadModelName.TOKENS, TokenCost)


def known_load_models() -> list[str]:
    return _LOAD_MODELS.known()


def make_load_model(name: str = LoadModelName.TOKEN_PAIR.value, **params: Any) -> LoadModel:
    """The registered load model `name` built with `params` (a `spec()` round-trips)."""
    cls = _LOAD_MODELS.get(name)
    params = {k: v for k, v in params.items() if k != "name"}
    return cls(**params)


def default_load_model() -> LoadModel:
    return TokenPairCost()
