"""The ideal speedup: a pure function of per-kind expanded times and work counts, and a
bound the simulator's own step times never exceed."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.models import get_model_config
from harts.sim.flops import (
    WorkKind,
    ideal_speedup,
    simulated_ideal,
    simulated_op_seconds,
    step_work,
    work_counts,
)
from harts.sim.hardware import load_hardware
from harts.tree import build_forest
from harts.tree.trajectory import Trajectory
from tests.strategies import plan_forests


def _traj(name, group, tokens):
    n = len(tokens)
    mask = np.ones(n, bool)
    mask[0] = False
    return Trajectory.make(name, group, np.asarray(tokens), mask, 1.0, np.zeros(n))


def test_ideal_is_the_time_weighted_work_ratio():
    secs = {WorkKind.TOKENS: 3.0, WorkKind.ATTENTION_PAIRS: 1.0, WorkKind.PARAMETERS: 0.5}
    exp = {WorkKind.TOKENS: 100, WorkKind.ATTENTION_PAIRS: 1000, WorkKind.PARAMETERS: 7}
    tree = {WorkKind.TOKENS: 25, WorkKind.ATTENTION_PAIRS: 500, WorkKind.PARAMETERS: 7}
    r = ideal_speedup(secs, exp, tree)
    assert r.ideal == pytest.approx(4.5 / (3.0 * 0.25 + 1.0 * 0.5 + 0.5 * 1.0), rel=1e-12)
    assert r.ideal_tree_seconds() == pytest.approx(1.75, rel=1e-12)
    assert r.to_dict()["work_ratio"]["tokens"] == 0.25
    # string keys are accepted; a kind that takes time needs its work count on both sides
    assert ideal_speedup({"tokens": 1.0}, {"tokens": 4}, {"tokens": 1}).ideal == pytest.approx(4.0)
    with pytest.raises(ValueError, match="attention_pairs"):
        ideal_speedup(secs, {WorkKind.TOKENS: 100, WorkKind.PARAMETERS: 7}, tree)
    with pytest.raises(ValueError, match="expanded work must be > 0"):
        ideal_speedup({"tokens": 1.0}, {"tokens": 0}, {"tokens": 0})
    with pytest.raises(ValueError, match="positive sum"):
        ideal_speedup({"tokens": 0.0}, {"tokens": 1}, {"tokens": 1})


def test_no_sharing_gives_ideal_one():
    f = build_forest([_traj("a", "g0", [1, 2, 3, 4]), _traj("b", "g1", [5, 6, 7])])
    ideal, sim = simulated_ideal(f, get_model_config("tiny-cpu"), load_hardware("h200"))
    assert ideal.ideal == pytest.approx(1.0, rel=1e-12)
    assert sim == pytest.approx(1.0, rel=1e-12)


def test_work_counts_of_a_prefix_pair():
    # b extends a: the tree is one chain of 7 rows; expanded runs 4 + 7 tokens
    f = build_forest([_traj("a", "g", [1, 2, 3, 4]), _traj("b", "g", [1, 2, 3, 4, 5, 6, 7])])
    m = get_model_config("tiny-cpu")
    tree, exp = work_counts(m, step_work(f, "tree", 4)), work_counts(m, step_work(f, "expanded", 4))
    assert (tree[WorkKind.TOKENS], exp[WorkKind.TOKENS]) == (7, 11)
    assert (tree[WorkKind.ATTENTION_PAIRS], exp[WorkKind.ATTENTION_PAIRS]) == (28, 10 + 28)
    assert tree[WorkKind.KDA_TOKENS] == 7 and exp[WorkKind.KDA_TOKENS] == 11
    assert tree[WorkKind.PARAMETERS] == exp[WorkKind.PARAMETERS] > 0


def test_simulated_seconds_split_sums_to_the_priced_step():
    from harts.sim.costs import make_cost_model
    from harts.sim.parallel import default_parallel

    f = build_forest([_traj("a", "g", list(range(1, 90))), _traj("b", "g", list(range(1, 60)) + [7, 8])])
    m, hw = get_model_config("tiny-cpu"), load_hardware("h200")
    cost = make_cost_model("roofline", m, default_parallel(m, 1), hw)
    for mode in ("tree", "expanded"):
        w = step_work(f, mode, m.chunk_size)
        priced = cost.forward(0, [w]).seconds + cost.backward(0, [w]).seconds + cost.optimizer(0)
        assert sum(simulated_op_seconds(m, w, hw).values()) == pytest.approx(priced, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(forest=plan_forests(), model=st.sampled_from(("tiny-cpu", "tiny-h200")), recompute=st.booleans(),
       baseline=st.sampled_from(("expanded", "prefix-merged")))
def test_simulator_never_exceeds_the_ideal(forest, model, recompute, baseline):
    ideal, sim = simulated_ideal(forest, get_model_config(model), load_hardware("h200"), recompute, baseline)
    assert sim <= ideal.ideal * (1 + 1e-12), (sim, ideal.to_dict())


def test_prefix_merged_work_runs_only_the_hosts():
    f = build_forest([_traj("a", "g", [1, 2, 3, 4]), _traj("b", "g", [1, 2, 3, 4, 5, 6, 7]),
                      _traj("c", "g", [1, 2, 9]), _traj("d", "h", [1, 2, 9])])
    w = step_work(f, "prefix-merged", 4)
    assert w.tokens == 7 + 3 + 3 and w.expanded_tokens == 4 + 7 + 3 + 3
    assert w.attn_pairs_causal == 28 + 6 + 6
    ideal, sim = simulated_ideal(f, get_model_config("tiny-cpu"), load_hardware("h200"), baseline="prefix-merged")
    assert sim <= ideal.ideal  # launch-bound at this size: the tree's extra KDA calls may cost more than it saves
