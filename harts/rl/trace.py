"""TRACE: Tree Rollout Allocation for Contrastive Exploration.

A group's rollouts only carry a policy-gradient signal when their rewards differ (GRPO's
advantages are all zero otherwise). TRACE spends a fixed rollout budget where mixed
outcomes are most likely: on prompt roots, and on intermediate prefixes (a sampled
rollout's history up to a turn boundary) whose continuations may end differently.

Candidates. A `Candidate` is a root (a prompt, nothing sampled yet) or a prefix (a turn
boundary of sampled rollouts: continuations restart right before turn `depth`'s action,
at token `position` of trajectory `source`). It carries prefix features and the outcomes
already observed below it: `successes` and `failures` (rewards binarised by the caller,
e.g. `reward >= 0.5`; `prefix_candidates` does this).

Objective. With v the predicted success probability of a candidate and m new rollouts
from it, the chance that its node ends with mixed outcomes is

    nothing observed (a root, or a prefix offered before any rollout through it ended):
                                    P(m) = 1 - v^m - (1 - v)^m   (m >= 1), P(0) = 0
    prefix, only successes so far:  P(m) = 1 - v^m      (a continuation must fail)
    prefix, only failures so far:   P(m) = 1 - (1 - v)^m  (a continuation must succeed)
    prefix, already mixed:          P(m) = 0 for every m (no gain from more)

`allocate` maximises sum_c P_c(m_c) subject to sum_c m_c <= budget by greedy marginal
allocation: repeatedly give the next rollout to the candidate with the largest gain
P(m + 1) - P(m). A fresh node's first rollout gains nothing alone (P(1) = 0), so its first
step is a pair (gain P(2) = 2 v (1 - v), counted per rollout); from m = 2 on its gains
decrease, and an observed prefix's gains decrease from m = 0, so the greedy order is the
order of decreasing per-rollout gains; at equal gains a pair goes first. Where the
budget's last rollout cannot complete a pair the greedy pass can strand it, so a local
repair then moves one or two rollouts between candidates (one to one, two to one, one to
two) while that raises the objective. Ties are broken by a permutation drawn from `seed`,
so the same inputs and seed give the same allocation. The whole budget is spent when
there is a candidate (zero-gain steps included, the budget being rollouts the trainer
will use); it is never exceeded.

Group objective. The node objective above counts nodes with mixed outcomes: a prompt's
rollouts already mixed still offer unmixed nodes (a failing rollout's prefixes), and a
node-level allocation spends continuations there. What GRPO needs is a *prompt* (group)
whose rewards differ. With `group_outcomes` (group -> successes, failures observed in the
whole group) `allocate` maximises the number of groups with mixed outcomes instead: with
A = prod_c v_c^m_c and B = prod_c (1 - v_c)^m_c over the group's candidates,

    group already mixed:              P = 0 (nothing to gain)
    only successes so far:            P = 1 - A   (some continuation must fail)
    only failures so far:             P = 1 - B
    nothing observed:                 P = 1 - A - B (0 with no rollout)

by greedy marginal allocation (`allocate_groups`), the node objective's gain breaking
ties between equal group gains (so a budget left once every group is mixed still goes to
contrastive nodes). The loop's prefix expansion uses it: continuations go where a
prompt's rewards are not mixed yet, by the chance that a continuation's outcome differs
from the group's.

Predictor and features (`harts.rl.trace_predictor`). A `SuccessPredictor` maps
feature rows of nodes (`prefix_features`) to probabilities in (0, 1); `LogisticPredictor`,
trained on the tree's recursive targets (`node_targets`), is the one the loop keeps.

A loop uses it in two phases: `allocate(roots, root_budget, predictor)`, sample, then
`prefix_candidates(...)` of each group and `allocate(prefixes, rest, predictor)`; after
scoring, `predictor.update(*node_targets(...))`. `TraceAllocator` holds the predictor and
does these calls with one feature layout. `uniform_allocation` is the baseline
(the budget split evenly over roots, prefixes get nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from harts.rl.trace_predictor import (
    DEFAULT_HASH_BUCKETS,
    LogisticPredictor,
    SuccessPredictor,
    feature_count,
    node_histories,
    node_targets,
    prefix_features,
    unit_rewards,
)
from harts.tree.trajectory import Trajectory

DEFAULT_SUCCESS_THRESHOLD = 0.5


class CandidateKind(StrEnum):
    ROOT = "root"
    PREFIX = "prefix"


class AllocationName(StrEnum):
    """The allocation policies (`--allocation`)."""

    UNIFORM = "uniform"
    TRACE = "trace"


@dataclass(frozen=True)
class Candidate:
    """Where rollouts may be spent: a prompt root or a turn-boundary prefix.

    `id` is unique among the candidates of one allocation; `group` is the prompt's group;
    `features` the predictor's input row; `successes` / `failures` the outcomes already
    observed below the node (0 / 0 for a root); `depth` the number of turns in the prefix
    (0 for a root); for a prefix, `source` and `position` say where to branch:
    continuations of trajectory `source` restart at token `position` (the start of turn
    `depth`'s action)."""

    id: str
    group: str
    kind: CandidateKind
    features: tuple[float, ...]
    successes: int = 0
    failures: int = 0
    depth: int = 0
    source: str | None = None
    position: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("Candidate.id: must be a non-empty string")
        where = f"candidate {self.id!r}"
        if not isinstance(self.group, str) or not self.group:
            raise ValueError(f"{where}: group must be a non-empty string")
        if not isinstance(self.kind, CandidateKind):
            raise ValueError(f"{where}: kind must be a CandidateKind (got {self.kind!r})")
        if not isinstance(self.features, tuple) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in self.features):
            raise ValueError(f"{where}: features must be a tuple of finite numbers")
        for name in ("successes", "failures", "depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: {name} must be an integer >= 0 (got {v!r})")
        if self.kind is CandidateKind.ROOT:
            if self.successes or self.failures or self.depth or self.source is not None or self.position is not None:
                raise ValueError(f"{where}: a root has no observed outcomes, depth, source or position")
        else:
            if self.depth < 1:
                raise ValueError(f"{where}: a prefix has depth >= 1 (at least one turn)")
            if not isinstance(self.source, str) or not self.source:
                raise ValueError(f"{where}: a prefix names its source trajectory")
            if isinstance(self.position, bool) or not isinstance(self.position, int) or self.position < 1:
                raise ValueError(f"{where}: a prefix's position must be an integer >= 1")

    @classmethod
    def root(cls, id: str, features: Sequence[float], group: str | None = None) -> Candidate:
        """A prompt root (group defaults to the id)."""
        return cls(id, group or id, CandidateKind.ROOT, tuple(float(x) for x in features))


