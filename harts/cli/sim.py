"""`harts sim ...`: simulate a training step (plan + pipeline schedule) on a modelled cluster.

    harts sim --workload swe-treestep-8 --planner l1l2 --schedule consumer-1f1b \\
              --model tiny --gpus 8 --json
    harts sim sweep --workload swe-treestep-8 --model tiny --gpus 8 --gantt sweep.png
    harts sim fit --profile measured.json --out calibration.json
    harts sim calibrate --out my-gpu.json          (harts/cli/sim_measure.py)
    harts sim validate --input rollouts.jsonl --model tiny-h200 --hardware my-gpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

from harts.cli.common import (
    UserError,
    atomic_output,
    check_output_path,
    format_table,
    print_json,
    say_wrote,
    write_output,
)
from harts.cli.model_source import add_model_args, model_config
from harts.cli.sim_measure import add_measure_parsers
from harts.cli.sim_rollout import add_rollout_parser

SCHEDULE_NAMES = ("non-overlap", "overlap-bwd-first", "consumer-1f1b")
PLANNER_NAMES = ("expanded-ffd", "ortools-ffd", "l1", "l1l2")
BASELINE = "expanded-ffd"


def _add_common(p: argparse.ArgumentParser, sweep: bool) -> None:
    src = p.add_mutually_exclusive_group(required=sweep)
    src.add_argument("--workload", help="workload preset (harts workload presets)"
                     + ("; comma-separated for several" if sweep else ""))
    src.add_argument("--input", metavar="JSONL", help="your own rollouts: a rollout JSONL file (harts/tree/io.py's "
                     "format; token ids are not needed by the simulator, only the trees)"
                     + ("; comma-separated for several" if sweep else ""))
    add_model_args(p, "tiny", "model config name (tiny, flash, tiny-cpu, kimi-linear-48b-a3b)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (DP x PP)")
    p.add_argument("--dp", type=int, help="data-parallel replicas (default: from --gpus)")
    p.add_argument("--pp", type=int, help="pipeline stages (default: 2 for tiny at >= 8 GPUs, 4 for flash)")
    p.add_argument("--ep", type=int, help="expert parallelism inside a stage's DP group (default: the "
                   "largest power of two dividing DP and the expert count, at most 8)")
    if sweep:
        p.add_argument("--microbatch-tokens", type=_budgets, help="planner token budget (default: the preset's "
                       "own); comma-separated for several (which budget to train at: each is planned and "
                       "simulated, with its peak memory)")
    else:
        p.add_argument("--microbatch-tokens", type=int, help="planner token budget (default: the preset's own)")
    p.add_argument("--hardware", default="h200", help="hardware profile: h100, h200 (measured, shipped), "
                   "h200-harts, or a JSON path (harts sim calibrate writes one)")
    p.add_argument("--cost-model", help="executor (the default where the profile has executor rates: each "
                   "action's device and host launch time, the host running ahead), roofline, or calibrated")
    p.add_argument("--calibration", help="calibration JSON (harts sim fit) for --cost-model calibrated")
    p.add_argument("--no-recompute", action="store_true", help="keep all activations (no recomputation)")
    p.add_argument("--seed", type=int, default=0, help="planner seed")
    p.add_argument("--window-floors", choices=("off", "auto"), default="auto",
                   help="l1l2 on one pipeline stage: price each microbatch at least at its host-bound floor "
                        "(auto, the default: harts.sim.executor.window_floors for the model on --hardware at the "
                        "budget, where the profile has executor rates), so windows are chosen only where they "
                        "pay; off: rows alone")
    p.add_argument("--ep-lockstep", action=argparse.BooleanOptionalAction, default=True,
                   help="run the k-th passes of an EP group together, as EP all-to-alls force (default; "
                        "--no-ep-lockstep: free-running replicas, all-to-all as bandwidth only)")
    p.add_argument("--json", action="store_true", help="print JSON")


def register(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="simulate a training step: planners x pipeline schedules on a cluster model")
    _add_common(sim, sweep=False)
    sim.add_argument("--planner", default="l1l2", help=f"step planner ({', '.join(PLANNER_NAMES)})")
    sim.add_argument("--schedule", default="consumer-1f1b", help=f"pipeline schedule ({', '.join(SCHEDULE_NAMES)})")
    sim.add_argument("--trace", help="write the execution trace (Chrome trace-event JSON; its folder must exist)")
    sim.add_argument("--gantt", help="write a Gantt chart (PNG; its folder must exist)")
    sim.add_argument("--schedule-out", help="write the schedule (text form; its folder must exist)")
    sim.set_defaults(func=cmd_sim)
    ssub = sim.add_subparsers(dest="sim_command", metavar="ACTION")
    sw = ssub.add_parser("sweep", help="planners x schedules: Table-4/Table-6-style comparison")
    _add_common(sw, sweep=True)
    sw.add_argument("--planners", default=",".join(PLANNER_NAMES))
    sw.add_argument("--schedules", default=",".join(SCHEDULE_NAMES))
    sw.add_argument("--schedule-planner", default="l1l2", help="planner of the schedule table")
    sw.add_argument("--gantt", help="write the Gantt charts of the schedule table to this one PNG, a panel per "
                    "workload and schedule on one time axis (its folder must exist)")
    sw.set_defaults(func=cmd_sweep)
    fit = ssub.add_parser("fit", help="fit the calibrated cost model to a measured profile")
    fit.add_argument("--profile", required=True, help="profile JSON or CSV (harts.sim.profile/v1)")
    fit.add_argument("--out", required=True, help="calibration JSON to write (its folder must exist)")
    fit.add_argument("--json", action="store_true", help="print the calibration as JSON")
    fit.set_defaults(func=cmd_fit)
    add_rollout_parser(ssub)
    add_measure_parsers(ssub)


# ---- shared setup ---------------------------------------------------------------------


class _Setup:
    def __init__(self, args: argparse.Namespace):
        from harts.config.parallel import ParallelConfig
        from harts.sim.hardware import load_hardware
        from harts.sim.parallel import default_ep, default_parallel

        self.model = model_config(args)  # --model, or --model-path's config.json
        try:
            self.hardware = load_hardware(args.hardware)
        except (KeyError, OSError, ValueError) as err:
            raise UserError(f"hardware profile: {err}") from None
        if args.gpus < 1:
            raise UserError("--gpus must be >= 1")
        try:
            base = default_parallel(self.model, args.gpus)
            pp = args.pp or base.pp
            dp = args.dp or args.gpus // pp
            if dp * pp != args.gpus:
                raise UserError(f"--dp {dp} x --pp {pp} != --gpus {args.gpus}")
            ep = args.ep or default_ep(self.model, dp)
            self.parallel = ParallelConfig(dp=dp, pp=pp, ep=ep)
        except ValueError as err:
            raise UserError(str(err)) from None
        self.cost_kwargs: dict[str, Any] = {"recompute": not args.no_recompute}
        if args.cost_model is None:
            args.cost_model = "executor" if self.hardware.executor is not None else "roofline"
        if args.cost_model == "calibrated":
            from harts.sim.profile import load_calibration

            if not args.calibration:
                raise UserError("--cost-model calibrated needs --calibration FILE (harts sim fit)")
            try:
                self.cost_kwargs["calibration"] = load_calibration(args.calibration)
            except (OSError, ValueError, KeyError) as err:
                raise UserError(f"calibration: {err}") from None
        self.cost_model = args.cost_model
        self.args = args
        self._forests: dict[str, Any] = {}
        self.inputs = set(_split(args.input))  # the sources that are rollout files, not presets

    def forest(self, workload: str) -> Any:
        """The step's forest: a preset's structure, or the trees of a rollout file."""
        from harts.tree.workload import generate, preset

        if workload not in self._forests:
            if workload in self.inputs:
                from harts.cli.common import rollout_error
                from harts.tree.build import build_forest
                from harts.tree.io import RolloutFormatError, load_jsonl

                try:
                    self._forests[workload] = build_forest(load_jsonl(workload))
                except RolloutFormatError as err:
                    raise rollout_error(err) from None
                except OSError as err:
                    raise UserError(f"--input {workload}: {err.strerror or err}", file=workload,
                                    field="--input") from None
                return self._forests[workload]
            try:
                self._forests[workload] = generate(preset(workload)).forest()
            except KeyError as err:
                raise UserError(str(err.args[0])) from None
        return self._forests[workload]

    def step(self, workload: str, planner: str, budget: int | None = None) -> tuple[Any, Any]:
        """(plan, step) of `planner` at `budget` (None: --microbatch-tokens, else the default)."""
        from harts.config.plan import PlanConfig
        from harts.plan.planners import make_plan
        from harts.plan.step import step_from_plan

        forest = self.forest(workload)
        # plan for the pipeline that is simulated (microbatches enough to fill its stages)
        kw: dict[str, Any] = {"dp": self.parallel.dp, "pp": self.parallel.pp, "seed": self.args.seed,
                              "ep": self.parallel.ep if self.parallel.pp == 1 else 1}
        budget = budget or self.args.microbatch_tokens
        if budget:
            kw["microbatch_tokens"] = budget
        elif workload in self.inputs:  # the planners' default budget
            from harts.config.plan import DEFAULT_MICROBATCH_TOKENS

            kw["microbatch_tokens"] = DEFAULT_MICROBATCH_TOKENS
        else:  # the preset's own budget
            from harts.tree.workload import preset

            kw["microbatch_tokens"] = preset(workload).microbatch_tokens
        if getattr(self.args, "window_floors", "off") == "auto" and self.hardware.executor is not None:
            from harts.sim.executor import plan_floors

            kw.update(plan_floors(self.model, self.hardware, kw["microbatch_tokens"]))
        try:
            plan = make_plan(forest, planner, PlanConfig(**kw))
        except ValueError as err:
            raise UserError(f"planner {planner}: {err}") from None
        return plan, step_from_plan(plan, forest, self.model.chunk_size)

    def simulate(self, step: Any, schedule: str, host_s_per_launch: float | None = None) -> Any:
        """`host_s_per_launch`: the executor model with this host rate instead of the profile's."""
        from harts.plan.schedule import build_schedule
        from harts.sim.costs import make_cost_model
        from harts.sim.simulate import simulate_step

        hw = self.hardware
        if host_s_per_launch is not None:
            from dataclasses import replace

            hw = replace(hw, executor=hw.executor.with_values(host_s_per_launch=host_s_per_launch))
        try:
            cost = make_cost_model(self.cost_model, self.model, self.parallel, hw, **self.cost_kwargs)
            sched = build_schedule(schedule, step, self.parallel.pp)
        except (KeyError, ValueError) as err:
            raise UserError(str(err.args[0]) if isinstance(err, KeyError) else str(err)) from None
        return simulate_step(step, sched, cost, ep_lockstep=self.args.ep_lockstep)

    def over_hosts(self, step: Any, schedule: str, res: Any) -> list[float] | None:
        """The step's seconds at the slowest and the fastest host measured on this GPU kind
        (the profile's `host_machines`), where the executor model prices it and at least
        two machines differ: the spread host speed alone puts on the prediction. `res`:
        the step simulated at the profile's own rate (not simulated again)."""
        hosts = sorted(set(self.hardware.host_machines))
        if self.cost_model != "executor" or len(hosts) < 2:
            return None
        own = self.hardware.executor.host_s_per_launch
        return sorted(res.step_seconds if h == own else self.simulate(step, schedule, h).step_seconds
                      for h in (hosts[0], hosts[-1]))


