"""The CPU side of `benchmarks/gpu/baselines.py`: its workloads have the shapes it names,
its command line parses, and on CPU it refuses to run."""

import numpy as np
import pytest

from benchmarks.gpu import baselines
from harts.tree import build_forest
from harts.tree.prefix import duplicate_counts, prefix_hosts


def test_grpo_group_is_one_prompt_and_16_responses():
    trajs = baselines.workload("grpo", 151936)
    f = build_forest(trajs)
    assert len(trajs) == 16 and duplicate_counts(f)["duplicate_trajectories"] == 0
    assert f.num_nodes == 17 and f.node_num_children[0] == 16  # the prompt, then one leaf per response
    assert f.node_end[0] == 6144
    for t in trajs:
        assert not t.loss_mask[:6144].any() and t.loss_mask[6144:].all()
    # nothing is a prefix of anything: prefix merging keeps every sequence
    assert set(prefix_hosts([t.tokens for t in trajs]).tolist()) == set(range(16))


def test_bushy_tree_branches_by_four_with_turns_of_a_few_hundred_tokens():
    from harts.tree.workload import generate, preset

    name, over = baselines.WORKLOADS["bushy"]
    wl = generate(preset(name, **over))
    f = wl.forest()
    assert f.num_trajectories >= 16 and duplicate_counts(f)["duplicate_trajectories"] == 0
    assert f.node_num_children.max() == 4
    turn = np.mean(np.asarray(wl.seg_length[1:]))  # actions and observations
    assert 100 < turn < 500


def test_every_section_is_listed_and_refuses_without_a_gpu(monkeypatch, capsys):
    import torch

    from benchmarks.gpu.common import run_suite

    assert [s.name for s in baselines.SECTIONS] == ["treestep", "stepwise", "grpo", "bushy"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        run_suite("baselines", baselines.SECTIONS, baselines.__doc__, baselines.add_args, argv=["grpo", "--steps", "2"])
    assert exc.value.code == 2 and "need a CUDA device" in capsys.readouterr().err