@dataclass(frozen=True)
class Allocation:
    """Rollouts per candidate (`counts[i]` for `candidates[i]`, the input order).
    `predicted` holds each candidate's predicted success probability (None for an
    allocation that used no predictor); `expected_mixed` sum_c P_c(m_c) under those."""

    method: AllocationName
    candidates: tuple[str, ...]
    counts: tuple[int, ...]
    budget: int
    predicted: tuple[float, ...] | None = None
    expected_mixed: float | None = None

    @property
    def used(self) -> int:
        return sum(self.counts)

    def count(self, candidate_id: str) -> int:
        try:
            return self.counts[self.candidates.index(candidate_id)]
        except ValueError:
            raise KeyError(f"no candidate {candidate_id!r} in this allocation") from None

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.candidates, self.counts, strict=True))


def mixed_probability(v: np.ndarray | float, m: np.ndarray | int, successes: np.ndarray | int = 0,
                      failures: np.ndarray | int = 0) -> np.ndarray:
    """P(the node's outcomes are mixed after m new rollouts), elementwise (module docstring)."""
    v = np.asarray(v, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64)
    s = np.asarray(successes) > 0
    f = np.asarray(failures) > 0
    fresh = 1.0 - v ** m - (1.0 - v) ** m
    fresh = np.where(m >= 1, fresh, 0.0)
    out = np.where(s & f, 0.0, np.where(s, 1.0 - v ** m, np.where(f, 1.0 - (1.0 - v) ** m, fresh)))
    return np.asarray(out, dtype=np.float64)


