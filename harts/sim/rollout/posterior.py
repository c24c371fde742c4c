"""Heddle's posterior length predictor (`posterior` on the policy): the remaining decode
tokens of a trajectory as the workload's own length model implies them, given what the
step has shown so far, instead of the run-length hint times an observed mean.

The model is the one trajectories are drawn from (`harts.sim.rollout.workload`), its
parameters read from the `RolloutWorkload`, never a true length: a turn's action length
is lognormal around mu_i = log(action median) + g + tau_i with per-turn sigma s_a, g the
prompt group's shared scale ~ N(0, s_g^2), tau_i the trajectory's ~ N(0, s_t^2); the
turn count T is lognormal (`turns_median`, `turns_sigma`, rounded, in `turns_range`) and
the hint is T x exp(N(0, `predictor_sigma`^2)).

- Per-turn scale: a normal-normal posterior of g from the group's members (each member's
  mean log length over its observed turns, of variance s_t^2 + s_a^2 / n), then of mu_i
  from g's posterior and the trajectory's own turns. A running turn is an observation
  censored at its elapsed tokens (its length is above them): it enters as the mean of its
  truncated lognormal under the current estimate (one expectation step; `CENSOR_PASSES`
  passes over the group). Early in a step the group's finished turns are its short ones,
  so without the censored turns a hard prompt's group looks easy; with them a group whose
  samples all still run is recognised as long before any of them finishes a turn.
- Turn count: the posterior of T given the hint (on the integers of `turns_range`),
  conditioned on T > the turns done.
- Remaining tokens: the running turn's expected rest (its truncated lognormal mean minus
  what it has decoded, at most the action cap) plus the later turns' expected count times
  the per-turn mean, at most what the context cap leaves.
"""

from __future__ import annotations

import math

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.types import TrajectorySpec

CENSOR_PASSES = 2  # expectation passes over a group's censored (running) turns


def _phi(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _Phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def truncated_log_mean(mu: float, s: float, cut: float) -> float:
    """E[log a | log a > cut] for log a ~ N(mu, s^2)."""
    z = (cut - mu) / s
    tail = _Phi(-z)
    if tail < 1e-12:
        return cut + s * s / max(cut - mu, 1e-9)  # the inverse Mills ratio's asymptote
    return mu + s * _phi(z) / tail


def truncated_mean(mu: float, s: float, cut: float) -> float:
    """E[a | a > exp(cut)] for log a ~ N(mu, s^2) (lognormal a)."""
    z = (cut - mu) / s
    tail = _Phi(-z)
    if tail < 1e-12:
        return math.exp(cut) * (1.0 + s * s / max(cut - mu, 1e-9))
    return math.exp(mu + s * s / 2.0) * _Phi(s - z) / tail


def turn_posteriors(cfg: RolloutWorkload, hints: np.ndarray) -> np.ndarray:
    """P[i, T - 1]: the posterior of trajectory i's turn count T (1 .. `turns_range`[1])
    given its hint, under the workload's lognormal turn count (rounded, clipped)."""
    lo, hi = cfg.turns_range
    T = np.arange(1, hi + 1, dtype=float)
    m, s = math.log(cfg.turns_median), cfg.turns_sigma
    edges = np.log(np.concatenate(([1e-9], T[:-1] + 0.5, [np.inf])))
    cdf = np.array([_Phi((e - m) / s) if np.isfinite(e) else 1.0 for e in edges])
    prior = np.diff(cdf)
    prior[T < lo] = 0.0
    prior[int(lo) - 1] += cdf[int(lo) - 1] if lo > 1 else 0.0  # the clipped lower mass
    sp = max(cfg.predictor_sigma, 1e-3)
    like = np.exp(-0.5 * ((np.log(np.maximum(hints, 1e-9))[:, None] - np.log(T)[None, :]) / sp) ** 2)
    post = prior[None, :] * like
    post /= np.maximum(post.sum(axis=1, keepdims=True), 1e-300)
    return post


class PosteriorPredictor:
    """Per-step state of the posterior predictor: every trajectory's observed turn
    lengths (count and sum of log lengths) and the turn-count posteriors from the hints."""

    def __init__(self, cfg: RolloutWorkload, specs: tuple[TrajectorySpec, ...]):
        self.cfg = cfg
        self.m = math.log(cfg.action_median)
        self.va = cfg.action_sigma ** 2
        self.vt = cfg.action_traj_sigma ** 2
        self.vg = cfg.action_group_sigma ** 2
        self.log_hi = math.log(cfg.action_range[1])
        self.n = np.zeros(len(specs))
        self.s = np.zeros(len(specs))
        self.turns = turn_posteriors(cfg, np.array([s.hint_turns for s in specs], dtype=float))
        self.T = np.arange(1, cfg.turns_range[1] + 1, dtype=float)

    def observe(self, tid: int, action_tokens: int) -> None:
        """A finished turn of `tid` decoded `action_tokens` tokens."""
        self.n[tid] += 1
        self.s[tid] += math.log(max(action_tokens, 1))

    def group_scale(self, members: list[int], elapsed: dict[int, int]) -> tuple[float, float]:
        """(posterior mean, variance) of the group's log scale g from its members' observed
        turns and their running turns (`elapsed`: tid -> tokens decoded so far), censored."""
        vs = self.vt + self.va  # a member's one-turn residual around g
        g, vg = 0.0, self.vg
        for _ in range(1 + CENSOR_PASSES * bool(elapsed)):
            prec, acc = 1.0 / self.vg if self.vg > 0 else 1e12, 0.0
            for j in members:
                n, s = self.n[j], self.s[j] - self.n[j] * self.m
                e = elapsed.get(j, 0)
                if e > 0:  # the running turn: its length is above e
                    mu_j = self.m + g
                    s += truncated_log_mean(mu_j, math.sqrt(vs + vg), math.log(e)) - self.m
                    n += 1
                if n > 0:
                    w = 1.0 / (self.vt + self.va / n)
                    prec += w
                    acc += w * s / n
            g, vg = acc / prec, 1.0 / prec
        return g, vg

    def remaining(self, tid: int, turns_done: int, elapsed: int, budget: float, g: tuple[float, float]) -> tuple[float, float]:
        """(expected remaining decode tokens, expected remaining turns counting the running
        or next one) of `tid` after `turns_done` turns, `elapsed` tokens into its running
        turn, with `budget` tokens left under the context cap, given the group posterior `g`."""
        gm, gv = g
        prior_v = gv + self.vt
        n, s = self.n[tid], self.s[tid] - self.n[tid] * self.m
        if elapsed > 0:  # own running turn, censored at its elapsed tokens
            s += truncated_log_mean(self.m + gm, math.sqrt(prior_v + self.va), math.log(elapsed)) - self.m
            n += 1
        prec = 1.0 / max(prior_v, 1e-12) + n / self.va
        mu = self.m + (gm / max(prior_v, 1e-12) + s / self.va) / prec
        v = 1.0 / prec + self.va  # a future turn's log length around its mean
        per_turn = min(math.exp(mu + v / 2.0), float(self.cfg.action_range[1]))
        if elapsed > 0:
            now = max(min(truncated_mean(mu, math.sqrt(v), math.log(elapsed)), float(self.cfg.action_range[1]))
                      - elapsed, 1.0)
        else:
            now = per_turn
        p = self.turns[tid][turns_done:]
        mass = p.sum()
        turns = float((p * (self.T[turns_done:] - turns_done)).sum() / mass) if mass > 1e-12 else 1.0
        x = now + max(turns - 1.0, 0.0) * per_turn
        return max(min(x, budget), 1.0), max(turns, 1.0)