def _budgets(text: str) -> list[int]:
    """--microbatch-tokens of `harts sim sweep`: one budget or several, comma-separated."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token budgets separated by commas, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive token budgets, got {text!r}")
    return values


def _split(value: str | None) -> list[str]:
    return [v for v in (value or "").split(",") if v]


def _row(workload: str, planner: str, plan: Any, res: Any) -> dict[str, Any]:
    return {
        "workload": workload,
        "planner": planner,
        "microbatch_tokens": plan.microbatch_tokens,
        "microbatches": plan.num_microbatches,
        "executed_tokens": plan.executed_tokens,
        "compression": plan.expanded_tokens / max(1, plan.executed_tokens),
        "plan_seconds": plan.plan_seconds,
        # (dp > 1) trees split over the replicas, the window trees of each
        # (harts.plan.planners.tree_split)
        "split_trees": [int(k) for k in plan.info.get("split_trees", [])],
        **res.to_json(),
    }


# ---- commands -------------------------------------------------------------------------


def cmd_sim(args: argparse.Namespace) -> int:
    if not args.workload and not args.input:
        raise UserError("harts sim needs --workload PRESET or --input JSONL (or an action: sweep, fit, rollout)")
    for flag, path in (("--trace", args.trace), ("--gantt", args.gantt), ("--schedule-out", args.schedule_out)):
        if path:
            check_output_path(path, flag)
    setup = _Setup(args)
    source = args.input or args.workload
    plan, step = setup.step(source, args.planner)
    res = setup.simulate(step, args.schedule)
    out = _row(source, args.planner, plan, res)
    spread = setup.over_hosts(step, args.schedule, res)
    if spread is not None:
        out["step_seconds_over_hosts"] = spread
    out["model"] = setup.model.name
    out["gpus"] = args.gpus
    out["hardware"] = setup.hardware.name
    out["cost_model"] = setup.cost_model
    written = []
    if args.trace:
        from harts.sim.trace_io import trace_to_chrome

        meta = {k: out[k] for k in ("workload", "planner", "schedule", "model", "parallel")}
        written.append(write_output(args.trace, "--trace", json.dumps(trace_to_chrome(res.trace, meta))))
        out["trace"] = args.trace
    if args.gantt:
        from harts.sim.gantt import plot_gantt

        with atomic_output(args.gantt, "--gantt") as tmp:
            plot_gantt(res.trace, tmp, title=_title(out))
        written.append(args.gantt)
        out["gantt"] = args.gantt
    if args.schedule_out:
        written.append(write_output(args.schedule_out, "--schedule-out", res.schedule.to_text()))
        out["schedule_file"] = args.schedule_out
    if args.json:
        print_json(out)
    else:
        for k, v in out.items():
            if k not in ("busy_seconds_by_kind", "trace", "gantt", "schedule_file") and v != []:
                print(f"{label(k):24s} {human(k, v)}")
        if spread is not None:
            lo, hi = min(setup.hardware.host_machines), max(setup.hardware.host_machines)
            print(f"(over hosts: the {setup.hardware.name} machines measured, {lo * 1e6:.0f}-{hi * 1e6:.0f} us per "
                  "launch; `harts sim calibrate --host-only` on yours measures its own)")
    for path in written:
        say_wrote(path, args.json)
    return 0


def label(key: str) -> str:
    """A result field's name as the table prints it: the JSON key without its unit suffix
    (`peak_memory_bytes` -> "peak memory"; `human` prints the unit beside the value)."""
    return key.removesuffix("_bytes").replace("_", " ")


def gib(nbytes: float) -> str:
    """Bytes in GiB (2**30), one decimal: how `harts sim` and `harts sim sweep` print memory."""
    return f"{nbytes / 2**30:,.1f}"


def human(key: str, value: Any) -> str:
    """A simulation result field as people read it: seconds and ratios to 3 significant
    digits, throughput in k tok/s, memory in GiB, fractions in percent."""
    if isinstance(value, list):
        return ", ".join(human(key, v) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key == "throughput":
        return f"{_sig3(value / 1e3)} k tok/s"
    if key.endswith("_bytes"):
        return f"{gib(value)} GiB"
    if key.endswith("_seconds") or "_seconds_" in key:
        return f"{_sig3(value)} s"
    if key.endswith("_fraction"):
        return f"{100 * value:.1f}%"
    if key == "compression":
        return f"{_sig3(value)}x"
    if isinstance(value, int):
        return f"{value:,}"
    return _sig3(value)


def _sig3(x: float) -> str:
    """`x` to 3 significant digits, without an exponent for the sizes seen here."""
    import math

    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{digits}f}"


def _title(row: dict[str, Any]) -> str:
    return (f"{row['workload']} / {row['planner']} / {row['schedule']} / {row.get('model', '')} "
            f"{row['parallel']}: {row['throughput'] / 1e3:,.1f} k expanded tok/s, "
            f"step {row['step_seconds']:.2f} s, bubble {row['bubble_fraction'] * 100:.1f}%")


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.gantt:
        check_output_path(args.gantt, "--gantt")
    setup = _Setup(args)
    workloads = _split(args.input) or _split(args.workload)
    planners = [p for p in args.planners.split(",") if p]
    schedules = [s for s in args.schedules.split(",") if s]
    sched_planner = args.schedule_planner if args.schedule_planner in planners else planners[-1]
    default_schedule = "consumer-1f1b" if "consumer-1f1b" in schedules else schedules[0]
    rows: list[dict[str, Any]] = []
    sched_rows: list[dict[str, Any]] = []
    panels: list[tuple[Any, str]] = []  # (trace, title) of each schedule-table row, for --gantt
    t0 = time.perf_counter()
    for wl, budget in itertools.product(workloads, args.microbatch_tokens or [None]):
        results: dict[str, dict[str, Any]] = {}
        for planner in planners:
            plan, step = setup.step(wl, planner, budget)
            for schedule in schedules if planner == sched_planner else [default_schedule]:
                res = setup.simulate(step, schedule)
                row = _row(wl, planner, plan, res)
                if schedule == default_schedule:
                    results[planner] = row
                if planner == sched_planner:
                    sched_rows.append(row)
                    if args.gantt:
                        panels.append((res.trace, _title({**row, "model": setup.model.name})))
                        row["gantt"] = args.gantt
        base = results.get(BASELINE)
        for planner in planners:
            row = results[planner]
            row["speedup_vs_expanded"] = row["throughput"] / base["throughput"] if base else None
            rows.append(row)
    gantts = []
    if args.gantt:
        from harts.sim.gantt import plot_gantt_panels

        with atomic_output(args.gantt, "--gantt") as tmp:
            plot_gantt_panels(panels, tmp)
        gantts.append(args.gantt)
    meta = {"model": setup.model.name, "gpus": args.gpus, "parallel": setup.parallel.describe(),
            "hardware": setup.hardware.name, "cost_model": setup.cost_model,
            "sweep_seconds": time.perf_counter() - t0}
    if args.json:
        print_json({**meta, "planners": rows, "schedules": sched_rows})
        for path in gantts:
            say_wrote(path, True)
        return 0
    print(f"model {meta['model']}, {args.gpus} GPUs ({meta['parallel']}), {meta['hardware']}, "
          f"{meta['cost_model']} cost model, schedule {default_schedule}")
    print(format_table(
        ["workload", "budget", "planner", "mbs", "compression", "step s", "k tok/s", "speedup", "bubble %",
         "peak memory GiB", "plan s"],
        [[r["workload"], r["microbatch_tokens"], r["planner"], r["microbatches"], round(r["compression"], 3),
          round(r["step_seconds"], 3),
          round(r["throughput"] / 1e3, 1),
          "-" if r["speedup_vs_expanded"] is None else f"{r['speedup_vs_expanded']:.2f}x",
          round(100 * r["bubble_fraction"], 1), gib(r["peak_memory_bytes"]), round(r["plan_seconds"], 3)]
         for r in rows],
    ))
    print()
    print(f"pipeline schedules ({sched_planner})")
    print(format_table(
        ["workload", "budget", "schedule", "step s", "k tok/s", "bubble %", "peak memory GiB", "ep lockstep"],
        [[r["workload"], r["microbatch_tokens"], r["schedule"], round(r["step_seconds"], 3), round(r["throughput"] / 1e3, 1),
          round(100 * r["bubble_fraction"], 1), gib(r["peak_memory_bytes"]),
          f"{r['ep_lockstep']} ({r['ep_shadow_microbatches']} shadows)" if r["ep_lockstep"] else str(r["ep_lockstep"])]
         for r in sched_rows],
    ))
    if gantts:
        print()
    for path in gantts:
        say_wrote(path, False)
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from harts.sim.profile import fit_profile, load_profile

    check_output_path(args.out, "--out")
    try:
        header, ms = load_profile(args.profile)
    except (OSError, ValueError, json.JSONDecodeError) as err:
        raise UserError(f"profile: {err}") from None
    cal = fit_profile(ms, device=str(header.get("device", "")))
    write_output(args.out, "--out", json.dumps(cal.to_dict(), indent=1))
    if args.json:
        print_json(cal.to_dict())
        say_wrote(args.out, True)
        return 0
    print(format_table(
        ["op", "rows", "rel rms", "coefficients"],
        [[k, f.rows, round(f.rel_rms, 4), ", ".join(f"{n}={c:.3e}" for n, c in zip(f.features, f.coefficients, strict=True))]
         for k, f in sorted(cal.fits.items())],
    ))
    say_wrote(args.out, False)
    return 0