def group_mixed_probability(v: np.ndarray, m: np.ndarray, successes: int, failures: int) -> float:
    """P(a group's outcomes are mixed) after m[c] new rollouts from each of its candidates
    c (success probabilities v[c]), given the group's `successes` / `failures` so far
    (module docstring, "Group objective"); 0 for a group already mixed, as for a node
    (nothing left to gain)."""
    if successes and failures:
        return 0.0
    if not m.sum():
        return 0.0
    all_win = float(np.prod(v ** m))
    all_lose = float(np.prod((1.0 - v) ** m))
    if successes:
        return 1.0 - all_win
    if failures:
        return 1.0 - all_lose
    return max(0.0, 1.0 - all_win - all_lose)


def allocate(roots: Sequence[Candidate], budget: int, predictor: SuccessPredictor | None, *, seed: int = 0,
             min_per_root: int = 0, group_outcomes: Mapping[str, tuple[int, int]] | None = None) -> Allocation:
    """TRACE's greedy marginal allocation of `budget` rollouts over the candidates (roots
    and prefixes alike; module docstring). `min_per_root` rollouts are first given to
    every root (an exploration floor). Never uses more than `budget`. A predictor of None
    predicts 0.5 everywhere (before any training data: prefixes are then ranked by their
    observed outcomes alone). `group_outcomes` (group -> (successes, failures) observed
    in the whole group): maximise the number of *groups* with mixed outcomes instead
    (`allocate_groups`)."""
    if group_outcomes is not None:
        if min_per_root:
            raise ValueError("min_per_root: a floor per root belongs to the node objective; "
                             "the group objective (group_outcomes) takes none")
        return allocate_groups(roots, budget, predictor, group_outcomes, seed=seed)
    cands = _check_candidates(roots)
    budget = _budget(budget)
    if isinstance(min_per_root, bool) or not isinstance(min_per_root, int) or min_per_root < 0:
        raise ValueError(f"min_per_root: must be an integer >= 0 (got {min_per_root!r})")
    n = len(cands)
    if n == 0:
        return Allocation(AllocationName.TRACE, (), (), budget, (), 0.0)
    v, succ, fail = _predicted(cands, predictor)
    is_root = np.array([c.kind is CandidateKind.ROOT for c in cands])
    fresh = (succ == 0) & (fail == 0)  # nothing observed below: the first step is a pair
    m = np.zeros(n, dtype=np.int64)
    floor = min_per_root * int(is_root.sum())
    if floor > budget:
        raise ValueError(f"min_per_root: {min_per_root} rollouts for each of {int(is_root.sum())} roots "
                         f"exceed the budget {budget}")
    m[is_root] = min_per_root
    left = budget - floor
    rank = np.empty(n, dtype=np.int64)
    rank[np.random.default_rng(seed).permutation(n)] = np.arange(n)
    while left > 0:
        # a fresh node's first step is a pair when two rollouts are left (P(1) = 0)
        step = np.where(fresh & (m == 0) & (left >= 2), 2, 1)
        now = mixed_probability(v, m, succ, fail)
        gain = (mixed_probability(v, m + step, succ, fail) - now) / step
        best = gain.max()
        tied = np.flatnonzero(gain == best)
        tied = tied[step[tied] == step[tied].max()]  # at equal gain a pair first
        i = int(tied[np.argmin(rank[tied])])
        m[i] += step[i]
        left -= int(step[i])
    m = _repair(m, v, succ, fail, floor=np.where(is_root, min_per_root, 0))
    expected = float(mixed_probability(v, m, succ, fail).sum())
    return Allocation(AllocationName.TRACE, tuple(c.id for c in cands), tuple(int(k) for k in m), budget,
                      tuple(float(p) for p in v), expected)


