"""Measuring what the simulator's executor model predicts (the library behind
`harts sim calibrate` and `harts sim validate`).

- `measure_step`: one plan kind (`tree`, `windows`, `expanded`, or any planner's plan) on
  a device: the median step time over `steps` timed steps after `warmup`, the step's data
  side prepared outside the timed region (as the window suite times it); on CUDA one more
  step under torch.profiler gives the summed kernel time and the kernel launches.
- `op_rates`: matrix-product FLOP/s and device-copy bandwidth micro-benchmarks.
- `calibrate_host`: a shipped profile with only its host rate measured on this machine
  (a few window and expanded steps, no profiler): what differs between machines of one
  GPU kind.
- `calibrate`: op rates plus a few real steps of `harts.tree.shapes` instances, fitted into
  a hardware profile's `executor` section (`harts.sim.fit_executor`): launch counts from
  the counted launches, the device terms from the kernel time, the host terms from the
  wall time (on a CPU, where neither is counted, the wall time alone fits the device
  scale and the fixed step cost; the rest stays the base profile's, labelled so).
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from harts.bench.timing import sync_cuda

__all__ = ["build_net", "calibrate", "calibrate_host", "kernel_category", "measure_step", "measured_cases", "op_rates",
           "trainer_for"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        sync_cuda()


def build_net(model: str, device: str):
    from harts.config.models import get_model_config
    from harts.exec.model.model import build_model

    cfg = get_model_config(model)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return cfg, build_model(cfg, seed=0, dtype=dtype, device=device, recompute=True)


def trainer_for(kind: str, net: Any, forest: Any, budget: int, chunk_size: int, planner: str = "l1l2") -> Any:
    """The executor's trainer of a plan kind: `expanded` packs trajectories at the budget
    (a trajectory longer than it as the expanded-ffd plan's chain of windows, as `harts
    train` runs it: `chained_expanded_plan`), `tree` runs the unsplit tree, anything else
    runs `planner`'s plan at the budget."""
    from harts.config.plan import PlanConfig
    from harts.exec.factory import chained_expanded_plan, make_trainer
    from harts.plan.planners import make_plan

    if kind == "expanded":
        chained = chained_expanded_plan((), budget, chunk_size, forest)
        return make_trainer("expanded", net) if chained is None else make_trainer("plan", net, chained)
    if kind == "tree":
        return make_trainer(kind, net)
    plan = make_plan(forest, planner, PlanConfig(microbatch_tokens=budget, chunk_size=chunk_size))
    return make_trainer("plan", net, plan)


def measure_step(trainer: Any, trajs: Sequence[Any], budget: int, device: str, steps: int = 3,
                 warmup: int = 1, profile: bool = True) -> dict[str, Any]:
    for _ in range(warmup):
        trainer.step(trajs, budget)
    times = []
    res = None
    for _ in range(steps):
        prepared = trainer.prepare(trajs, budget)
        _sync(device)
        t0 = time.perf_counter()
        res = trainer.step(trajs, budget, prepared=prepared)
        _sync(device)
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"seconds": statistics.median(times), "all_seconds": times,
                           "microbatches": len(res.microbatches), "rows": res.executed_rows}
    if profile and device.startswith("cuda"):
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        prepared = trainer.prepare(trajs, budget)
        _sync(device)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            trainer.step(trajs, budget, prepared=prepared)
            _sync(device)
            wall = time.perf_counter() - t0
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        device_s = sum(e.device_time for e in kernels) * 1e-6
        by_category: dict[str, float] = {}
        for e in kernels:
            cat = kernel_category(e.name)
            by_category[cat] = by_category.get(cat, 0.0) + e.device_time * 1e-6
        out["device_by_category"] = by_category
        # idle: the unprofiled step time not covered by kernels (the profiler slows the host)
        out.update(profiled_wall_s=wall, device_s=device_s, launches=len(kernels),
                   idle_s=max(0.0, out["seconds"] - device_s))
    return out


def kernel_category(name: str) -> str:
    """A CUDA kernel's category as `ExecutorCostModel.device_by_category` names them (by
    `harts.bench.step.kernel_kind`): attention, kda, optimizer, token-wise (the rest)."""
    from harts.bench.step import kernel_kind
    from harts.sim.flops import WorkKind

    kind = kernel_kind(name)
    if kind == WorkKind.ATTENTION_PAIRS:
        return "attention"
    if kind in (WorkKind.KDA_TOKENS, WorkKind.KDA_CHUNK_STEPS):
        return "kda"
    return "optimizer" if kind == WorkKind.PARAMETERS else "token-wise"


def op_rates(device: str, n: int = 4096, copy_bytes: int = 1 << 28, repeats: int = 5) -> dict[str, float]:
    """bf16 (CUDA) or fp32 (CPU) matrix-product FLOP/s at n^3 and device-copy bytes/s."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)

    def timed(fn) -> float:
        fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        _sync(device)
        return (time.perf_counter() - t0) / repeats

    t_mm = timed(lambda: a @ b)
    t_cp = timed(lambda: dst.copy_(src))
    return {"matmul_flops_per_s": 2.0 * n ** 3 / t_mm, "hbm_bytes_per_s": 2.0 * copy_bytes / t_cp,
            "matmul_n": n, "copy_bytes": copy_bytes}


def measure_instances(model: str, device: str, instances: Sequence[tuple[str, int, int]],
                      kinds: Sequence[str], steps: int, warmup: int, unsplit_budget: int,
                      profile: bool = True, log=print) -> list[dict[str, Any]]:
    """Every kind of every (family, seed, budget) instance: one measured row each."""
    from harts.tree import build_forest, shapes

    cfg, net = build_net(model, device)
    state = copy.deepcopy(net.state_dict())
    rows = []
    for family, seed, budget in instances:
        trajs = shapes.draw(family, seed, budget, vocab_size=cfg.vocab_size)
        forest = build_forest(trajs)
        for kind in kinds:
            net.load_state_dict(state)  # every case from the same weights
            b = max(unsplit_budget, forest.compact_tokens) if kind == "tree" else budget
            try:
                trainer = trainer_for(kind, net, forest, b, cfg.chunk_size)
                r = measure_step(trainer, trajs, b, device, steps, warmup, profile)
            except Exception as err:  # noqa: BLE001 - record and go on (e.g. out of memory)
                r = {"error": f"{type(err).__name__}: {err}"}
            row = {"instance": f"{family}/{seed}@{budget}", "family": family, "seed": seed, "budget": budget,
                   "kind": kind, "compact_rows": forest.compact_tokens, "expanded_tokens": forest.expanded_tokens,
                   **r}
            rows.append(row)
            log(f"[{row['instance']} {kind}] " + (f"{r['seconds']:.4f}s mbs {r['microbatches']}"
                                                  if "seconds" in r else r["error"]))
            trainer = None  # a prepared window run holds its trainer's hooks: free it before the next
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


LAUNCH_RATES = ("launches_per_step", "launches_per_microbatch", "launches_per_extra_kda_round",
                "launches_per_consumer", "launches_per_sequence")
DEVICE_RATES = ("device_scale", "half_efficiency_rows", "consumer_device_s_per_producer_row",
                "attention_tree_scale", "attention_causal_scale", "kda_scale")
HOST_RATES = ("host_s_per_launch", "step_fixed_s")


def measured_cases(prof: dict[str, Any], rows: Sequence[dict[str, Any]], model: str,
                   unsplit_budget: int) -> tuple[Any, list[Any], list[str]]:
    """(`prof` loaded, the executor model's cases of the measured `rows`, the rows left out
    because the planner no longer gives the plan they ran)."""
    from harts.config.models import get_model_config
    from harts.sim.fit_executor import case_of, step_of
    from harts.sim.hardware import profile_from_dict
    from harts.tree import build_forest, shapes

    hw = profile_from_dict(prof)
    cfg = get_model_config(model)
    cases, forests, stale = [], {}, []
    for r in rows:
        if "seconds" not in r:
            continue
        key = (r["family"], r["seed"], r["budget"])
        if key not in forests:
            forests[key] = build_forest(shapes.draw(*key, vocab_size=cfg.vocab_size))
        step = step_of(forests[key], r["kind"], r["budget"], cfg.chunk_size, unsplit_budget)
        if r.get("microbatches") not in (None, len(step.microbatches)):
            # measured on a plan the planner no longer gives: its launches and times are
            # another step's, not this one's
            stale.append(f"{r['instance']} {r['kind']}: measured {r['microbatches']} microbatches, "
                         f"planned {len(step.microbatches)} today")
            continue
        cases.append(case_of(r["instance"], r["kind"], step, cfg, hw, device_by_category=r.get("device_by_category"),
                             measured_s=r["seconds"], launches=r.get("launches"), device_s=r.get("device_s")))
    if not cases:
        raise RuntimeError("calibrate: no step could be measured" + (
            f" on a plan the planner still gives ({'; '.join(stale)})" if stale else ""))
    return hw, cases, stale


def fit_profile(prof: dict[str, Any], rows: Sequence[dict[str, Any]], model: str, unsplit_budget: int = 131072,
                here: str = "fitted") -> tuple[dict[str, Any], dict[str, Any]]:
    """`prof` (a hardware profile's JSON dict, copied) with its executor section fitted to
    measured steps (`measure_instances` rows): the launch counts to the counted launches,
    the device rates to the profiled kernel time, the host rates to the step wall time
    (without kernel profiles: the device scale and host rates to the wall time). A row whose
    microbatch count differs from the plan the planner gives its instance today is left out
    (listed in the notes' `skipped_plan_changed`). Returns (profile, fit notes). The
    profile's op rates are used as they are."""
    from harts.sim.executor_rates import CATEGORY_SCALES, executor_rates_to_dict
    from harts.sim.fit_executor import fit_launches, fit_rates
    from harts.sim.hardware import profile_from_dict

    prof = copy.deepcopy(prof)
    hw, cases, stale = measured_cases(prof, rows, model, unsplit_budget)
    fitted, notes = hw.executor, {"skipped_plan_changed": stale} if stale else {}
    sources = {k.removeprefix("executor."): v for k, v in hw.sources.items() if k.startswith("executor.")}
    base_name = prof.get("name", "base")
    whats = {k: f"as in the base profile {base_name}: {v.get('what', '')}" for k, v in prof["executor"].items()}
    here = f"{here} ({len(cases)} steps of {len({c.name for c in cases})} instances)"
    if all(c.launches for c in cases):
        fitted, notes["launches"] = fit_launches(fitted, cases)
        for n in LAUNCH_RATES:
            sources[n], whats[n] = "fitted", f"{here}: counted kernel launches"
    if all(c.device_s for c in cases):
        # the category scales only where the profiles say which kernels are which
        names = [n for n in DEVICE_RATES if n not in CATEGORY_SCALES or all(c.device_by_category for c in cases)]
        fitted, notes["device"] = fit_rates(fitted, cases, names, target="device")
        fitted, notes["step"] = fit_rates(fitted, cases, HOST_RATES)
        for n in names:
            sources[n], whats[n] = "fitted", (f"{here}: profiled kernel time" if n not in CATEGORY_SCALES else
                                              f"{here}: profiled kernel time of its category")
        for n in HOST_RATES:
            sources[n], whats[n] = "fitted", f"{here}: step wall time"
    else:
        names = ["device_scale", *HOST_RATES]
        fitted, notes["step"] = fit_rates(fitted, cases, names)
        for n in names:
            sources[n], whats[n] = "fitted", f"{here}: step wall time (no kernel profile on this device)"
    prof["executor"] = executor_rates_to_dict(fitted, sources, whats)
    profile_from_dict(prof)  # it loads
    return prof, notes


def calibrate(model: str, device: str, base: dict[str, Any], instances: Sequence[tuple[str, int, int]],
              steps: int = 2, warmup: int = 1, unsplit_budget: int = 131072, name: str | None = None,
              log=print) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A hardware profile (JSON dict) for this device: `base`'s, with the op rates and the
    executor section replaced by what was measured and fitted here; and the measured rows."""
    prof = copy.deepcopy(base)
    rates = op_rates(device, n=4096 if device.startswith("cuda") else 512,
                     copy_bytes=1 << 28 if device.startswith("cuda") else 1 << 24)
    what = f"measured by `harts sim calibrate` on {device}"
    prof["gpu"]["matmul_flops_per_s"] = {"value": rates["matmul_flops_per_s"], "source": "measured",
                                         "what": f"{what}: {rates['matmul_n']}^3 matrix product"}
    prof["gpu"]["hbm_bytes_per_s"] = {"value": rates["hbm_bytes_per_s"], "source": "measured",
                                      "what": f"{what}: device copy of {rates['copy_bytes']} bytes, read + written"}
    rows = measure_instances(model, device, instances, ("tree", "windows", "expanded"), steps, warmup,
                             unsplit_budget, log=log)
    prof, notes = fit_profile(prof, rows, model, unsplit_budget,
                              f"fitted by `harts sim calibrate` on {device}")
    _this_machine(prof, name, device, model, instances, notes, "calibrate")
    return prof, rows


# `calibrate_host`'s steps: window and expanded steps (`harts sim calibrate --host-only`
# takes them at 16k budgets: there the host issues a microbatch's launches in about the
# time its device runs them, as in the steps users simulate; at 8k the steps are wholly
# host-bound and a rate fitted to them priced one machine's 16k window steps 3-10% low,
# docs/BENCHMARKS.md, "Seeds 9 and 10 held out on a slow and a fast host")
HOST_KINDS = ("windows", "expanded")


def calibrate_host(model: str, device: str, base: dict[str, Any], instances: Sequence[tuple[str, int, int]],
                   steps: int = 3, warmup: int = 1, name: str | None = None,
                   log=print) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`base` (a profile of this GPU kind) with only its host rate measured here: the
    window and expanded steps of `instances` timed without a profiler, and
    `host_s_per_launch` fitted so the executor model, every other rate `base`'s, gives
    their times (least squares on the log error). Host speed differs between machines of
    one GPU kind by up to 1.5x, the kernels' speed by a few percent; this pins the one
    term a shipped profile cannot know, in the time of a few steps. Returns the profile
    and the measured rows."""
    from harts.sim.executor_rates import executor_rates_to_dict
    from harts.sim.fit_executor import UNSPLIT_BUDGET, fit_rates

    if "executor" not in base:
        raise ValueError("calibrate_host: the base profile has no executor section to keep (use `calibrate`)")
    # (no unsplit step among HOST_KINDS: the unsplit budget is the default's, unused)
    rows = measure_instances(model, device, instances, HOST_KINDS, steps, warmup, UNSPLIT_BUDGET, profile=False,
                             log=log)
    prof = copy.deepcopy(base)
    hw, cases, stale = measured_cases(prof, rows, model, UNSPLIT_BUDGET)
    fitted, fit = fit_rates(hw.executor, cases, ["host_s_per_launch"])
    notes = {"step": fit, **({"skipped_plan_changed": stale} if stale else {})}
    sources = {k.removeprefix("executor."): v for k, v in hw.sources.items() if k.startswith("executor.")}
    whats = {k: f"as in the base profile {prof.get('name', 'base')}: {v.get('what', '')}"
             for k, v in prof["executor"].items()}
    sources["host_s_per_launch"] = "fitted"
    whats["host_s_per_launch"] = (f"fitted alone by `harts sim calibrate --host-only` on {device} to the step "
                                  f"wall time of {len(cases)} steps ({', '.join(sorted({c.name for c in cases}))})")
    prof["executor"] = executor_rates_to_dict(fitted, sources, whats)
    _this_machine(prof, name, device, model, instances, notes, "calibrate --host-only")
    return prof, rows


def _this_machine(prof: dict[str, Any], name: str | None, device: str, model: str,
                  instances: Sequence[tuple[str, int, int]], notes: dict[str, Any], how: str) -> None:
    """Name `prof` for this machine: its device, provenance and `host_machines` (this
    machine's host rate alone, so `harts sim` reports no spread over other machines' hosts)."""
    from harts.bench import host_probe
    from harts.bench.provenance import provenance
    from harts.sim.hardware import profile_from_dict

    prof["name"] = name or f"calibrated-{device}"
    prof["device"] = (torch.cuda.get_device_name(0) if device.startswith("cuda") else f"{device} ({model})")
    prof["provenance"] = {**provenance(), "model": model, "instances": [list(i) for i in instances],
                          "fit": notes}
    prof["host_machines"] = [{"host_s_per_launch": prof["executor"]["host_s_per_launch"]["value"],
                              "fitted_to": f"`harts sim {how}` on this machine ({prof['device']})",
                              "probe": host_probe.probe(device)}]
    profile_from_dict(prof)  # it loads
