"""bf16 fidelity on the GPU: with the baseline on the tree's cuDNN graph kernel (baseline
attention "graph"), tree execution with replay gives the expanded baseline's bits (logits,
every trained target's NLL, the loss); without replay it does not (state handoffs at
other chunk boundaries)."""

from __future__ import annotations

import os

import pytest
import torch

from harts.exec import backend
from harts.tree.workload import generate, preset
from harts.verify.fidelity import fidelity

pytestmark = pytest.mark.cuda


@pytest.fixture
def graph_baseline():
    saved = os.environ.get(backend.BASELINE_ATTENTION_ENV)
    os.environ[backend.BASELINE_ATTENTION_ENV] = "graph"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(backend.BASELINE_ATTENTION_ENV, None)
        else:
            os.environ[backend.BASELINE_ATTENTION_ENV] = saved


def test_tree_replay_gives_the_graph_baselines_bits(graph_baseline):
    trajs = generate(preset("small-treestep", vocab_size=32768, seed=3)).trajectories()
    out = fidelity(trajs, model="tiny-h200", dtype=torch.bfloat16, device="cuda", microbatch_tokens=1 << 16)
    assert backend.expanded_graph_attention(), "the baseline did not run the cuDNN graph kernel"
    assert any(v is not None for v in backend._GRAPH_STATE.values()), "the tree did not run the graph path"
    r = out["tree_replay_vs_expanded"]
    assert r["sym_kl_max"] == 0.0 and r["nll_diff_max"] == 0.0 and r["loss_diff"] == 0.0, r
    assert out["expanded_rerun_vs_expanded"]["nll_diff_max"] == 0.0  # the baseline itself reruns exactly
    nr = out["tree_no_replay_vs_expanded"]
    assert nr["nll_diff_max"] > 0.0  # the property is replay's, not the kernels' alone
