"""Rollout-Tree Monte Carlo (RTMC) advantages: per-step credit without a critic.

The rollouts of one group (one prompt) often pass through the same intermediate states:
tree rollouts share prefixes by construction, and independent rollouts repeat the same
tool calls. With states and actions as signatures (harts.rl.signatures: a state is the
tuple of step signatures before a step, the action is the step's signature), the group's
returns estimate, for every visited state s and action a:

    n(s, a)   first-visit count: the number of rollouts that take a in s (a rollout that
              takes a in s again later counts once)
    Q(s, a)   mean return of those rollouts (the return of every step is the rollout's
              terminal reward: outcome-only reward, no discount)
    n(s)      sum_a n(s, a)
    V(s)      sum_a n(s, a) Q(s, a) / n(s) (with whole-history states: the mean return of
              the rollouts through s)
    A(s, a) = Q(s, a) - V(s)

The state of a step is its history of signatures (`window` None: every earlier step, so a
rollout never revisits a state and first-visit counts are plain visit counts) or the last
`window` signatures (a coarser state that rollouts can revisit; first visits then decide
the counts, and every visit's tokens get the (state, action)'s advantage).

With prior smoothing of strength k (`prior_strength`), every action's estimate gets k
pseudo-visits of the episode baseline b (the group's mean reward), so rarely visited
states and actions are pulled toward b:

    Q~(s, a) = (sum of returns of (s, a) + k b) / (n(s, a) + k)
    V~(s)    = sum_a (n(s, a) + k) Q~(s, a) / sum_a (n(s, a) + k)
             = (sum of returns through s + m_s k b) / (n(s) + m_s k),  m_s = actions seen in s
    A~(s, a) = Q~(s, a) - V~(s)

Zero-sum identity (what the property tests check): for every state s,
`sum_a (n(s, a) + k) A~(s, a) = 0`. With k = 0 that is the unsmoothed statement
`sum_a n(s, a) A(s, a) = 0` (visit-weighted advantages of a state's actions sum to zero).
With k > 0 the visit-weighted sum is in general not zero: it equals `-k sum_a A~(s, a)`,
which vanishes when s has one action, when all of s's actions have equal visits, or when
all its actions have equal Q~. A state seen with one action only has A~ = 0: one action
carries no contrast, so its tokens keep the episode advantage's share alone.

Per-token advantages. The GRPO episode advantage of rollout i is
`A_ep(i) = (r_i - mean(r)) / (std(r) + eps)` (population std over the group). Every token
of turn t of rollout i (its action, `turns[t].start:turns[t].end`) gets

    (1 - mix) A_ep(i) + mix A~(s_t, a_t) / (std(r) + eps)

(the step advantage scaled like the episode advantage, so at a root where every rollout
takes a different first action with k = 0, the two agree); every other token (prompt,
observations, text after the last action) gets A_ep(i). Positions outside the loss mask
get values too and are ignored by training, as for any advantage.

Rollouts whose step structure cannot be read (no `turns`, a malformed turn, arguments that
do not normalise) raise harts.tree.trajectory.TurnError naming the trajectory and the turn:
there is no silent fallback to GRPO; call `grpo_advantages` for that explicitly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harts.rl.signatures import State, StepSignature, states_and_actions, trajectory_signatures
from harts.tree.trajectory import Trajectory

DEFAULT_PRIOR_STRENGTH = 1.0
DEFAULT_MIX = 0.5
DEFAULT_EPS = 1e-6


@dataclass(frozen=True)
class StepStat:
    """The estimates of one (state, action) of a group. `pseudo_visits` is
    `visits + prior_strength`, the weight under which a state's advantages sum to zero."""

    state: State
    action: StepSignature
    visits: int  # n(s, a)
    state_visits: int  # n(s)
    q: float  # Q~(s, a)
    v: float  # V~(s)
    advantage: float  # A~(s, a) = q - v
    pseudo_visits: float


@dataclass(frozen=True)
class RTMCTable:
    """The group's (state, action) estimates, in first-seen order, and the episode
    statistics they are mixed with."""

    steps: tuple[StepStat, ...]
    baseline: float  # b = mean reward of the group
    std: float  # population std of the rewards
    prior_strength: float
    window: int | None = None  # the state's history length (None: the whole history)

    def lookup(self, state: State, action: StepSignature) -> StepStat:
        for s in self.steps:
            if s.state == state and s.action == action:
                return s
        raise KeyError(f"no step with this state and action (state of {len(state)} steps)")

    def by_state(self) -> dict[State, list[StepStat]]:
        out: dict[State, list[StepStat]] = {}
        for s in self.steps:
            out.setdefault(s.state, []).append(s)
        return out


def episode_advantages(rewards: Sequence[float], *, eps: float = DEFAULT_EPS) -> np.ndarray:
    """GRPO's episode advantages `(r - mean) / (std + eps)`, population std, float64 [G]."""
    r = _rewards(rewards, None)
    return (r - r.mean()) / (r.std() + eps)


def grpo_advantages(group: Sequence[Trajectory], rewards: Sequence[float], *,
                    eps: float = DEFAULT_EPS) -> list[np.ndarray]:
    """Per-token GRPO advantages: rollout i's episode advantage on every one of its tokens
    (float64 [L_i] each, in the order of `group`). Step structure is not read."""
    _check_group(group)
    adv = episode_advantages(_rewards(rewards, len(group)), eps=eps)
    return [np.full(len(t), float(a)) for t, a in zip(group, adv, strict=True)]


