"""Pipeline parallel (harts.distributed.pipeline, built as training builds it:
`parallelize` on a mesh with pp > 1, then `distributed_trainer`) on CPU with gloo, float64,
2 processes: a plan with sharing windows run under each simulator schedule equals the
single-process expanded
reference (log-probs, losses, expert loads, every gradient), and each rank runs exactly the
passes the simulator scheduled for it, in its order. pp=2 under consumer-1f1b and dp=2 x
pp=2 also run a float32 step in the same processes, checked against the float32 expanded
step within `TOL32` relative RMS error (tests/distributed/cases.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harts.config.models import get_model_config
from harts.config.parallel import ParallelConfig
from harts.config.plan import PlanConfig
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import build_model
from harts.exec.trainer import ExpandedTrainer
from harts.exec.window import PlanTrainer
from harts.plan.planners import make_plan
from harts.plan.schedule import ScheduleName
from harts.tree import build_forest
from harts.tree.workload import generate_trajectories
from harts.verify.equivalence import max_rel, rms_rel
from tests.distributed.cases import TOL32

TOL = 1e-10
LOSS = PolicyLossConfig(kl_coef=0.1)
CHUNK = 8
SEED = 3
JOIN_SECONDS = 120


def _pp():
    """harts.distributed.pipeline, imported when a test runs rather than when the suite is
    collected: it imports torch.distributed.pipelining and with it triton, which must come
    after the TRITON_INTERPRET=1 tests of tests/exec/gpu set that variable."""
    import harts.distributed.pipeline as pp

    return pp


def _stage_trainer(model, mesh, plan, schedule):
    """The pipeline as training builds it: `parallelize` (this rank's stage, FSDP over "dp")
    and `distributed_trainer`."""
    from harts.distributed.parallelize import parallelize
    from harts.distributed.runner import distributed_trainer

    pm = parallelize(model, mesh)
    assert pm.applied == ["pp"] + (["fsdp"] if mesh.parallel.dp > 1 else [])
    return distributed_trainer(pm, plan, schedule=schedule, loss=LOSS)


def _config(aux_scope: str = "global"):
    return get_model_config("tiny-cpu").replace(chunk_size=CHUNK, aux_scope=aux_scope)


def _case(dp: int = 1):
    """tiny-treestep under a budget that splits its trees into sharing windows."""
    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    budget = max(int(forest.traj_length.max()) + 5, forest.compact_tokens // 3)
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=CHUNK, pp=2, dp=dp))
    return trajs, plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: an FSDP shard (DTensor) gathered over its mesh."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def _worker(rank: int, world: int, port: int, schedule: str, aux_scope: str, dp: int, update: bool,
            float32: bool, out: str) -> None:
    try:
        from harts.distributed.mesh import init_mesh
        from harts.distributed.pipeline_step import executed_schedule

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=JOIN_SECONDS))
        pp = world // dp
        mesh = init_mesh(ParallelConfig(dp=dp, pp=pp), "cpu")  # ranks laid out pp x dp
        # a run's DistMesh names its pipeline group: this replica's ranks, one per stage
        assert dist.get_process_group_ranks(_pp().pp_group_of(mesh)) == [rank % dp + s * dp for s in range(pp)]
        trajs, plan = _case(dp)
        model = build_model(_config(aux_scope), seed=SEED, dtype=torch.float64)
        trainer = _stage_trainer(model, mesh, plan, schedule)
        stage, replica = trainer.spec.stage, trainer.replica
        assert (replica, stage) == (rank % dp, rank // dp)
        # `update`: a whole step (clipped by the global norm, AdamW) instead of forward/backward
        result = trainer.step(trajs) if update else trainer.forward_backward(trajs)
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        params = {n: _full(p.detach()) for n, p in model.named_parameters()}
        # the whole run's order, gathered (every rank), against the simulator's text
        ran = executed_schedule(result).to_text()
        simulated = trainer.simulated_schedule(trajs).to_text()
        from torch.distributed.tensor import DTensor

        stage_params = list(trainer.model.parameters())
        # FSDP over "dp": every parameter of the stage a DTensor, this rank holding its shard
        sharded = {"dtensors": sum(isinstance(p, DTensor) for p in stage_params), "params": len(stage_params),
                   "local": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in stage_params),
                   "whole": sum(p.numel() for p in stage_params)}
        f32 = None
        if float32:  # the same plan and schedule from the same seed in float32: forward/backward
            model32 = build_model(_config(aux_scope), seed=SEED, dtype=torch.float32)
            r32 = _stage_trainer(model32, mesh, plan, schedule).forward_backward(trajs)
            f32 = {"result": r32, "grads": {n: _full(p.grad) for n, p in model32.named_parameters()
                                            if p.grad is not None}}
        torch.save({"result": result, "grads": grads, "params": params, "stage": stage, "replica": replica,
                    "sharded": sharded, "float32": f32,
                    "ran": ran, "simulated": simulated}, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


def _launch(tmp_path: Path, schedule: str, aux_scope: str = "global", dp: int = 1,
            update: bool = False, float32: bool = False) -> list[dict]:
    world = 2 * dp
    port = _free_port()
    # children forked from one server that has imported torch and harts once (a spawned
    # child would import them again, ~10 s of CPU each)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    procs = [ctx.Process(target=_worker, args=(r, world, port, schedule, aux_scope, dp, update, float32,
                                                 str(tmp_path)), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_SECONDS
        # until every rank is done, one fails (its peers would wait for it until the
        # process group's timeout) or the deadline passes
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            procs[0].join(0.2)
        errors = [f.read_text() for f in sorted(tmp_path.glob("rank*.err"))]
        codes = [p.exitcode for p in procs]
        assert not errors, "\n".join(errors)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} did not finish in {JOIN_SECONDS} s"
        assert codes == [0] * world, codes
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _single_process(trainer_cls, aux_scope: str, *args, update: bool = False, dtype=torch.float64):
    trajs, _ = _case()
    model = build_model(_config(aux_scope), seed=SEED, dtype=dtype)
    trainer = trainer_cls(model, *args, loss=LOSS)
    ref = trainer.step(trajs, 1 << 20) if update else trainer.forward_backward(trajs, 1 << 20)
    return {n: p.grad for n, p in model.named_parameters()}, ref, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    """The single-process expanded step from the same weights (computed once per module)."""
    return _single_process(ExpandedTrainer, "global")


def _flat(lps) -> np.ndarray:
    return np.concatenate([x[1:] for x in lps])  # position 0 has no target


def _check_against_reference(outs: list[dict], reference, pp: int = 2) -> None:
    ref_grads, ref, _ = reference
    seen: set[str] = set()
    logprobs = np.full(_flat(ref.logprobs).size, np.nan)
    for out in outs:
        r = out["result"]
        # every rank holds the step's losses and expert loads
        for name, value in ref.losses.items():
            assert abs(r.losses[name] - value) <= TOL, (name, r.losses[name], value)
        assert max_rel(r.expert_load, ref.expert_load) <= TOL
        if r.stage == pp - 1:
            # each replica's last stage holds the log-probs of its trajectories
            mine = _flat(r.logprobs)
            have = ~np.isnan(mine)
            assert np.isnan(logprobs[have]).all(), "two replicas computed the same target"
            logprobs[have] = mine[have]
        else:
            assert r.logprobs is None
        for name, g in out["grads"].items():
            err = max_rel(g.numpy(), ref_grads[name].numpy())
            assert err <= TOL, (name, err)
            seen.add(name)
    assert max_rel(logprobs, _flat(ref.logprobs)) <= TOL
    # the stages' parameters split the model's: each rank keeps its own, every one of them
    # has its gradient
    owned = [set(out["params"]) for out in outs if out["replica"] == 0]
    assert all(set(out["grads"]) == set(out["params"]) for out in outs)
    assert sum(len(o) for o in owned) == len(ref_grads) and set().union(*owned) == set(ref_grads)
    assert seen == set(ref_grads), sorted(set(ref_grads) - seen)


@pytest.fixture(scope="module")
def reference32():
    """The single-process expanded step in float32 (computed once per module)."""
    return _single_process(ExpandedTrainer, "global", dtype=torch.float32)


def _check_float32(outs: list[dict], reference32, pp: int = 2) -> None:
    """The float32 step's log-probs (each replica's last stage) and whole gradient (replica
    0's stages; FSDP-reduced, so the step's) against the float32 expanded step."""
    ref_grads, ref, _ = reference32
    grads: dict[str, torch.Tensor] = {}
    logprobs = np.full(_flat(ref.logprobs).size, np.nan)
    for out in outs:
        f32 = out["float32"]
        if out["replica"] == 0:
            grads.update(f32["grads"])
        if f32["result"].stage == pp - 1:
            mine = _flat(f32["result"].logprobs)
            have = ~np.isnan(mine)
            logprobs[have] = mine[have]
    assert set(grads) == set(ref_grads) and not np.isnan(logprobs).any()
    names = sorted(ref_grads)
    got = np.concatenate([grads[n].double().numpy().ravel() for n in names])
    want = np.concatenate([ref_grads[n].double().numpy().ravel() for n in names])
    errors = rms_rel(logprobs, _flat(ref.logprobs)), rms_rel(got, want)
    assert max(errors) <= TOL32, errors


@pytest.mark.parametrize("schedule", [s.value for s in ScheduleName])
def test_pp2_matches_expanded_and_runs_the_simulated_schedule(tmp_path, reference, reference32, schedule):
    """consumer-1f1b also in float32; relative RMS errors measured: 1.3e-8 (log-probs),
    5.1e-7 (gradient)."""
    trajs, plan = _case()
    assert plan.consumers(), "the case must have sharing windows"
    float32 = schedule == ScheduleName.CONSUMER_1F1B
    outs = _launch(tmp_path, schedule, float32=float32)
    _check_against_reference(outs, reference)
    if float32:
        _check_float32(outs, reference32)
    for out in outs:
        r = out["result"]
        assert r.schedule == schedule
        assert r.executed == r.simulated, (r.stage, r.executed, r.simulated)
        assert out["ran"] == out["simulated"], out["ran"]
    if schedule == ScheduleName.CONSUMER_1F1B:
        assert any(op.fused for out in outs for op in out["result"].executed)
    # stage 0 and stage 1 both ran every microbatch forward and backward
    for out in outs:
        ops = out["result"].executed
        assert sorted(op.mbs[0] for op in ops if op.kind == "F") == sorted(m.id for m in plan.microbatches)
        assert sorted(m for op in ops if op.kind == "B" for m in op.mbs) == sorted(m.id for m in plan.microbatches)


def test_lowering_maps_passes_to_runtime_actions():
    from torch.distributed.pipelining.schedules import FULL_BACKWARD, OVERLAP_F_B

    from harts.plan.schedule import build_schedule
    from harts.plan.step import step_from_plan

    trajs, plan = _case()
    sched = build_schedule(ScheduleName.CONSUMER_1F1B, step_from_plan(plan, build_forest(trajs), CHUNK), 2)
    order, actions = _pp().lower_schedule(sched, 0)
    for s in range(2):
        ops = sched.ops(0, s)
        assert len(actions[s]) == len(ops)
        for op, a in zip(ops, actions[s], strict=True):
            if op.fused:
                assert a.computation_type == OVERLAP_F_B
                assert [order[x.microbatch_index] for x in a.sub_actions] == list(op.mbs)
                assert all(x.computation_type == FULL_BACKWARD and x.stage_index == s for x in a.sub_actions)
            else:
                assert a.stage_index == s and order[a.microbatch_index] == op.mbs[0]
                assert a.computation_type.value == op.kind
    # runtime index i is the i-th forward
    assert [order[a.microbatch_index] for a in actions[1] if a.computation_type.value == "F"] == \
        [op.mbs[0] for op in sched.ops(0, 1) if op.kind == "F"]


def test_dp2_pp2_step_matches_expanded(tmp_path, reference32):
    """Two replicas of a two-stage pipeline (4 processes) run one update: each replica its
    windows in the simulator's schedule, each stage sharded over the replicas by FSDP2 (its
    gradients reduce-scattered, summed), clipped by the global norm, AdamW on the shards;
    gradients, losses and the updated weights equal the single-process expanded step's.
    The float32 forward/backward (FSDP2 reducing in float32: a SUM collective, gloo has no
    PREMUL_SUM) against the float32 expanded step: relative RMS errors measured 2.1e-8
    (log-probs), 5.1e-7 (gradient)."""
    trajs, plan = _case(dp=2)
    assert plan.consumers() and {m.replica for m in plan.microbatches} == {0, 1}
    outs = _launch(tmp_path, ScheduleName.CONSUMER_1F1B.value, dp=2, update=True, float32=True)
    reference = _single_process(ExpandedTrainer, "global", update=True)
    _check_against_reference(outs, reference)
    _check_float32(outs, reference32)
    ref_params = reference[2]
    for out in outs:
        assert abs(out["result"].grad_norm - reference[1].grad_norm) <= TOL * reference[1].grad_norm
        for name, p in out["params"].items():
            assert max_rel(p.numpy(), ref_params[name].numpy()) <= TOL, name
    for out in outs:
        r = out["result"]
        assert r.executed == r.simulated, (r.replica, r.stage, r.executed, r.simulated)
        assert out["ran"] == out["simulated"] and "replicas 2" in out["ran"]
        # each stage sharded by FSDP2 over the two replicas: every parameter a DTensor, each
        # rank holding about half of its stage's elements
        sh = out["sharded"]
        assert sh["dtensors"] == sh["params"] > 0, sh
        assert sh["local"] <= sh["whole"] // 2 + sh["params"], sh
    # both replicas' ranks of one stage hold the same (all-reduced) gradients
    by_stage: dict[int, list[dict]] = {}
    for out in outs:
        by_stage.setdefault(out["stage"], []).append(out["grads"])
    for a, b in by_stage.values():
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_microbatch_aux_scope_matches_the_single_process_plan_step(tmp_path):
    """With per-microbatch aux losses (each scaled by its share of the step's tokens, the
    running aux passed stage to stage) the pipelined step is the single-process plan step."""
    _, plan = _case()
    outs = _launch(tmp_path, ScheduleName.OVERLAP_BWD_FIRST.value, aux_scope="microbatch")
    _check_against_reference(outs, _single_process(PlanTrainer, "microbatch", plan))
    assert all(o["result"].losses["aux_loss"] > 0 for o in outs)


def test_stage_split_is_the_simulators_and_bad_splits_are_refused():
    cfg = _config()
    specs = [_pp().stage_spec(cfg, 2, s) for s in range(2)]
    assert [s.layers for s in specs] == [(0, 1), (2, 3)]
    assert specs[0].has_embedding and not specs[0].has_lm_head
    assert specs[1].has_lm_head and not specs[1].has_embedding
    with pytest.raises(ValueError, match="larger than the layer count"):
        _pp().stage_spec(cfg, 5, 0)
    with pytest.raises(ValueError, match="tied embeddings"):
        _pp().stage_spec(cfg.replace(tie_embeddings=True), 2, 0)
    with pytest.raises(ValueError, match="stage 2 of 2"):
        _pp().stage_spec(cfg, 2, 2)


def test_verify_parallel_runs_the_pipeline_against_the_expanded_step(capsys):
    """`harts verify --parallel dp=2,pp=2 --schedule ...` starts its four workers, runs the
    pipeline under the simulator's schedule on a plan with sharing windows, and reports the
    expanded comparison with the schedule it ran."""
    import json

    from harts.cli.main import main

    rc = main(["verify", "--workload", "tiny-treestep", "--parallel", "dp=2,pp=2", "--schedule", "overlap-bwd-first",
               "--planner", "l1l2", "--microbatch-tokens", "300", "--dtype", "float64", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["passed"] is True, report
    assert report["world_size"] == 4 and report["applied"] == ["pp", "fsdp"] and report["sharing_windows"] > 0
    assert report["schedule"] == "overlap-bwd-first" and report["executed_is_simulated"] is True
    assert report["max_rel_logprob_err"] <= TOL and report["max_rel_grad_err"] <= TOL
    assert max(report["loss_abs_err"].values()) <= TOL
