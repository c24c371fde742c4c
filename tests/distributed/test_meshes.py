"""Any world of 1-4 ranks and any `--parallel` mesh: a launch is refused up front, in one
line and before any process starts, or it runs and equals the single-process step,
including when the forest has fewer groups than the mesh has DP replicas (a replica the
plan gives no microbatch takes part in every collective with a zero contribution; a
pipeline needs a microbatch on every replica and is refused without one).

The refusal logic runs on many drawn launches without processes; a few accepted launches
(drawn, plus an idle EP group and an idle replica among shadows) start their workers."""

from __future__ import annotations

import json
import re
from unittest import mock

from hypothesis import event, example, given, settings

from harts.cli.main import main
from harts.config.plan import PlanConfig
from harts.distributed.mesh import LaunchError, check_launch, parse_parallel
from harts.plan.planners import make_plan
from harts.tree import build_forest
from harts.tree.io import save_jsonl
from harts.verify.distributed import verify_distributed, verify_distributed_dtypes
from tests.distributed.cases import BUDGET, TOL, small_config, small_trajectories
from tests.strategies import LaunchCase, parallel_launches


def _planned(case: LaunchCase):
    """The launch checks in the order `harts train --parallel` runs them under torchrun (the
    spec against the world, the mesh against the model, then the plan for the mesh's dp and
    pp): (parallel, plan, forest), or the LaunchError."""
    config = small_config()
    forest = build_forest(case.trajectories())
    try:
        parallel = parse_parallel(case.spec, case.world)
        check_launch(parallel, case.world, config)
        plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=BUDGET, chunk_size=config.chunk_size,
                                                    dp=parallel.dp, pp=parallel.pp))
        check_launch(parallel, case.world, config, plan)
    except LaunchError as err:
        return err
    return parallel, plan, forest


class _Launched(Exception):
    pass


def _runnable(parallel, plan, forest) -> None:
    """What the workers rely on: without a pipeline each EP group's joint events cover its
    replicas' microbatches once each, in their plan order (a replica without any runs only
    shadows); with one, every replica has microbatches and a schedule to lower."""
    from harts.distributed.runner import joint_events

    if parallel.pp == 1:
        for first in range(0, parallel.dp, parallel.ep):
            group = range(first, first + parallel.ep)
            events = joint_events(plan, group)
            for r in group:
                own = [e.members[r] for e in events if r in e.members and e.kind != "B"]
                assert own == [m.id for m in sorted(plan.replica_sequence(r), key=lambda m: m.order)]
        return
    from harts.distributed.pipeline import lower_schedule
    from harts.plan.schedule import ScheduleName, build_schedule
    from harts.plan.step import step_from_plan

    assert {m.replica for m in plan.microbatches} == set(range(parallel.dp))
    schedule = build_schedule(ScheduleName.CONSUMER_1F1B,
                              step_from_plan(plan, forest, small_config().chunk_size), parallel.pp)
    for r in range(parallel.dp):
        order, _ = lower_schedule(schedule, r)
        assert sorted(order) == sorted(m.id for m in plan.replica_sequence(r))


@settings(max_examples=300)
@given(parallel_launches())
def test_every_launch_is_refused_in_one_line_or_runnable(case):
    """torchrun's world: refused in one line or runnable (`_runnable`). `harts verify
    --parallel` (its world the mesh's own size): the same checks, before its workers start."""
    got = _planned(case)
    if isinstance(got, LaunchError):
        assert str(got) and "\n" not in str(got), got
        event("refused: " + re.sub(r"\d+", "N", re.sub(r"^--parallel '?[^:]*'?: |^mesh \S+ ", "", str(got)))[:40])
    else:
        _runnable(*got)
        parallel, plan, _ = got
        idle = parallel.dp - len({m.replica for m in plan.microbatches})
        event(f"runs: world {case.world}, pp {parallel.pp}" + (", an idle replica" if idle else ""))
    try:
        parallel = parse_parallel(case.spec)
    except LaunchError as err:
        assert str(err) and "\n" not in str(err)
        return
    own = _planned(LaunchCase(parallel.world_size, case.spec, case.seed, case.groups, case.kids))
    started = []

    def launch(fn, args, nprocs, **kwargs):
        started.append(nprocs)
        raise _Launched

    with mock.patch("harts.distributed.runner.launch", launch):
        try:
            verify_distributed_dtypes(case.trajectories(), parallel=parallel, dtypes=[], model=small_config(),
                                      microbatch_tokens=BUDGET)
        except LaunchError as err:
            assert isinstance(own, LaunchError) and str(err) == str(own) and not started
            return
        except _Launched:
            pass
    assert not isinstance(own, LaunchError), own
    assert started == [parallel.world_size]


def _launch_matches(case: LaunchCase) -> None:
    got = _planned(case)
    assert not isinstance(got, LaunchError), got
    parallel, plan, _ = got
    rep = verify_distributed(case.trajectories(), parallel=parallel, model=small_config(), microbatch_tokens=BUDGET,
                             timeout=300)
    assert rep["world_size"] == case.world == parallel.world_size
    assert rep["max_rel_logprob_err"] <= TOL and rep["max_rel_entropy_err"] <= TOL
    assert rep["max_rel_grad_err"] <= TOL, rep["worst_grad_params"]
    assert rep["max_rel_expert_load_err"] <= TOL
    assert max(rep["loss_abs_err"].values()) <= TOL


@settings(max_examples=2)
@given(parallel_launches(min_world=2, free_degrees=False).filter(lambda c: not isinstance(_planned(c), LaunchError)))
@example(LaunchCase(4, "dp=4,ep=2", seed=0, groups=1, kids=1))  # replicas 1-3 idle: one among shadows, one EP group
def test_accepted_launches_equal_the_single_process_step(case):
    """float64, within 1e-10 relative, as tests/distributed/test_equivalence.py's launches
    (of 2 to 4 ranks: one rank is the single-process step itself)."""
    _launch_matches(case)


def test_verify_runs_dp3_on_two_groups(tmp_path, capsys):
    """`harts verify --input rollouts.jsonl --parallel dp=3 --dtype float64` on the
    tiny-stepwise rollouts (2 groups: one tree split over two replicas, the other on the
    third; harts.plan.planners.tree_split) passes. (Replicas without a microbatch:
    `test_accepted_launches_equal_the_single_process_step`'s example.)"""
    from harts.tree.workload import generate_trajectories

    path = tmp_path / "rollouts.jsonl"
    save_jsonl(generate_trajectories("tiny-stepwise", seed=0), path)
    rc = main(["verify", "--input", str(path), "--parallel", "dp=3", "--dtype", "float64", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["passed"] is True, report
    assert report["world_size"] == 3 and report["microbatches"] == 3


def test_a_pipeline_with_an_idle_replica_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    save_jsonl(small_trajectories(groups=1, kids=1), path)
    argv = ["verify", "--input", str(path), "--parallel", "dp=2,pp=2", "--microbatch-tokens", str(BUDGET)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "gives replica 1 no microbatch" in err, err
    assert main([*argv, "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"error", "file", "line", "field"} and "no microbatch" in out["error"], out