def allocate_groups(cands: Sequence[Candidate], budget: int, predictor: SuccessPredictor | None,
                    group_outcomes: Mapping[str, tuple[int, int]], *, seed: int = 0) -> Allocation:
    """The group objective (module docstring): maximise sum_g P_g, the chance that group g's
    outcomes end mixed, over its candidates' counts; greedy marginal allocation, each
    rollout to the candidate whose group gains most per rollout (a pair where the group
    has no outcome yet and no rollout allotted: one alone gains nothing); at equal group
    gain (every group already mixed, say) the node objective's gain decides, then a
    permutation drawn from `seed`. The whole budget is spent when there is a candidate;
    it is never exceeded. `expected_mixed` is sum_g P_g."""
    cands = _check_candidates(cands)
    budget = _budget(budget)
    n = len(cands)
    if n == 0:
        return Allocation(AllocationName.TRACE, (), (), budget, (), 0.0)
    for c in cands:
        got = group_outcomes.get(c.group)
        if got is None:
            raise ValueError(f"group_outcomes: no outcomes given for group {c.group!r} (candidate {c.id!r})")
        if len(got) != 2 or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in got):
            raise ValueError(f"group_outcomes[{c.group!r}]: must be (successes, failures), integers >= 0")
    v, succ, fail = _predicted(cands, predictor)
    by_group: dict[str, list[int]] = {}
    for i, c in enumerate(cands):
        by_group.setdefault(c.group, []).append(i)
    members = {g: np.array(ix, dtype=np.int64) for g, ix in by_group.items()}
    group_of = [c.group for c in cands]
    m = np.zeros(n, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    rank[np.random.default_rng(seed).permutation(n)] = np.arange(n)

    def p_group(g: str, counts: np.ndarray) -> float:
        ix = members[g]
        s, f = group_outcomes[g]
        return group_mixed_probability(v[ix], counts[ix], s, f)

    left = budget
    while left > 0:
        now = {g: p_group(g, m) for g in members}
        node_now = mixed_probability(v, m, succ, fail)
        best, pick = None, None
        for i in range(n):
            g = group_of[i]
            s, f = group_outcomes[g]
            fresh = not s and not f and not m[members[g]].sum()
            step = 2 if fresh and left >= 2 else 1
            trial = m.copy()
            trial[i] += step
            gain = (p_group(g, trial) - now[g]) / step
            node = (float(mixed_probability(v[i], m[i] + step, succ[i], fail[i])) - float(node_now[i])) / step
            key = (round(gain, 12), round(node, 12), step, -int(rank[i]))
            if best is None or key > best:
                best, pick = key, (i, step)
        i, step = pick
        m[i] += step
        left -= step
    expected = float(sum(p_group(g, m) for g in members))
    return Allocation(AllocationName.TRACE, tuple(c.id for c in cands), tuple(int(k) for k in m), budget,
                      tuple(float(p) for p in v), expected)


def _repair(m: np.ndarray, v: np.ndarray, succ: np.ndarray, fail: np.ndarray, floor: np.ndarray,
            max_moves: int = 100_000) -> np.ndarray:
    """Local repair after the greedy pass: move one or two rollouts from one candidate to
    another, a pair from two candidates to a third, or one candidate's pair to two others,
    while that raises sum_c P_c(m_c) by more than 1e-12 (a fresh node's first pair makes the
    objective non-concave, where the greedy pass can strand the budget's last rollout).
    Keeps the total and every root's floor; the objective rises strictly, so it ends."""
    m = m.copy()
    n = m.size
    if n < 2:
        return m
    for _ in range(max_moves):
        now = mixed_probability(v, m, succ, fail)
        best_delta, move = 1e-12, None
        for d in (1, 2):
            gain = mixed_probability(v, m + d, succ, fail) - now
            loss = np.where(m - d >= floor, now - mixed_probability(v, np.maximum(m - d, 0), succ, fail), np.inf)
            jo = np.argsort(-gain, kind="stable")[:2]
            io = np.argsort(loss, kind="stable")[:2]
            for j in jo:
                for i in io:
                    if i != j and gain[j] - loss[i] > best_delta:
                        best_delta, move = float(gain[j] - loss[i]), ("one", int(i), int(j), d)
        # a pair from two donors (one rollout each), or one donor's pair to two recipients
        gain1 = mixed_probability(v, m + 1, succ, fail) - now
        loss1 = np.where(m - 1 >= floor, now - mixed_probability(v, np.maximum(m - 1, 0), succ, fail), np.inf)
        gain2 = mixed_probability(v, m + 2, succ, fail) - now
        loss2 = np.where(m - 2 >= floor, now - mixed_probability(v, np.maximum(m - 2, 0), succ, fail), np.inf)
        for j in np.argsort(-gain2, kind="stable")[:3]:
            donors = [int(i) for i in np.argsort(loss1, kind="stable")[:3] if i != j][:2]
            if len(donors) == 2 and gain2[j] - loss1[donors].sum() > best_delta:
                best_delta, move = float(gain2[j] - loss1[donors].sum()), ("pair-in", donors, int(j))
        for i in np.argsort(loss2, kind="stable")[:3]:
            takers = [int(j) for j in np.argsort(-gain1, kind="stable")[:3] if j != i][:2]
            if len(takers) == 2 and gain1[takers].sum() - loss2[i] > best_delta:
                best_delta, move = float(gain1[takers].sum() - loss2[i]), ("pair-out", int(i), takers)
        if move is None:
            break
        if move[0] == "pair-in":
            m[move[1]] -= 1
            m[move[2]] += 2
        elif move[0] == "pair-out":
            m[move[1]] -= 2
            m[move[2]] += 1
        else:
            _, i, j, d = move
            m[i] -= d
            m[j] += d
    return m


def uniform_allocation(roots: Sequence[Candidate], budget: int, *, seed: int = 0) -> Allocation:
    """The baseline: `budget // R` rollouts per root (R roots), the remainder one each to
    roots picked by a permutation drawn from `seed`; prefixes get none."""
    cands = _check_candidates(roots)
    budget = _budget(budget)
    idx = [i for i, c in enumerate(cands) if c.kind is CandidateKind.ROOT]
    counts = [0] * len(cands)
    if idx:
        base, extra = divmod(budget, len(idx))
        for i in idx:
            counts[i] = base
        for j in np.random.default_rng(seed).permutation(len(idx))[:extra]:
            counts[idx[int(j)]] += 1
    return Allocation(AllocationName.UNIFORM, tuple(c.id for c in cands), tuple(counts), budget)


def prefix_candidates(group: Sequence[Trajectory], rewards: Sequence[float], prompt_features: Sequence[float], *,
                      success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                      buckets: int = DEFAULT_HASH_BUCKETS) -> list[Candidate]:
    """One prefix candidate per distinct history of t >= 1 steps that some rollout of the
    group continues from (t < T_i), in first-seen order: outcomes below it binarised as
    `reward >= success_threshold`, branching from its first rollout, right before turn t.
    Ids are `GROUP/tDEPTH/N`."""
    r = unit_rewards(rewards, len(group))
    out = []
    for n, (history, members) in enumerate((h, mem) for h, mem in node_histories(group).items() if h):
        first = group[members[0]]
        assert first.turns is not None
        wins = int(sum(r[i] >= success_threshold for i in members))
        out.append(Candidate(f"{first.group}/t{len(history)}/{n}", first.group, CandidateKind.PREFIX,
                             prefix_features(prompt_features, history, buckets=buckets), wins,
                             len(members) - wins, len(history), first.id, first.turns[len(history)].start))
    return out


class TraceAllocator:
    """TRACE with its predictor kept across steps: what a training loop holds.

    `root(id, prompt_features)` and `prefixes(group, rewards, prompt_features)` build
    candidates with this allocator's feature layout; `allocate(candidates, budget)` spends
    a budget (tie-break seed `seed + the number of earlier calls`, so a run is reproducible
    from `seed`; before the first `observe` the predictor is None, 0.5 everywhere);
    `observe(group, rewards, prompt_features)` trains the predictor on the group's
    recursive targets once it is scored."""

    def __init__(self, n_prompt_features: int, *, buckets: int = DEFAULT_HASH_BUCKETS, seed: int = 0,
                 min_per_root: int = 0, success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                 predictor: LogisticPredictor | None = None):
        if isinstance(n_prompt_features, bool) or not isinstance(n_prompt_features, int) or n_prompt_features < 0:
            raise ValueError(f"n_prompt_features: must be an integer >= 0 (got {n_prompt_features!r})")
        self.n_prompt_features = n_prompt_features
        self.buckets = buckets
        self.seed = seed
        self.min_per_root = min_per_root
        self.success_threshold = success_threshold
        self.predictor = predictor or LogisticPredictor(feature_count(n_prompt_features, buckets=buckets))
        self.calls = 0

    def root(self, id: str, prompt_features: Sequence[float], group: str | None = None) -> Candidate:
        return Candidate.root(id, prefix_features(self._prompt(prompt_features), (), buckets=self.buckets), group)

    def prefixes(self, group: Sequence[Trajectory], rewards: Sequence[float],
                 prompt_features: Sequence[float]) -> list[Candidate]:
        return prefix_candidates(group, rewards, self._prompt(prompt_features),
                                 success_threshold=self.success_threshold, buckets=self.buckets)

    def allocate(self, candidates: Sequence[Candidate], budget: int,
                 group_outcomes: Mapping[str, tuple[int, int]] | None = None) -> Allocation:
        """`allocate` with this allocator's predictor (`group_outcomes`: the group objective)."""
        trained = self.predictor if self.predictor.updates else None
        out = allocate(candidates, budget, trained, seed=self.seed + self.calls, min_per_root=self.min_per_root,
                       group_outcomes=group_outcomes)
        self.calls += 1
        return out

    def observe(self, group: Sequence[Trajectory], rewards: Sequence[float],
                prompt_features: Sequence[float]) -> float:
        """Train on the group's recursive targets; returns the predictor's loss after it."""
        x, y, w = node_targets(group, rewards, self._prompt(prompt_features), buckets=self.buckets)
        return self.predictor.update(x, y, w)

    def _prompt(self, prompt_features: Sequence[float]) -> list[float]:
        f = [float(x) for x in prompt_features]
        if len(f) != self.n_prompt_features:
            raise ValueError(f"prompt_features: {len(f)} values, this allocator takes {self.n_prompt_features}")
        return f


def mixed_share(outcomes: Sequence[Sequence[float]], *, success_threshold: float = DEFAULT_SUCCESS_THRESHOLD) -> float:
    """Share of the given outcome lists (one per prompt; empty when it got no rollouts)
    that hold both a success and a failure."""
    if len(outcomes) == 0:
        raise ValueError("outcomes: no prompts")
    mixed = 0
    for o in outcomes:
        wins = [x >= success_threshold for x in o]
        mixed += any(wins) and not all(wins)
    return mixed / len(outcomes)


def _check_candidates(cands: Sequence[Candidate]) -> list[Candidate]:
    out = list(cands)
    for c in out:
        if not isinstance(c, Candidate):
            raise ValueError(f"candidates: {c!r} is not a Candidate")
    ids = [c.id for c in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"candidates: duplicate id {dup!r}")
    if len({len(c.features) for c in out}) > 1:
        raise ValueError("candidates: feature rows of different lengths")
    return out


def _predicted(cands: list[Candidate], predictor: SuccessPredictor | None) -> tuple[np.ndarray, ...]:
    """Each candidate's predicted success probability (0.5 without a predictor, checked to
    be one probability per candidate) and its observed successes and failures."""
    n = len(cands)
    x = _feature_matrix(cands)
    v = np.full(n, 0.5) if predictor is None else np.asarray(predictor.predict(x), dtype=np.float64)
    if v.shape != (n,) or not np.isfinite(v).all() or (v < 0).any() or (v > 1).any():
        raise ValueError(f"predictor: must return {n} probabilities in [0, 1]")
    return v, np.array([c.successes for c in cands]), np.array([c.failures for c in cands])


def _feature_matrix(cands: list[Candidate]) -> np.ndarray:
    return np.array([c.features for c in cands], dtype=np.float64).reshape(len(cands), -1)


def _budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget: must be an integer >= 0 (got {budget!r})")
    return int(budget)


