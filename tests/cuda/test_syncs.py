"""No host-device synchronisation inside a step's microbatches on the GPU.

The host issues a step's kernels ahead of the device; a synchronisation in the middle of a
microbatch (a blocking host-to-device copy, a value read back) drains the device's queue
and throws that lead away, which a step whose host and device times are close pays in
device idle. A prepared step may synchronise only where it reads its results back, after
its last microbatch (`harts.exec.step`): its values and the gradient norm."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from harts.config.models import get_model_config
from harts.exec.factory import make_trainer
from harts.exec.model.model import build_model
from harts.plan.planners import PlanConfig, make_plan
from harts.tree import build_forest, shapes

pytestmark = pytest.mark.cuda

STEP_FILE = str(Path("harts") / "exec" / "step.py")


def _sync_sites(trainer, trajs, budget: int) -> list[str]:
    """file:line of every synchronising call of one prepared step."""
    prepared = trainer.prepare(trajs, budget)
    trainer.step(trajs, budget, prepared=trainer.prepare(trajs, budget))  # compile and tune first
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step(trajs, budget, prepared=prepared)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]


@pytest.mark.parametrize("family", ["grpo", "bushy", "swe-tree"])
@pytest.mark.parametrize("kind", ["tree", "windows"])
def test_microbatches_do_not_synchronise(kind, family):
    cfg = get_model_config("tiny-cpu")
    budget = 512
    trajs = shapes.draw(family, 3, budget, vocab_size=cfg.vocab_size)
    net = build_model(cfg, seed=0, dtype=torch.bfloat16, device="cuda", recompute=True)
    if kind == "tree":
        trainer, at = make_trainer("tree", net), 1 << 20
    else:
        plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size))
        assert plan.consumers(), "expected a plan with sharing windows"
        trainer, at = make_trainer("plan", net, plan), budget
    sites = _sync_sites(trainer, trajs, at)
    assert sites, "the step reads its results back: at least that synchronises (is the check working?)"
    inside = [s for s in sites if STEP_FILE not in s]
    assert not inside, f"synchronisations inside the step's microbatches: {inside}"
