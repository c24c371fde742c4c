"""Launch checks (one line each, exit code 2, before any collective), `--parallel`
parsing, the replicas' joint events, and the worker launcher's failure handling."""

from __future__ import annotations

import time

import pytest

from harts.cli.main import main
from harts.config.plan import PlanConfig
from harts.distributed.mesh import LaunchError, check_launch, parse_parallel
from harts.distributed.runner import joint_events, launch
from harts.plan.planners import make_plan
from harts.tree import build_forest
from tests.distributed.cases import BUDGET, small_config, small_trajectories


def test_parse_parallel():
    p = parse_parallel("dp=2,pp=1,ep=2,tp=1")
    assert (p.dp, p.pp, p.ep, p.tp) == (2, 1, 2, 1) and p.world_size == 2
    assert parse_parallel("tp=2").world_size == 2
    assert parse_parallel("tp=2", world_size=8).dp == 4  # dp fills the ranks the others leave
    assert parse_parallel(p.spec()) == p
    for bad in ("dp=2,dp=2", "xp=2", "dp=two", "dp=0", "dp", "dp=2,ep=3"):
        with pytest.raises(LaunchError) as err:
            parse_parallel(bad)
        assert "\n" not in str(err.value)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err, err
    return err


@pytest.mark.parametrize("spec, words", [
    ("dp=3,ep=3", "does not divide the 8 experts"),
    ("pp=5", "larger than the 4 layers"),
    ("tp=3", "does not divide"),
])
def test_bad_launches_are_refused_before_workers_start(capsys, spec, words):
    start = time.perf_counter()
    err = _one_line_error(capsys, ["verify", "--parallel", spec, "--workload", "tiny-treestep"])
    assert words in err
    assert time.perf_counter() - start < 60  # no worker was started


def test_a_mesh_larger_than_the_world_is_refused(capsys):
    # without torchrun the world is this one process
    err = _one_line_error(capsys, ["train", "--mode", "tree", "--parallel", "dp=2", "--steps", "1"])
    assert "does not divide the world size 1" in err