def rtmc_table(group: Sequence[Trajectory], rewards: Sequence[float], *,
               prior_strength: float = DEFAULT_PRIOR_STRENGTH, window: int | None = None) -> RTMCTable:
    """First-visit Monte Carlo estimates of every (state, action) of the group (module
    docstring). Raises TurnError for a rollout whose steps cannot be read, ValueError for a
    bad group (empty, mixed groups, duplicate ids) or bad rewards / prior strength."""
    _check_group(group)
    r = _rewards(rewards, len(group))
    k = _nonneg("prior_strength", prior_strength)
    b = float(r.mean())
    visits: dict[tuple[State, StepSignature], int] = {}
    sums: dict[tuple[State, StepSignature], float] = {}
    order: list[tuple[State, StepSignature]] = []
    for traj, ret in zip(group, r, strict=True):
        seen: set[tuple[State, StepSignature]] = set()
        for key in states_and_actions(trajectory_signatures(traj), window):
            if key in seen:  # first visit only
                continue
            seen.add(key)
            if key not in visits:
                visits[key] = 0
                sums[key] = 0.0
                order.append(key)
            visits[key] += 1
            sums[key] += float(ret)
    state_n: dict[State, int] = {}
    state_w: dict[State, float] = {}
    state_sum: dict[State, float] = {}
    q: dict[tuple[State, StepSignature], float] = {}
    for key in order:
        n = visits[key]
        q[key] = (sums[key] + k * b) / (n + k)
        s = key[0]
        state_n[s] = state_n.get(s, 0) + n
        state_w[s] = state_w.get(s, 0.0) + (n + k)
        state_sum[s] = state_sum.get(s, 0.0) + (n + k) * q[key]
    steps = []
    for key in order:
        s, a = key
        v = state_sum[s] / state_w[s]
        steps.append(StepStat(s, a, visits[key], state_n[s], q[key], v, q[key] - v, visits[key] + k))
    return RTMCTable(tuple(steps), b, float(r.std()), k, window)


def rtmc_advantages(group: Sequence[Trajectory], rewards: Sequence[float], *,
                    prior_strength: float = DEFAULT_PRIOR_STRENGTH, mix: float = DEFAULT_MIX,
                    eps: float = DEFAULT_EPS, window: int | None = None) -> list[np.ndarray]:
    """Per-token RTMC advantages of one group: float64 [L_i] per trajectory, in the order of
    `group` (module docstring for the formula). `rewards[i]` is rollout i's terminal
    reward; `mix` in [0, 1] is the step advantage's share (0 gives GRPO exactly);
    `prior_strength` >= 0 the pseudo-visits of the baseline; `window` the state's history
    length (None: the whole history). Raises TurnError naming the
    trajectory and the turn for an unreadable step structure, never falling back to GRPO."""
    if not (isinstance(mix, (int, float)) and 0.0 <= mix <= 1.0):
        raise ValueError(f"mix: must be in [0, 1] (got {mix!r})")
    table = rtmc_table(group, rewards, prior_strength=prior_strength, window=window)
    index = {(s.state, s.action): s.advantage for s in table.steps}
    r = _rewards(rewards, len(group))
    scale = table.std + eps
    ep = (r - table.baseline) / scale
    out = []
    for traj, a_ep in zip(group, ep, strict=True):
        adv = np.full(len(traj), float(a_ep))
        sigs = trajectory_signatures(traj)
        assert traj.turns is not None  # trajectory_signatures refused None
        for turn, key in zip(traj.turns, states_and_actions(sigs, window), strict=True):
            adv[turn.start:turn.end] = (1.0 - mix) * a_ep + mix * index[key] / scale
        out.append(adv)
    return out


def with_advantages(group: Sequence[Trajectory], advantages: Sequence[np.ndarray]) -> list[Trajectory]:
    """Copies of the trajectories carrying the given per-token advantages (the rollout
    format the trainers read); every other field is shared with the input."""
    if len(group) != len(advantages):
        raise ValueError(f"{len(advantages)} advantage arrays for {len(group)} trajectories")
    out = []
    for t, a in zip(group, advantages, strict=True):
        arr = np.asarray(a, dtype=np.float64)
        if arr.shape != (len(t),):
            raise ValueError(f"trajectory {t.id!r}: advantages of shape {arr.shape} for {len(t)} tokens")
        if not np.isfinite(arr).all():
            raise ValueError(f"trajectory {t.id!r}: advantages contain NaN or infinity")
        out.append(dataclasses.replace(t, advantage=arr.copy()))
    return out


def _check_group(group: Sequence[Trajectory]) -> None:
    if len(group) == 0:
        raise ValueError("group: no trajectories")
    names = {t.group for t in group}
    if len(names) > 1:
        raise ValueError(f"group: trajectories of several groups {sorted(names)} (advantages are per group)")
    ids = [t.id for t in group]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"group: duplicate trajectory id {dup!r}")


def _rewards(rewards: Sequence[float], n: int | None) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError("rewards: must be a non-empty flat list of numbers")
    if n is not None and r.size != n:
        raise ValueError(f"rewards: {r.size} rewards for {n} trajectories")
    if not np.isfinite(r).all():
        raise ValueError("rewards: contain NaN or infinity")
    return r


def _nonneg(name: str, x: float) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise ValueError(f"{name}: must be a finite number >= 0 (got {x!r})")
    return float(x)
