"""TRACE's success predictor and the node features it reads (`harts.rl.trace` allocates
rollouts by its predictions).

Predictor. A `SuccessPredictor` maps feature rows to probabilities in (0, 1).
`LogisticPredictor` is a small online logistic regression (numpy, full-batch gradient
steps on soft cross-entropy with L2, weights kept between updates) trained on the tree's
recursive targets: `node_targets` gives, for every node of a sampled group (the root and
every turn-boundary prefix), its features and its target, the mean reward of the leaves
below it, weighted by the number of those leaves.

Features. `prefix_features(prompt_features, history)` concatenates the caller's prompt
features, a bias, the depth and hashed bags of the history's (tool, outcome) pairs (all
steps, normalised by depth, and the last step) and of the last step's whole signature, so
one predictor generalises across prompts and depths. Hashing is by CRC32 of the signature
text: stable across runs.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from harts.rl.signatures import StepSignature, trajectory_signatures
from harts.tree.trajectory import Trajectory

DEFAULT_HASH_BUCKETS = 8


@runtime_checkable
class SuccessPredictor(Protocol):
    """Predicted success probability in (0, 1) per feature row."""

    def predict(self, features: np.ndarray) -> np.ndarray:  # float64 [N, F] -> [N]
        ...


class LogisticPredictor:
    """Online logistic regression on feature rows, with soft targets in [0, 1].

    `update(X, y, w)` runs `steps` full-batch gradient steps of the weighted mean soft
    cross-entropy plus `l2 / 2 |weights|^2` (bias included), starting from the current
    weights, so repeated updates keep learning online. Deterministic: no sampling.
    Predictions are clipped to [clip, 1 - clip] so no candidate is ever certain."""

    def __init__(self, n_features: int, *, lr: float = 0.5, l2: float = 1e-3, steps: int = 100,
                 clip: float = 1e-3):
        if isinstance(n_features, bool) or not isinstance(n_features, int) or n_features < 1:
            raise ValueError(f"n_features: must be an integer >= 1 (got {n_features!r})")
        for name, v in (("lr", lr), ("l2", l2), ("clip", clip)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}: must be finite and >= 0 (got {v!r})")
        if not 0 < clip < 0.5:
            raise ValueError(f"clip: must be in (0, 0.5) (got {clip!r})")
        self.n_features = n_features
        self.lr, self.l2, self.steps, self.clip = float(lr), float(l2), int(steps), float(clip)
        self.weights = np.zeros(n_features)
        self.bias = 0.0
        self.updates = 0

    def predict(self, features: np.ndarray) -> np.ndarray:
        x = self._rows(features)
        p = _sigmoid(x @ self.weights + self.bias)
        return np.clip(p, self.clip, 1.0 - self.clip)

    def update(self, features: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None) -> float:
        """Fit further on (X, y, w); returns the weighted soft cross-entropy after the update."""
        x = self._rows(features)
        y = np.asarray(targets, dtype=np.float64)
        if y.shape != (x.shape[0],) or not np.isfinite(y).all() or (y < 0).any() or (y > 1).any():
            raise ValueError(f"targets: must be {x.shape[0]} numbers in [0, 1]")
        w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != y.shape or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ValueError("weights: must be non-negative numbers, one per row, not all zero")
        w = w / w.sum()
        for _ in range(self.steps):
            p = _sigmoid(x @ self.weights + self.bias)
            g = w * (p - y)
            self.weights -= self.lr * (x.T @ g + self.l2 * self.weights)
            self.bias -= self.lr * (float(g.sum()) + self.l2 * self.bias)
        self.updates += 1
        p = np.clip(_sigmoid(x @ self.weights + self.bias), 1e-12, 1 - 1e-12)
        return float(-(w * (y * np.log(p) + (1 - y) * np.log(1 - p))).sum())

    def _rows(self, features: np.ndarray) -> np.ndarray:
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise ValueError(f"features: must be [N, {self.n_features}] (got shape {x.shape})")
        if not np.isfinite(x).all():
            raise ValueError("features: contain NaN or infinity")
        return x


def prefix_features(prompt_features: Sequence[float], history: Sequence[StepSignature], *,
                    buckets: int = DEFAULT_HASH_BUCKETS) -> tuple[float, ...]:
    """Features of a node: prompt features, bias 1, depth, the hashed bag of the history's
    (tool, outcome) pairs divided by the depth, the last step's pair one-hot and the last
    step's whole signature (arguments included) one-hot (zeros at a root). Length
    `feature_count(len(prompt_features), buckets=buckets)`."""
    if buckets < 1:
        raise ValueError(f"buckets: must be >= 1 (got {buckets})")
    bag = np.zeros(buckets)
    last = np.zeros(buckets)
    whole = np.zeros(buckets)
    for sig in history:
        bag[_bucket(sig, buckets)] += 1.0
    if history:
        bag /= len(history)
        last[_bucket(history[-1], buckets)] = 1.0
        whole[_bucket(history[-1], buckets, with_args=True)] = 1.0
    head = [float(x) for x in prompt_features]
    return (*head, 1.0, float(len(history)), *bag.tolist(), *last.tolist(), *whole.tolist())


def feature_count(n_prompt_features: int, *, buckets: int = DEFAULT_HASH_BUCKETS) -> int:
    """The length of `prefix_features`' rows (what `LogisticPredictor` needs)."""
    return n_prompt_features + 2 + 3 * buckets


def node_targets(group: Sequence[Trajectory], rewards: Sequence[float], prompt_features: Sequence[float], *,
                 buckets: int = DEFAULT_HASH_BUCKETS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The recursive targets of one sampled group: for every node (root, and each distinct
    history of t steps for t = 1 .. T_i - 1 of each rollout), (features [N, F], target [N] =
    mean reward of the rollouts below it, weight [N] = their number). Rewards must lie in
    [0, 1]. Raises TurnError for a rollout whose steps cannot be read."""
    r = unit_rewards(rewards, len(group))
    nodes = node_histories(group)
    x = np.array([prefix_features(prompt_features, h, buckets=buckets) for h in nodes])
    y = np.array([float(r[list(members)].mean()) for members in nodes.values()])
    w = np.array([float(len(members)) for members in nodes.values()])
    return x, y, w


def node_histories(group: Sequence[Trajectory]) -> dict[tuple[StepSignature, ...], list[int]]:
    """Every history of t steps (t = 0 .. T_i - 1) of every rollout -> the rollouts through it."""
    nodes: dict[tuple[StepSignature, ...], list[int]] = {(): []}
    for i, traj in enumerate(group):
        sigs = trajectory_signatures(traj)
        for t in range(max(len(sigs), 1)):
            nodes.setdefault(sigs[:t], []).append(i)
    return nodes


def unit_rewards(rewards: Sequence[float], n: int) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.shape != (n,) or not np.isfinite(r).all() or (r < 0).any() or (r > 1).any():
        raise ValueError(f"rewards: must be {n} numbers in [0, 1]")
    return r


def _bucket(sig: StepSignature, buckets: int, with_args: bool = False) -> int:
    text = f"{sig.tool}\x00{sig.args}\x00{sig.outcome}" if with_args else f"{sig.tool}\x00{sig.outcome}"
    return zlib.crc32(text.encode()) % buckets


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))
