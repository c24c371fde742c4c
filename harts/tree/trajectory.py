"""One rollout trajectory as training sees it.

Per-position arrays are as long as `tokens`. Token p is trained on when `loss_mask[p]` is
set; its log-prob comes from the logits at p-1, so `loss_mask[0]` is always 0.
`old_logprobs[p]` is the rollout policy's log-prob of token p (ignored where the mask is 0).
A scalar advantage is broadcast to every position at construction, so downstream code sees
one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class TrajectoryError(ValueError):
    """A trajectory that breaks the input contract; the message names the field."""


@dataclass(frozen=True, eq=False)
class Trajectory:
    id: str
    group: str
    tokens: np.ndarray  # int64 [L]
    loss_mask: np.ndarray  # bool [L]
    advantage: np.ndarray  # float64 [L]
    old_logprobs: np.ndarray  # float64 [L]
    ref_logprobs: np.ndarray | None = None  # float64 [L]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(
        cls,
        id: str,
        group: str,
        tokens: Any,
        loss_mask: Any = None,
        advantage: Any = 0.0,
        old_logprobs: Any = None,
        ref_logprobs: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Trajectory:
        """Build and validate a trajectory from Python values or arrays.

        Defaults: loss mask all ones after position 0, zero advantage, zero old log-probs.
        Raises TrajectoryError naming the offending field.
        """
        if not isinstance(id, str) or not id:
            raise TrajectoryError("id: must be a non-empty string")
        if not isinstance(group, str) or not group:
            raise TrajectoryError("group: must be a non-empty string")
        tok = _int_tokens(tokens)
        n = tok.size
        if loss_mask is None:
            mask = np.ones(n, dtype=bool)
            mask[:1] = False
        else:
            mask = _mask(loss_mask, n)
        adv = _float_array("advantage", advantage, n, allow_scalar=True)
        old = np.zeros(n) if old_logprobs is None else _float_array("old_logprobs", old_logprobs, n)
        ref = None if ref_logprobs is None else _float_array("ref_logprobs", ref_logprobs, n)
        return cls(id, group, tok, mask, adv, old, ref, dict(extra or {}))

    def __len__(self) -> int:
        return int(self.tokens.size)

    def same_as(self, other: Trajectory) -> bool:
        """Exact equality of every field (arrays compared element-wise, NaN-free by contract)."""
        if (self.id, self.group, self.extra) != (other.id, other.group, other.extra):
            return False
        if (self.ref_logprobs is None) != (other.ref_logprobs is None):
            return False
        pairs = [
            (self.tokens, other.tokens),
            (self.loss_mask, other.loss_mask),
            (self.advantage, other.advantage),
            (self.old_logprobs, other.old_logprobs),
        ]
        if self.ref_logprobs is not None:
            pairs.append((self.ref_logprobs, other.ref_logprobs))
        return all(a.shape == b.shape and np.array_equal(a, b) for a, b in pairs)


def _int_tokens(tokens: Any) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise TrajectoryError("tokens: must be a flat list of integers")
    if arr.size == 0:
        raise TrajectoryError("tokens: trajectory is empty")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TrajectoryError("tokens: every token must be an integer")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise TrajectoryError(f"tokens: negative token id {int(arr[arr < 0][0])}")
    return arr


def _mask(value: Any, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.size != n:
        raise TrajectoryError(f"loss_mask: length {arr.size} does not match {n} tokens")
    values = set(np.unique(arr).tolist()) if arr.size else set()
    if not values <= {0, 1} or arr.dtype.kind not in "biu":
        raise TrajectoryError("loss_mask: values must be 0 or 1")
    mask = arr.astype(bool)
    if mask[0]:
        raise TrajectoryError("loss_mask: position 0 cannot be trained on (no logits precede it)")
    return mask


def _float_array(name: str, value: Any, n: int, allow_scalar: bool = False) -> np.ndarray:
    if allow_scalar and np.ndim(value) == 0:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TrajectoryError(f"{name}: must be a number or a list of numbers")
        arr = np.full(n, float(value))
    else:
        arr = np.asarray(value)
        if arr.ndim != 1 or arr.size != n:
            raise TrajectoryError(f"{name}: length {arr.size} does not match {n} tokens")
        if arr.dtype.kind not in "iuf":
            raise TrajectoryError(f"{name}: values must be numbers")
        arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise TrajectoryError(f"{name}: contains NaN or infinity")
    return arr