def test_a_plan_for_another_dp_size_is_refused(capsys, tmp_path):
    trajectories = small_trajectories()
    plan = make_plan(build_forest(trajectories), "l1l2", PlanConfig(microbatch_tokens=BUDGET, chunk_size=8, dp=2))
    with pytest.raises(LaunchError, match="made for dp=2 replicas; this launch has dp=1"):
        check_launch(parse_parallel("dp=1"), 1, small_config(), plan)
    from harts.tree.workload import generate_trajectories

    wl = generate_trajectories("tiny-treestep", seed=0)
    path = tmp_path / "plan.json"
    budget = max(len(t) for t in wl) + 8  # the longest trajectory fits
    make_plan(build_forest(wl), "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=64, dp=2)).save(path)
    err = _one_line_error(capsys, ["train", "--mode", "tree", "--parallel", "dp=1", "--plan", str(path),
                                   "--steps", "1", "--microbatch-tokens", str(budget)])
    assert "made for dp=2 replicas; this launch has dp=1" in err


def test_expert_parallelism_on_crossing_windows_is_refused_in_one_line():
    """A replica whose windows cross (a producer's window closing inside another's, which
    one process runs) cannot be merged into an EP group's lockstep: refused at launch."""
    from types import SimpleNamespace

    from tests.strategies import LockstepMicrobatch as Mb

    mbs = (Mb(0, 0, 0, 0, None, 10), Mb(1, 0, 1, 0, None, 10), Mb(2, 0, 2, 0, 0, 10), Mb(3, 0, 3, 1, 1, 10))
    plan = SimpleNamespace(dp=2, microbatches=mbs)
    check_launch(parse_parallel("dp=2"), 2, small_config(), plan)
    with pytest.raises(LaunchError) as err:
        check_launch(parse_parallel("dp=2,ep=2"), 2, small_config(), plan)
    assert "window closes inside another" in str(err.value) and "\n" not in str(err.value)


def test_joint_events_keep_each_replicas_plan_order_and_pair_every_microbatch():
    plan = make_plan(build_forest(small_trajectories()), "l1l2",
                     PlanConfig(microbatch_tokens=BUDGET, chunk_size=8, dp=2))
    events = joint_events(plan, [0, 1])
    consumers = plan.consumers()
    for r in (0, 1):
        own = [e.members[r] for e in events if r in e.members and e.kind != "B"]
        assert own == [m.id for m in sorted(plan.replica_sequence(r), key=lambda m: m.order)]
        backs = [e.members[r] for e in events if r in e.members and e.kind == "B"]
        assert sorted(backs) == sorted(p for p in consumers if plan.microbatches[p].replica == r)
    # producers share a forward event only with the producers they share their backward
    # event with (each backward meets the graphs its peers built in its forward); the
    # backward follows the last consumer
    fwd = [e.members for e in events if e.kind == "F"]
    bwd = [e.members for e in events if e.kind == "B"]
    assert sorted(map(sorted, (m.items() for m in fwd))) == sorted(map(sorted, (m.items() for m in bwd)))
    assert any(len(m) == 2 for m in fwd)  # these replicas' windows share their slots
    position = {(e.kind, mb): i for i, e in enumerate(events) for mb in e.members.values()}
    for p, cs in consumers.items():
        assert all(position[("F", p)] < position[("FB", c)] < position[("B", p)] for c in cs)
    # replicas with work in the same slot share one forward/backward event
    assert any(len(e.members) == 2 for e in events if e.kind == "FB")


@pytest.mark.parametrize("planner", ["l1", "l1l2"])
def test_joint_events_run_a_chains_backwards_in_its_window_runs_order(planner):
    """In a chain of windows the end of a consumer closes every window up the chain whose
    last consumer it completes: those producers' backwards follow its forward-backward,
    nearest first, each in an event of its own (the window run pauses between them)."""
    from tests.strategies import long_chain_trajectories

    trajs = long_chain_trajectories(70, [(19, 12), (32, 20), (33, 5), (60, 6)], seed=2, groups=2)
    plan = make_plan(build_forest(trajs), planner, PlanConfig(microbatch_tokens=24, chunk_size=8, dp=2))
    by_id = {m.id: m for m in plan.microbatches}
    assert any(m.producer is not None and by_id[m.producer].producer is not None for m in plan.microbatches)
    events = joint_events(plan, [0, 1])
    consumers = plan.consumers()
    cascades = 0
    for r in (0, 1):
        mine = [(e.kind, e.members[r]) for e in events if r in e.members]
        # what a window run does: after a non-producer, the producers whose windows close
        done: dict[int, int] = {}
        expect = []
        for m in sorted(plan.replica_sequence(r), key=lambda m: m.order):
            expect.append(("F" if m.id in consumers else "FB", m.id))
            if m.id in consumers:
                continue
            p, closed = m.producer, 0
            while p is not None:
                done[p] = done.get(p, 0) + 1
                if done[p] < len(consumers[p]):
                    break
                expect.append(("B", p))
                p, closed = by_id[p].producer, closed + 1
            cascades += closed > 1
        assert mine == expect
    assert cascades
    # producers share a forward event only with those they share a backward event with
    fwd = sorted(sorted(e.members.items()) for e in events if e.kind == "F")
    assert fwd == sorted(sorted(e.members.items()) for e in events if e.kind == "B")


def _fail(seconds: float) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("worker 1 fails")
    time.sleep(seconds)


def test_launch_raises_and_kills_the_other_workers_when_one_fails():
    start = time.perf_counter()
    with pytest.raises(Exception, match="worker 1 fails"):
        launch(_fail, (600.0,), 2, timeout=120)
    assert time.perf_counter() - start < 110


def test_launch_times_out():
    with pytest.raises(TimeoutError):
        launch(time.sleep, (600.0,), 1, timeout=15)


def test_train_parallel_on_one_rank_takes_the_single_process_steps(capsys, tmp_path):
    import json

    from harts.tree.io import save_jsonl

    path = tmp_path / "rollouts.jsonl"
    save_jsonl(small_trajectories(), path)
    args = ["--mode", "tree", "--steps", "2", "--json", "--input", str(path), "--microbatch-tokens", str(BUDGET),
            "--dtype", "float64", "--old-logprobs", "input"]
    assert main(["train", "--planner", "l1l2", *args]) == 0
    single = json.loads(capsys.readouterr().out)["steps"]
    assert main(["train", "--parallel", "dp=1", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 1 and out["parallel"] == "dp=1,pp=1,ep=1,tp=1"
    for a, b in zip(out["steps"], single, strict=True):
        for key in ("loss", "pg_loss", "kl", "aux_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-10 * max(1.0, abs(b[key])), key


def test_train_parallel_pp2_under_torchrun_takes_the_single_process_plan_steps(capsys, tmp_path):
    """`torchrun --nproc-per-node 2 -m harts train --parallel pp=2` runs the pipeline stages
    (consumer-1f1b) on a saved plan; its losses and grad norms are the single-process run's
    of the same plan, and each stage ran the simulator's passes."""
    import json
    import os
    import subprocess
    import sys

    from harts.distributed.runner import free_port
    from harts.tree.io import save_jsonl

    trajs = small_trajectories()
    path, plan_path = tmp_path / "rollouts.jsonl", tmp_path / "plan.json"
    save_jsonl(trajs, path)
    make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=BUDGET, chunk_size=small_config().chunk_size,
                                                      dp=1, pp=2)).save(plan_path)
    args = ["--mode", "tree", "--steps", "2", "--json", "--input", str(path), "--microbatch-tokens", str(BUDGET),
            "--dtype", "float64", "--old-logprobs", "input", "--plan", str(plan_path), "--device", "cpu"]
    assert main(["train", "--parallel", "dp=1", *args]) == 0
    single = json.loads(capsys.readouterr().out)["steps"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "harts", "train", "--parallel", "pp=2", *args],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["world_size"] == 2 and out["applied"] == ["pp"]
    for a, b in zip(out["steps"], single, strict=True):
        assert a["executed_is_simulated"] and a["schedule"] == "consumer-1f1b"
        for key in ("loss", "pg_loss", "kl", "aux_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-10 * max(1.0, abs(b[key])), key
