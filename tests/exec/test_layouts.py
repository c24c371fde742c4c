"""The step runner and its layouts: every trainer is `StepRunner` over a layout, none of them
(the distributed and pipelined ones included) has a step of its own, and a layout is all a
new way of laying out a step needs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.exec.factory import TRAINER_KINDS, make_trainer
from harts.exec.layouts import PackedLayout, PlanLayout, PrefixMergedLayout, TreeLayout
from harts.exec.model.model import build_model
from harts.exec.step import StepRunner
from harts.plan.planners import make_plan
from harts.tree import build_forest
from harts.tree.workload import generate_trajectories

LAYOUT_OF = {"expanded": PackedLayout, "tree": TreeLayout, "plan": PlanLayout, "prefix-merged": PrefixMergedLayout}


def _setup():
    cfg = get_model_config("tiny-cpu").replace(chunk_size=8)
    trajs = generate_trajectories("tiny-treestep", seed=1, vocab_size=cfg.vocab_size, num_groups=2)
    return cfg, trajs


def test_every_trainer_kind_is_the_runner_over_its_layout():
    cfg, trajs = _setup()
    plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=1 << 20, dp=1))
    for kind in TRAINER_KINDS:
        trainer = make_trainer(kind, build_model(cfg, seed=0, dtype=torch.float64),
                               plan if kind == "plan" else None)
        assert isinstance(trainer, StepRunner)
        assert type(trainer.layout) is LAYOUT_OF[kind]


def test_no_trainer_has_a_step_of_its_own():
    """Zeroing, forward/backward, clipping and AdamW are the runner's; the distributed and
    pipelined trainers change only its hooks (and the pipeline its pass, `_run`)."""
    from harts.distributed.pipeline_step import PipelineTrainer
    from harts.distributed.runner import DistPlanTrainer
    from harts.exec.prefix_trainer import PrefixMergedTrainer
    from harts.exec.trainer import ExpandedTrainer
    from harts.exec.tree_trainer import TreeTrainer
    from harts.exec.window import PlanTrainer

    for cls in (ExpandedTrainer, TreeTrainer, PrefixMergedTrainer, PlanTrainer, DistPlanTrainer, PipelineTrainer):
        for name in ("step", "forward_backward", "evaluate", "prepare"):
            assert getattr(cls, name) is getattr(StepRunner, name), (cls.__name__, name)
    assert DistPlanTrainer._pass is StepRunner._pass


class _Reversed(PackedLayout):
    """A new layout in a few lines: the packed microbatches in reverse order."""

    def partition(self, trajectories, microbatch_tokens):  # noqa: ANN001
        return super().partition(trajectories, microbatch_tokens)[::-1]


def test_a_new_layout_runs_on_the_runner_with_the_same_numbers():
    cfg, trajs = _setup()
    results = {}
    for name, layout in (("packed", PackedLayout()), ("reversed", _Reversed())):
        model = build_model(cfg, seed=0, dtype=torch.float64)
        result = StepRunner(model, layout).forward_backward(trajs, 64)
        results[name] = (result, torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    (a, ga), (b, gb) = results["packed"], results["reversed"]
    assert len(a.microbatches) > 1 and a.microbatches == b.microbatches[::-1]
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        np.testing.assert_array_equal(x, y)  # each target's log-prob is its own microbatch's
    rel = float((ga - gb).norm() / ga.norm())
    assert rel < 1e-12  # the same sum in another order


def test_a_packing_layout_needs_a_budget():
    cfg, trajs = _setup()
    trainer = make_trainer("expanded", build_model(cfg, seed=0, dtype=torch.float64))
    with pytest.raises(ValueError, match="microbatch_tokens"):
        trainer.forward_backward(trajs)
