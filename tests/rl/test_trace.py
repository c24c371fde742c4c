"""TRACE allocation: never over budget, deterministic for a seed, optimal on small cases,
the mixed-outcome objective against enumeration, the predictor and its recursive targets,
and a higher share of prompts with mixed rewards than uniform allocation on a simulated
set of prompts with known success probabilities."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.rl.trace import (
    AllocationName,
    Candidate,
    CandidateKind,
    TraceAllocator,
    allocate,
    group_mixed_probability,
    mixed_probability,
    mixed_share,
    prefix_candidates,
    uniform_allocation,
)
from harts.rl.trace_predictor import LogisticPredictor, feature_count, node_targets, prefix_features
from harts.tree.trajectory import Trajectory
from tests.strategies import trace_candidates, trace_grouped_candidates, trace_small_cases


class FirstFeature:
    """An oracle predictor: the first feature is the success probability."""

    def predict(self, features):
        return np.asarray(features, dtype=np.float64)[:, 0]


def _predictor(draw_weights, n_features=3):
    p = LogisticPredictor(n_features)
    p.weights = np.asarray(draw_weights, dtype=np.float64)
    return p


weights = st.lists(st.floats(-3, 3, allow_nan=False), min_size=3, max_size=3)


@given(trace_candidates(), st.integers(0, 40), weights, st.integers(0, 2**31), st.integers(0, 2))
def test_never_exceeds_the_budget_and_spends_it(cands, budget, w, seed, floor):
    roots = sum(c.kind is CandidateKind.ROOT for c in cands)
    if floor * roots > budget:
        with pytest.raises(ValueError, match="min_per_root"):
            allocate(cands, budget, _predictor(w), seed=seed, min_per_root=floor)
        return
    a = allocate(cands, budget, _predictor(w), seed=seed, min_per_root=floor)
    assert a.method is AllocationName.TRACE and a.candidates == tuple(c.id for c in cands)
    assert all(k >= 0 for k in a.counts) and a.used <= budget
    assert a.used == (budget if cands else 0)
    assert all(k >= floor for c, k in zip(cands, a.counts, strict=True) if c.kind is CandidateKind.ROOT)
    u = uniform_allocation(cands, budget, seed=seed)
    assert u.used <= budget and u.used == (budget if roots else 0)
    root_counts = [k for c, k in zip(cands, u.counts, strict=True) if c.kind is CandidateKind.ROOT]
    assert not root_counts or max(root_counts) - min(root_counts) <= 1
    assert all(k == 0 for c, k in zip(cands, u.counts, strict=True) if c.kind is CandidateKind.PREFIX)


@given(trace_candidates(), st.integers(0, 40), weights, st.integers(0, 2**31))
def test_the_same_seed_gives_the_same_allocation(cands, budget, w, seed):
    a = allocate(cands, budget, _predictor(w), seed=seed)
    b = allocate(list(cands), budget, _predictor(list(w)), seed=seed)
    assert a == b
    assert uniform_allocation(cands, budget, seed=seed) == uniform_allocation(cands, budget, seed=seed)


def test_ties_follow_the_seed():
    roots = [Candidate.root(f"p{i}", (0.5,)) for i in range(6)]
    picks = {allocate(roots, 2, FirstFeature(), seed=s).counts for s in range(20)}
    assert len(picks) > 1  # equal gains: which root gets the pair depends on the seed
    assert all(sorted(p) == [0, 0, 0, 0, 0, 2] for p in picks)


@given(trace_small_cases())
def test_matches_the_optimum_of_small_cases(case):
    cands, budget = case
    a = allocate(cands, budget, FirstFeature())
    v = np.array([c.features[0] for c in cands])
    s = np.array([c.successes for c in cands])
    f = np.array([c.failures for c in cands])
    best = max(mixed_probability(v, np.array(m), s, f).sum()
               for m in itertools.product(range(budget + 1), repeat=len(cands)) if sum(m) == budget)
    assert a.expected_mixed == pytest.approx(float(mixed_probability(v, np.array(a.counts), s, f).sum()), abs=1e-12)
    assert a.expected_mixed >= best - 1e-9


@given(st.floats(0, 1), st.integers(0, 7), st.integers(0, 2), st.integers(0, 2))
def test_mixed_probability_against_enumeration(v, m, succ, fail):
    exact = 0.0
    for outcome in itertools.product((0, 1), repeat=m):
        k = sum(outcome)
        wins, losses = succ + k, fail + m - k
        if wins > 0 and losses > 0:
            exact += v ** k * (1 - v) ** (m - k)
    already = succ > 0 and fail > 0
    expected = 0.0 if already else exact  # an already mixed node gains nothing
    assert float(mixed_probability(v, m, succ, fail)) == pytest.approx(expected, abs=1e-12)


def test_uncertain_prompts_get_more_rollouts():
    roots = [Candidate.root(f"p{i}", (v,)) for i, v in enumerate((0.01, 0.5, 0.99, 0.3))]
    a = allocate(roots, 12, FirstFeature())
    # near-certain prompts get nothing while uncertain ones still gain from more rollouts
    assert a.count("p0") == a.count("p2") == 0 and a.count("p1") >= 2 and a.count("p3") >= 2
    # a prefix whose rollouts all failed, with a likely success ahead, is worth expanding
    pre = Candidate("g/t1/0", "g", CandidateKind.PREFIX, (0.6,), 0, 2, 1, "r0", 5)
    done = Candidate("g/t1/1", "g", CandidateKind.PREFIX, (0.6,), 1, 1, 1, "r1", 5)
    b = allocate([pre, done], 3, FirstFeature())
    assert b.count("g/t1/0") == 3 and b.count("g/t1/1") == 0


def _sim_prompts(rng, n):
    """Known success probabilities, most prompts nearly always solved or never: 40 % in
    [0, 0.05], 40 % in [0.95, 1], 20 % in [0.15, 0.85]; the feature is the log-odds plus
    noise (a predictor that is informative, not exact)."""
    kind = rng.choice(3, n, p=[0.4, 0.4, 0.2])
    p = np.where(kind == 0, rng.uniform(0, 0.05, n), np.where(kind == 1, rng.uniform(0.95, 1, n),
                                                               rng.uniform(0.15, 0.85, n)))
    x = (np.log(p / (1 - p)) + rng.normal(0, 0.5, n)) / 5
    return p, x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_more_prompts_with_mixed_rewards_than_uniform_at_the_same_budget(seed):
    # Bernoulli model of prompts; the predictor is trained online on the previous step's
    # prompts (uniform rollouts, recursive target = mean reward at the root), then TRACE and
    # uniform spend the same budget on new prompts.
    rng = np.random.default_rng(seed)
    n, per = 200, 4
    p0, x0 = _sim_prompts(rng, n)
    pred = LogisticPredictor(1)
    pred.update(x0[:, None], rng.binomial(per, p0) / per, np.full(n, float(per)))
    p, x = _sim_prompts(rng, n)
    roots = [Candidate.root(f"p{i}", (float(x[i]),)) for i in range(n)]
    trace = allocate(roots, per * n, pred, seed=seed)
    uniform = uniform_allocation(roots, per * n, seed=seed)
    assert trace.used == uniform.used == per * n
    shares = []
    for alloc in (trace, uniform):
        m = np.array(alloc.counts)
        expected = float(mixed_probability(p, m).mean())  # under the true probabilities
        draws = rng.binomial(np.broadcast_to(m, (400, n)), p)  # 400 simulated steps
        simulated = ((draws > 0) & (draws < m)).mean(axis=1)
        shares.append((expected, simulated))
    (e_t, s_t), (e_u, s_u) = shares
    assert e_t > e_u + 0.01
    diff = s_t - s_u
    assert diff.mean() > 5 * diff.std() / np.sqrt(diff.size)
    # mixed_share reads outcome lists the same way
    outcomes = [list(rng.binomial(1, p[i], size=k)) for i, k in enumerate(trace.counts)]
    counted = sum(0 < sum(o) < len(o) for o in outcomes) / n
    assert mixed_share(outcomes) == counted


def _group():
    t = lambda s, e, a, o="ok": {"start": s, "end": e, "tool": "search", "args": a, "outcome": o}  # noqa: E731
    return [
        Trajectory.make("r0", "g", list(range(9)), turns=[t(1, 3, "a"), t(4, 6, "b"), t(7, 8, "c")]),
        Trajectory.make("r1", "g", list(range(9)), turns=[t(1, 3, "a"), t(4, 6, "b", "error")]),
        Trajectory.make("r2", "g", list(range(9)), turns=[t(1, 3, "a"), t(5, 6, "z")]),
        Trajectory.make("r3", "g", list(range(4)), turns=[t(1, 2, "q")]),
    ], [1.0, 0.0, 1.0, 0.25]


def test_node_targets_are_mean_rewards_of_the_leaves_below():
    group, r = _group()
    x, y, w = node_targets(group, r, [0.5])
    assert x.shape == (len(y), feature_count(1))
    # nodes: root (4 rollouts), [a] (r0, r1, r2), [a, b] (r0), [a, b(error)]... r1 ends after it
    assert y[0] == pytest.approx(np.mean(r)) and w[0] == 4
    assert list(w) == [4, 3, 1]
    assert y[1] == pytest.approx(np.mean(r[:3])) and y[2] == pytest.approx(1.0)
    # a node's target is the weighted mean over its child nodes and the rollouts whose next step is their last
    assert y[1] * w[1] == pytest.approx(y[2] * w[2] + r[1] + r[2])


def test_prefix_candidates_branch_before_the_next_action():
    group, r = _group()
    cands = prefix_candidates(group, r, [0.5])
    assert [(c.depth, c.source, c.position, c.successes, c.failures) for c in cands] == [
        (1, "r0", 4, 2, 1),  # after step a: continued by r0, r1, r2
        (2, "r0", 7, 1, 0),  # after a, b: continued by r0 only
    ]
    assert all(c.kind is CandidateKind.PREFIX and len(c.features) == feature_count(1) for c in cands)
    a = allocate(cands, 5, LogisticPredictor(feature_count(1)))
    assert a.used == 5


def test_prefix_features_hash_the_history_stably():
    group, _ = _group()
    from harts.rl.signatures import trajectory_signatures

    sigs = trajectory_signatures(group[0])
    f = prefix_features([0.5], sigs[:2])
    assert f == prefix_features([0.5], sigs[:2]) and len(f) == feature_count(1)
    assert f[:3] == (0.5, 1.0, 2.0)
    assert prefix_features([0.5], ())[3:] == (0.0,) * (len(f) - 3)


def test_the_predictor_learns_online():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 2))
    y = 1 / (1 + np.exp(-(2 * x[:, 0] - x[:, 1])))
    p = LogisticPredictor(2, steps=50)
    first = p.update(x, y)
    for _ in range(10):
        last = p.update(x, y)
    assert last < first
    assert np.abs(p.predict(x) - y).mean() < 0.05
    assert p.weights[0] > 1 and p.weights[1] < -0.5
    with pytest.raises(ValueError, match="features"):
        p.predict(np.zeros((3, 5)))
    with pytest.raises(ValueError, match="targets"):
        p.update(x, y + 1)


def test_bad_candidates_and_budgets():
    with pytest.raises(ValueError, match="duplicate id 'p'"):
        allocate([Candidate.root("p", (0.1,)), Candidate.root("p", (0.2,))], 3, FirstFeature())
    with pytest.raises(ValueError, match="budget"):
        allocate([Candidate.root("p", (0.1,))], -1, FirstFeature())
    with pytest.raises(ValueError, match="a prefix names its source"):
        Candidate("x", "g", CandidateKind.PREFIX, (0.1,), 1, 0, 1, None, 3)
    with pytest.raises(ValueError, match="a root has no observed outcomes"):
        Candidate("x", "g", CandidateKind.ROOT, (0.1,), 1, 0)
    with pytest.raises(ValueError, match="predictor"):
        allocate([Candidate.root("p", (0.1,))], 3, type("Bad", (), {"predict": lambda self, x: np.array([2.0])})())
    with pytest.raises(KeyError, match="'q'"):
        uniform_allocation([Candidate.root("p", (0.1,))], 3).count("q")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_expansion_gives_more_mixed_nodes_than_uniform(seed):
    # Bernoulli tree model: each prompt's first rollout reached a turn boundary from which a
    # continuation succeeds with known probability q, and its own outcome was drawn from q.
    # The expansion budget (4 per prompt) goes to these prefixes: uniformly, or by TRACE
    # with a predictor trained on the previous step's prefix nodes (target: mean reward of
    # the rollouts below the node).
    rng = np.random.default_rng(seed)
    n, per = 200, 4

    def prefixes():
        q, x = _sim_prompts(rng, n)
        first = rng.random(n) < q
        cands = [Candidate(f"p{i}/t1", f"p{i}", CandidateKind.PREFIX, (float(x[i]),), int(first[i]),
                           int(not first[i]), 1, f"p{i}-r0", 3) for i in range(n)]
        return q, x, first, cands

    q0, x0, first0, _ = prefixes()
    wins0 = rng.binomial(per, q0)  # the previous step's continuations, uniform
    pred = LogisticPredictor(1)
    pred.update(x0[:, None], (wins0 + first0) / (per + 1), np.full(n, per + 1.0))
    q, _, first, cands = prefixes()
    trace = allocate(cands, per * n, pred, seed=seed)
    uniform_counts = np.full(n, per)
    shares = []
    for m in (np.array(trace.counts), uniform_counts):
        s = first.astype(int)
        f = 1 - s
        expected = float(mixed_probability(q, m, s, f).mean())
        wins = rng.binomial(np.broadcast_to(m, (400, n)), q)
        mixed = (wins + s > 0) & (m - wins + f > 0)
        shares.append((expected, mixed.mean(axis=1)))
    (e_t, s_t), (e_u, s_u) = shares
    assert trace.used == per * n
    assert e_t > e_u + 0.01
    diff = s_t - s_u
    assert diff.mean() > 5 * diff.std() / np.sqrt(diff.size)


def test_trace_allocator_end_to_end():
    group, r = _group()
    a = TraceAllocator(1, seed=3)
    roots = [a.root(f"p{i}", [0.1 * i]) for i in range(4)]
    before = a.allocate(roots, 10)
    assert before.used == 10 and before.predicted == (0.5,) * 4  # untrained: 0.5 everywhere
    loss = a.observe(group, r, [0.5])
    assert np.isfinite(loss) and a.predictor.updates == 1
    prefixes = a.prefixes(group, r, [0.5])
    after = a.allocate(prefixes, 6)
    assert after.used == 6 and after.candidates == tuple(c.id for c in prefixes)
    # the same seed and the same calls give the same allocations
    b = TraceAllocator(1, seed=3)
    assert b.allocate(roots, 10) == before
    b.observe(group, r, [0.5])
    assert b.allocate(prefixes, 6) == after
    with pytest.raises(ValueError, match="prompt_features"):
        a.root("x", [1.0, 2.0])


# ---- the group objective (`group_outcomes`): prompts with mixed outcomes, not nodes ----


@given(trace_grouped_candidates())
def test_group_objective_spends_the_budget_and_is_deterministic(case):
    cands, outcomes, budget, seed = case
    a = allocate(cands, budget, FirstFeature(), seed=seed, group_outcomes=outcomes)
    assert all(k >= 0 for k in a.counts) and a.used == budget
    assert a.counts == allocate(cands, budget, FirstFeature(), seed=seed, group_outcomes=outcomes).counts
    v = np.array([c.features[0] for c in cands])
    m = np.array(a.counts)
    want = sum(group_mixed_probability(v[ix], m[ix], *outcomes[g])
               for g in outcomes for ix in [np.array([i for i, c in enumerate(cands) if c.group == g])] if ix.size)
    assert a.expected_mixed == pytest.approx(want, abs=1e-12)


@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 3)), min_size=1, max_size=3),
       st.integers(0, 2), st.integers(0, 2))
def test_group_mixed_probability_against_enumeration(cm, succ, fail):
    v = np.array([x for x, _ in cm])
    m = np.array([k for _, k in cm])
    p_win = np.repeat(v, m)  # one entry per new rollout
    got = 0.0
    for outcome in itertools.product((0, 1), repeat=int(m.sum())):
        pr = float(np.prod([p if o else 1 - p for p, o in zip(p_win, outcome, strict=True)]))
        wins = succ + sum(outcome)
        losses = fail + len(outcome) - sum(outcome)
        got += pr * (wins > 0 and losses > 0)
    if succ and fail:  # already mixed: as for nodes, nothing left to gain counts 0
        got = 0.0
    assert group_mixed_probability(v, m, succ, fail) == pytest.approx(got, abs=1e-12)


def test_group_objective_skips_groups_already_mixed():
    """A prompt whose rewards are already mixed gains nothing from continuations: the budget
    goes to the prompt that failed everywhere, though its nodes' own chances are lower."""
    cands = [Candidate("a/t1/0", "a", CandidateKind.PREFIX, (0.5,), 0, 2, 1, "t", 1),
             Candidate("a/t1/1", "a", CandidateKind.PREFIX, (0.5,), 1, 0, 1, "t", 1),
             Candidate("b/t1/0", "b", CandidateKind.PREFIX, (0.2,), 0, 3, 1, "t", 1)]
    by_group = allocate(cands, 4, FirstFeature(), group_outcomes={"a": (1, 2), "b": (0, 3)})
    assert by_group.counts == (0, 0, 4)
    by_node = allocate(cands, 4, FirstFeature())
    assert by_node.count("b/t1/0") < 4  # the node objective spends on prompt a's unmixed nodes
    with pytest.raises(ValueError, match="group 'b'"):
        allocate(cands, 4, FirstFeature(), group_outcomes={"a": (1, 2)})
    with pytest.raises(ValueError, match="min_per_root"):
        allocate(cands, 4, FirstFeature(), group_outcomes={"a": (1, 2), "b": (0, 3)}, min_per_root=1)
