"""bf16 fidelity on the GPU: with the baseline on the tree's cuDNN graph kernel (baseline
attention "graph"), tree execution with replay gives the expanded baseline's bits (logits,
every trained target's NLL, the loss); without replay it does not (state handoffs at
other chunk boundaries)."""

from __future__ import annotations

import warnings

import pytest
import torch

from harts.config.kernels import BaselineAttention, KernelConfig
from harts.exec.ops.attention import tree as tree_attention
from harts.exec.ops.record import KernelFallbackWarning
from harts.tree.workload import generate, preset
from harts.verify.fidelity import fidelity

pytestmark = pytest.mark.cuda


def test_tree_replay_gives_the_graph_baselines_bits():
    trajs = generate(preset("small-treestep", vocab_size=32768, seed=3)).trajectories()
    kernels = KernelConfig(baseline_attention=BaselineAttention.GRAPH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KernelFallbackWarning)
        out = fidelity(trajs, model="tiny-h200", dtype=torch.bfloat16, device="cuda", microbatch_tokens=1 << 16,
                       kernels=kernels)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)
                 and str(w.message).startswith("baseline_attention")]
    assert not fallbacks, f"the baseline did not run the cuDNN graph kernel: {fallbacks}"
    assert any(v is not None for v in tree_attention._GRAPH_STATE.values()), "the tree did not run the graph path"
    r = out["tree_replay_vs_expanded"]
    assert r["sym_kl_max"] == 0.0 and r["nll_diff_max"] == 0.0 and r["loss_diff"] == 0.0, r
    assert out["expanded_rerun_vs_expanded"]["nll_diff_max"] == 0.0  # the baseline itself reruns exactly
    nr = out["tree_no_replay_vs_expanded"]
    assert nr["nll_diff_max"] > 0.0  # the property is replay's, not the kernels' alone
