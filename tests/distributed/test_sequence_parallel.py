"""Sequence parallel under tp=2 (gloo, float64): the residual stream's norms run on each
rank's share of the rows, a share being ceil(T/2) rows of the zero-padded microbatch; the
mixers and the router see exactly the microbatch's T rows. (Its numbers against the
expanded step: tests/distributed/test_equivalence.py, tp2sp.)"""

from __future__ import annotations

import json
from pathlib import Path

from harts.distributed.runner import launch
from tests.distributed.cases import BUDGET, small_config, small_trajectories


def _worker(out: str) -> None:
    import torch
    import torch.distributed as dist

    from harts.config.plan import PlanConfig
    from harts.distributed.mesh import init_mesh, parse_parallel
    from harts.distributed.parallelize import SPBlock, parallelize
    from harts.distributed.runner import DistPlanTrainer
    from harts.exec.model.model import build_model
    from harts.plan.planners import make_plan
    from harts.tree import build_forest

    config = small_config()
    trajs = small_trajectories()
    plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=BUDGET, chunk_size=config.chunk_size,
                                                             dp=1))
    pm = parallelize(build_model(config, seed=0, dtype=torch.float64), init_mesh(parse_parallel("tp=2"), "cpu"))
    seen: dict[str, list[int]] = {"norm": [], "mixer": [], "router": []}
    block = pm.model.layers[0]
    assert isinstance(block, SPBlock)
    block.attn_norm.register_forward_hook(lambda _m, args, _o: seen["norm"].append(args[0].shape[0]))
    block.mixer.register_forward_hook(lambda _m, args, _o: seen["mixer"].append(args[0].shape[0]))
    moe = next(b.ffn for b in pm.model.layers if not b.ffn_kind.name == "DENSE")
    moe.register_forward_hook(lambda _m, args, _o: seen["router"].append(args[0].shape[0]))
    DistPlanTrainer(pm, plan).forward_backward(trajs, BUDGET)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({**seen, "rows": [m.executed_tokens for m in plan.microbatches]}))


def test_tp2_norms_run_on_row_shares(tmp_path):
    out = tmp_path / "seen.json"
    launch(_worker, (str(out),), 2, timeout=240)
    seen = json.loads(out.read_text())
    rows = seen["rows"]
    assert any(r % 2 for r in rows)  # some microbatch needs a padding row
    # every forward of layer 0 (the MoE statistics pass and the training passes, empty
    # lockstep passes too): the mixer and the router on a microbatch's whole rows, the norm
    # on half of them, rounded up
    assert len(seen["norm"]) == len(seen["mixer"]) >= len(rows)
    assert set(seen["mixer"]) - {0} == set(rows) and set(seen["router"]) - {0} <= set(rows), seen
    assert seen["norm"] == [-(-r // 2) for r in seen["mixer"]], seen
