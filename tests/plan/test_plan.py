"""The step Plan: validation fails loudly on every broken invariant, JSON round-trips
exactly, metrics match hand-computed values, cost models price segments correctly."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.config.costs import (
    TINY_PAIR_WEIGHT,
    LoadModelName,
    TokenCost,
    TokenPairCost,
    known_load_models,
    make_load_model,
    register_load_model,
)
from harts.plan.metrics import compute_metrics, per_slot_balance, slot_loads
from harts.plan.plan import Microbatch, Piece, Plan, PlanMode, Role, forest_digest
from harts.plan.planners import make_plan
from harts.tree.build import build_structure
from tests.strategies import plan_configs, plan_forests

COST = TokenCost()


def small_forest():
    """g0: root (10 tokens) forking into A (5) and B (7); g1: one 6-token node.
    Nodes in preorder: 0 root, 1 A, 2 B, 3 g1. Trajectories: 0 -> A, 1 -> B, 2 -> g1."""
    seqs = [np.array([0, 1]), np.array([0, 2]), np.array([3])]
    return build_structure(seqs, ["g0", "g0", "g1"], ["t0", "t1", "t2"], np.array([10, 5, 7, 6]))


def mb(forest, id, replica, slot, order, trajs, pieces, context=(), producer=None) -> Microbatch:
    pieces = tuple(Piece(*p) for p in pieces)
    start = forest.node_start
    s = np.array([start[p.node] + p.start for p in pieces])
    e = np.array([start[p.node] + p.end for p in pieces])
    return Microbatch(
        id=id, replica=replica, slot=slot, order=order, trajectories=tuple(trajs), pieces=pieces,
        context=tuple(Piece(*p) for p in context), producer=producer,
        executed_tokens=sum(p.length for p in pieces),
        expanded_tokens=int(forest.traj_length[list(trajs)].sum()) if trajs else 0,
        cost=float(COST.segment_cost(s, e).sum()),
    )


def window_plan(forest, retention: float = 1.0, budget: int = 100) -> Plan:
    """A producer computing the g0 root for two consumers, on one replica."""
    return Plan(
        mode=PlanMode.TREE, planner="hand", dp=1, microbatch_tokens=budget,
        producer_retention=retention, cost_model=COST.spec(), forest=forest_digest(forest),
        microbatches=(
            mb(forest, 0, 0, 0, 0, (), [(0, 0, 10)]),
            mb(forest, 1, 0, 0, 1, (0,), [(1, 0, 5)], [(0, 0, 10)], 0),
            mb(forest, 2, 0, 1, 2, (1, 2), [(2, 0, 7), (3, 0, 6)], [(0, 0, 10)], 0),
        ),
    )


def test_forest_shape():
    f = small_forest()
    assert f.node_parent.tolist() == [-1, 0, 0, -1]
    assert f.node_length.tolist() == [10, 5, 7, 6]
    assert f.traj_node.tolist() == [1, 2, 3]


def test_window_plan_is_valid_and_measured():
    f = small_forest()
    plan = window_plan(f)
    plan.validate(f, cost_model=COST)
    assert plan.consumers() == {0: [1, 2]}
    assert [plan.role(i) for i in range(3)] == [Role.PRODUCER, Role.CONSUMER, Role.CONSUMER]
    assert plan.memory_tokens() == [10.0, 15.0, 23.0]
    m = compute_metrics(plan, f)
    assert m.executed_tokens == 28 and m.expanded_tokens == 38
    assert m.compression == pytest.approx(38 / 28)
    # the producer's forward third lands with its first consumer, the rest with its last
    loads = slot_loads(plan)
    assert loads[:, 0] == pytest.approx([5 + 10 / 3, 13 + 20 / 3])
    assert m.slots == 2 and m.slot_balance == 1.0


def test_metrics_on_two_replicas():
    f = small_forest()
    plan = Plan(
        mode=PlanMode.TREE, planner="hand", dp=2, microbatch_tokens=100, cost_model=COST.spec(),
        microbatches=(
            mb(f, 0, 0, 0, 0, (0,), [(0, 0, 10), (1, 0, 5)]),
            mb(f, 1, 0, 1, 1, (2,), [(3, 0, 6)]),
            mb(f, 2, 1, 0, 0, (1,), [(0, 0, 10), (2, 0, 7)]),
        ),
    )
    plan.validate(f, cost_model=COST)
    assert slot_loads(plan).tolist() == [[15, 17], [6, 0]]
    assert per_slot_balance(plan) == pytest.approx([16 / 17, 0.5])
    m = compute_metrics(plan, f)
    assert m.slot_balance == pytest.approx((16 / 17 + 0.5) / 2)
    assert m.balance_p5 == pytest.approx(np.percentile([16 / 17, 0.5], 5))
    assert m.step_balance == pytest.approx(19 / 21)
    # the root is computed twice: no compression at all
    assert m.compression == pytest.approx(1.0)


def test_expanded_plan():
    f = small_forest()
    lengths = f.traj_length.tolist()
    mbs = (
        Microbatch(0, 0, 0, 0, (0, 2), executed_tokens=21, expanded_tokens=21,
                   cost=float(lengths[0] + lengths[2])),
        Microbatch(1, 1, 0, 0, (1,), executed_tokens=17, expanded_tokens=17, cost=17.0),
    )
    plan = Plan(mode=PlanMode.EXPANDED, planner="hand", dp=2, microbatch_tokens=21,
                microbatches=mbs, cost_model=COST.spec())
    plan.validate(f, cost_model=COST)
    assert compute_metrics(plan, f).compression == 1.0
    with pytest.raises(ValueError, match="budget 20"):
        plan.validate(f, budget=20)


def _replace_mb(plan: Plan, i: int, **changes) -> Plan:
    mbs = list(plan.microbatches)
    mbs[i] = dataclasses.replace(mbs[i], **changes)
    return dataclasses.replace(plan, microbatches=tuple(mbs))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: _replace_mb(p, 1, trajectories=(0, 1), expanded_tokens=32),
         "owned by microbatches"),
        (lambda p: _replace_mb(p, 2, trajectories=(1,), expanded_tokens=17),
         "owned by no microbatch"),
        (lambda p: _replace_mb(p, 1, context=()), "names producer 0 but reads no context"),
        (lambda p: _replace_mb(p, 1, context=(Piece(0, 0, 4),)), "needs rows \\[0, 10\\) of node 0"),
        (lambda p: _replace_mb(p, 1, context=(Piece(3, 0, 6),)), "not computed by its producer"),
        (lambda p: _replace_mb(_replace_mb(p, 0, order=2), 2, order=0), "not scheduled before it"),
        (lambda p: _replace_mb(p, 2, executed_tokens=12), "executed_tokens 12 != 13"),
        (lambda p: _replace_mb(p, 2, pieces=(Piece(2, 0, 7), Piece(3, 0, 6), Piece(3, 2, 4)),
                               executed_tokens=15), "pieces overlap"),
        (lambda p: _replace_mb(p, 2, pieces=(Piece(2, 0, 9), Piece(3, 0, 6))),
         "outside node 2 of length 7"),
        (lambda p: _replace_mb(p, 0, pieces=(Piece(0, 0, 10), Piece(3, 0, 6)), executed_tokens=16),
         "neither its trajectories nor its consumers need"),
        # a producer may have a producer (a chain of windows), but never a later one: a
        # cycle is caught by the order
        (lambda p: _replace_mb(p, 0, producer=1), "producer 1 is not scheduled before it"),
        (lambda p: _replace_mb(p, 2, slot=0), "slot 0: microbatches 1 and 2"),
        (lambda p: _replace_mb(p, 2, cost=1.0), "cost 1.0 != 13.0"),
        (lambda p: _replace_mb(p, 2, id=5), "ids must equal positions"),
        (lambda p: dataclasses.replace(p, forest={"nodes": 1}), "different forest"),
        (lambda p: dataclasses.replace(p, microbatch_tokens=22), "needs 23 tokens of memory"),
    ],
)
def test_validation_fails_loudly(mutate, message):
    f = small_forest()
    plan = window_plan(f)
    plan.validate(f, cost_model=COST)
    with pytest.raises(ValueError, match=message):
        mutate(plan).validate(f, cost_model=COST)


def test_producer_on_another_replica_is_rejected():
    f = small_forest()
    plan = dataclasses.replace(window_plan(f), dp=2)
    bad = _replace_mb(plan, 2, replica=1, order=0)
    with pytest.raises(ValueError, match="producer 0 is on replica 0, the consumer on replica 1"):
        bad.validate(f)


def test_overlapping_windows_are_rejected():
    f = small_forest()
    # producer 0 (the g0 root) serves 2 and 4; producer 1 (g1's first 3 rows) serves 3,
    # inside the first window
    mbs = (
        mb(f, 0, 0, 0, 0, (), [(0, 0, 10)]),
        mb(f, 1, 0, 0, 1, (), [(3, 0, 3)]),
        mb(f, 2, 0, 0, 2, (0,), [(1, 0, 5)], [(0, 0, 10)], 0),
        mb(f, 3, 0, 1, 3, (2,), [(3, 3, 6)], [(3, 0, 3)], 1),
        mb(f, 4, 0, 2, 4, (1,), [(2, 0, 7)], [(0, 0, 10)], 0),
    )
    plan = dataclasses.replace(window_plan(f), microbatches=mbs)
    with pytest.raises(ValueError, match="sharing windows overlap"):
        plan.validate(f)
    # the same microbatches with the windows one after the other are fine
    serial = (mbs[0], dataclasses.replace(mbs[2], id=1, order=1, context=((Piece(0, 0, 10)),)),
              dataclasses.replace(mbs[4], id=2, slot=1, order=2),
              dataclasses.replace(mbs[1], id=3, slot=2, order=3),
              dataclasses.replace(mbs[3], id=4, slot=2, order=4, producer=3))
    dataclasses.replace(plan, microbatches=serial).validate(f)


def test_retention_charges_the_window():
    f = small_forest()
    assert window_plan(f, retention=0.5).memory_tokens() == [10.0, 10.0, 18.0]
    window_plan(f, retention=0.5, budget=18).validate(f)
    with pytest.raises(ValueError, match="retained by a producer"):
        window_plan(f, retention=1.0, budget=18).validate(f)


def test_json_round_trip_is_exact(tmp_path):
    f = small_forest()
    plan = dataclasses.replace(window_plan(f), plan_seconds=0.1 + 0.2, info={"note": [1, 2.5]})
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    # one line per microbatch: plans diff line by line
    lines = text.splitlines()
    assert sum(1 for line in lines if line.lstrip().startswith('{"id"')) == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "plan JSON"),
        ("[1, 2]", "expected an object"),
        (json.dumps({"format": "other"}), "not a plan file"),
        (json.dumps({"format": "harts-plan/1", "mode": "tree"}), "missing or malformed field"),
        (json.dumps({"format": "harts-plan/1", "mode": "wide"}), "plan mode 'wide'"),
    ],
)
def test_bad_json_is_rejected(text, message):
    with pytest.raises(ValueError, match=message):
        Plan.from_json(text)


@given(plan_forests().flatmap(lambda f: st.tuples(st.just(f), plan_configs(f))),
       st.sampled_from(["expanded-ffd", "l1", "l1l2"]))
def test_planned_json_round_trip(forest_config, planner):
    forest, config = forest_config
    plan = make_plan(forest, planner, config)
    back = Plan.from_json(plan.to_json())
    assert back == plan
    back.validate(forest, cost_model=config.cost_model)


# ---- cost models ------------------------------------------------------------------------


@given(st.integers(0, 5000), st.integers(1, 300), st.floats(0, 1e-3), st.floats(0.1, 3))
def test_token_pair_cost_matches_brute_force(start, length, pair_weight, token_weight):
    cm = TokenPairCost(pair_weight=pair_weight, token_weight=token_weight)
    depths = np.arange(start, start + length)
    brute = token_weight * length + pair_weight * float((depths + 1).sum())
    got = float(cm.segment_cost(np.array([start]), np.array([start + length]))[0])
    assert got == pytest.approx(brute, rel=1e-12)


def test_cost_is_additive_over_a_split():
    cm = TokenPairCost()
    whole = cm.segment_cost(np.array([100]), np.array([9000]))[0]
    parts = cm.segment_cost(np.array([100, 4000]), np.array([4000, 9000])).sum()
    assert whole == pytest.approx(parts, rel=1e-12)


def test_pair_weight_derived_from_the_tiny_model():
    from harts.config.models import get_model_config
    from harts.config.param_counts import parameter_counts

    tiny = get_model_config("tiny")
    derived = TokenPairCost.for_model(tiny, parameter_counts(tiny).active)
    assert derived.pair_weight == pytest.approx(TINY_PAIR_WEIGHT, rel=1e-3)


def test_cost_model_registry():
    assert known_load_models() == ["token-pair", "tokens"]
    cm = TokenPairCost(pair_weight=2e-5, microbatch_overhead=3.0)
    assert make_load_model(**cm.spec()) == cm
    assert make_load_model("tokens") == TokenCost()
    with pytest.raises(ValueError, match="unknown cost model 'flops'; known: token-pair, tokens"):
        make_load_model("flops")
    with pytest.raises(ValueError, match="registered twice"):
        register_load_model(LoadModelName.TOKENS, TokenCost)
