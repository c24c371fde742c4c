"""`harts sim calibrate` and `harts sim validate`: the simulator measured on this machine.

    harts sim calibrate --out my-gpu.json [--device cuda|cpu] [--model tiny-h200]
    harts sim calibrate --host-only --out my-h100.json [--base h100]
    harts sim validate --input rollouts.jsonl --model tiny-h200 --planner l1l2 \\
        --microbatch-tokens 16384 --hardware my-gpu.json [--json]

`calibrate` runs op micro-benchmarks and a few real steps (unsplit tree, l1l2 windows and
packed expanded of `harts.tree.shapes` instances) and writes a hardware profile whose
executor rates are fitted to them (harts.bench.sim_measure.calibrate): `--hardware FILE`
then simulates this machine. `--host-only` keeps the shipped profile of this GPU kind and
measures only its host rate, in a few window and expanded steps at 16k
(harts.bench.sim_measure.calibrate_host): machines of one GPU kind differ in host speed
by up to 1.5x, and a window step at 8-16k budgets moves with it. `validate` runs one plan
of the user's rollouts on the device and prints the simulated step beside the measured one: step total, device (kernel) time,
host-bound idle time, and the device time by op category (attention, KDA, token-wise,
collectives, window terms, optimizer; the device side is measured on CUDA, under
torch.profiler, where window stash kernels count as token-wise), and the host rate at
which the profile would price the step as measured (`host_rate_to_match`): where it is
far from the profile's, the error is this machine's host, which `calibrate --host-only`
measures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from harts.cli.common import (
    UserError,
    check_output_path,
    format_table,
    print_json,
    say_wrote,
    write_output,
)

DEFAULT_INSTANCES = {"cuda": "grpo/0@8192,long-chain/0@16384,swe-tree/0@8192,fanout/0@8192",
                     "cpu": "grpo/0@256,long-chain/0@256"}
HOST_INSTANCES = {"cuda": "grpo/0@16384,bushy/0@16384", "cpu": "grpo/0@256"}


def add_measure_parsers(sim_subparsers: argparse._SubParsersAction) -> None:
    c = sim_subparsers.add_parser("calibrate", help="measure a hardware profile on this machine's GPU (op "
                                  "micro-benchmarks and a few real steps) and write it")
    c.add_argument("--out", required=True, help="hardware profile JSON to write (its folder must exist)")
    c.add_argument("--device", help="cuda (default where available) or cpu")
    c.add_argument("--model", help="model config (default: tiny-h200 on cuda, tiny-cpu on cpu)")
    c.add_argument("--base", help="profile whose assumptions (interconnect, attention) are kept (default h200; "
                   "with --host-only, the shipped profile of this GPU: h100 or h200)")
    c.add_argument("--host-only", action="store_true", help="keep --base's rates and measure only the host's "
                   "seconds per launch (a few steps, no profiler)")
    c.add_argument("--instances", help="family/seed@budget list of harts.tree.shapes instances "
                   f"(default cuda: {DEFAULT_INSTANCES['cuda']}; cpu: {DEFAULT_INSTANCES['cpu']}; "
                   f"--host-only: {HOST_INSTANCES['cuda']} on cuda)")
    c.add_argument("--steps", type=int, default=3, help="timed steps per case (median)")
    c.add_argument("--warmup", type=int, default=1)
    c.add_argument("--unsplit-budget", type=int, default=131072, help="budget of the unsplit tree case")
    c.add_argument("--rows-out", help="also write the measured steps (JSON)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_calibrate)
    v = sim_subparsers.add_parser("validate", help="run a plan on this machine and print simulated vs measured")
    v.add_argument("--input", required=True, metavar="JSONL", help="rollout JSONL file (token ids needed)")
    v.add_argument("--model", default="tiny-h200", help="model config")
    v.add_argument("--planner", default="l1l2", help="expanded-ffd, l1, l1l2, ortools-ffd")
    v.add_argument("--microbatch-tokens", type=int, default=16384)
    v.add_argument("--hardware", default="h200", help="profile name or JSON path (harts sim calibrate)")
    v.add_argument("--device", help="cuda (default where available) or cpu")
    v.add_argument("--steps", type=int, default=3)
    v.add_argument("--warmup", type=int, default=1)
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_validate)


def _device(name: str | None) -> str:
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"--device must be cuda or cpu, got {name!r}")
    return name


def _instances(text: str) -> list[tuple[str, int, int]]:
    from harts.tree.shapes import FAMILIES, LONG_FAMILIES

    known = [*FAMILIES, *LONG_FAMILIES]
    out = []
    for item in (t for t in text.split(",") if t):
        try:
            family, rest = item.split("/")
            seed, budget = rest.split("@")
            out.append((family, int(seed), int(budget)))
        except ValueError:
            raise UserError(f"--instances: {item!r} is not family/seed@budget") from None
        if family not in known:
            raise UserError(f"--instances: unknown family {family!r}; known: {', '.join(known)}")
    return out


def _hardware_dict(name: str) -> dict[str, Any]:
    from harts.sim.hardware import HARDWARE_DIR

    path = Path(name) if Path(name).suffix else HARDWARE_DIR / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"hardware profile {name!r}: {err}") from None


def _shipped_base(device: str) -> str:
    """The shipped profile of this machine's GPU kind (`--host-only` without `--base`)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    for name in ("h100", "h200"):
        if name in gpu.lower():
            return name
    raise UserError(f"--host-only: no shipped profile for {gpu!r}; give --base (a profile of this GPU kind, "
                    "or run `harts sim calibrate` without --host-only)")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from harts.bench.sim_measure import calibrate, calibrate_host
    from harts.sim.executor_rates import BASE_EXECUTOR

    check_output_path(args.out, "--out")
    if args.rows_out:
        check_output_path(args.rows_out, "--rows-out")
    if args.host_only and args.device is None:
        import torch

        if not torch.cuda.is_available():
            raise UserError("--host-only measures a GPU machine's host: no CUDA device here "
                            "(--device cpu --base PROFILE runs it on this CPU)")
    device = _device(args.device)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    model = args.model or ("tiny-h200" if kind == "cuda" else "tiny-cpu")
    log = (lambda *_: None) if args.json else print
    if args.host_only:
        base = _hardware_dict(args.base or _shipped_base(device))
        instances = _instances(args.instances or HOST_INSTANCES[kind])
        if "executor" not in base:  # before any step is measured
            raise UserError(f"--host-only: the base profile {args.base!r} has no executor rates to keep")
        prof, rows = calibrate_host(model, device, base, instances, steps=args.steps, warmup=args.warmup,
                                    name=Path(args.out).stem, log=log)
    else:
        base = _hardware_dict(args.base or "h200")
        base.setdefault("executor", json.loads(json.dumps(BASE_EXECUTOR)))
        instances = _instances(args.instances or DEFAULT_INSTANCES[kind])
        prof, rows = calibrate(model, device, base, instances, steps=args.steps, warmup=args.warmup,
                               unsplit_budget=args.unsplit_budget, name=Path(args.out).stem, log=log)
    write_output(args.out, "--out", json.dumps(prof, indent=1) + "\n")
    if args.rows_out:
        write_output(args.rows_out, "--rows-out", json.dumps({"provenance": prof["provenance"], "rows": rows},
                                                             indent=1, default=str))
    if args.json:
        print_json({"profile": args.out, "executor": {k: v["value"] for k, v in prof["executor"].items()},
                    "fit": prof["provenance"]["fit"]})
    else:
        print(format_table(["rate", "value", "source"],
                           [[k, f"{v['value']:.4g}", v["source"]] for k, v in prof["executor"].items()]))
    say_wrote(args.out, args.json)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from harts.bench import host_probe
    from harts.bench.sim_measure import measure_step
    from harts.config.models import get_model_config
    from harts.config.parallel import ParallelConfig
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.plan.schedule import build_schedule
    from harts.plan.step import step_from_plan
    from harts.sim.executor import CATEGORIES, ExecutorCostModel
    from harts.sim.fit_executor import case_of, host_rate_to_match
    from harts.sim.hardware import load_hardware
    from harts.sim.simulate import simulate_step
    from harts.tree import build_forest
    from harts.tree.io import RolloutFormatError, load_jsonl

    device = _device(args.device)
    try:
        cfg = get_model_config(args.model)
        hw = load_hardware(args.hardware)
    except (KeyError, OSError, ValueError) as err:
        raise UserError(str(err)) from None
    try:
        trajs = load_jsonl(args.input, vocab_size=cfg.vocab_size)
    except (RolloutFormatError, OSError) as err:
        raise UserError(f"--input {args.input}: {err}") from None
    forest = build_forest(trajs)
    budget = args.microbatch_tokens
    try:
        plan = make_plan(forest, args.planner, PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size))
        cost = ExecutorCostModel(cfg, ParallelConfig(dp=1, pp=1, ep=1), hw)
    except (KeyError, ValueError) as err:
        raise UserError(str(err)) from None
    step = step_from_plan(plan, forest, cfg.chunk_size)
    sim = simulate_step(step, build_schedule("consumer-1f1b", step, 1), cost)
    sim_by = cost.device_by_category(step)
    sim_device = sum(sim_by.values())
    measured = _measure(args, device, cfg, forest, trajs, budget, measure_step)
    out = {"input": args.input, "model": cfg.name, "planner": args.planner, "microbatch_tokens": budget,
           "hardware": hw.name, "device": device, "microbatches": plan.num_microbatches,
           "simulated": {"step_seconds": sim.step_seconds, "device_seconds": sim_device,
                         "host_idle_seconds": sim.step_seconds - sim_device, "device_by_category": sim_by},
           "measured": {"step_seconds": measured["seconds"], "all_seconds": measured["all_seconds"],
                        "microbatches": measured["microbatches"], "device_seconds": measured.get("device_s"),
                        "host_idle_seconds": measured.get("idle_s"), "launches": measured.get("launches"),
                        "device_by_category": measured.get("device_by_category")}}
    out["error"] = sim.step_seconds / measured["seconds"] - 1
    # the host speed the measurement implies: what `harts sim calibrate --host-only` would
    # fit to this step alone (None where no host rate explains it)
    case = case_of(args.input, args.planner, step, cfg, hw)
    out["profile_host_s_per_launch"] = hw.executor.host_s_per_launch
    out["host_s_per_launch_to_match"] = host_rate_to_match(hw.executor, case, measured["seconds"])
    # this machine's host beside it (harts.bench.host_probe: seconds per small dispatched op)
    out["host_probe"] = host_probe.probe(device)
    if args.json:
        print_json(out)
        return 0
    s, m = out["simulated"], out["measured"]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    print(f"{args.input}: {cfg.name}, {args.planner} at {budget} tokens, {plan.num_microbatches} microbatches, "
          f"profile {hw.name}, measured on {device}")
    mby = m["device_by_category"] or {}
    print(format_table(["seconds", "simulated", "measured"],
                       [[k, fmt(s[f"{k}_seconds"]), fmt(m[f"{k}_seconds"])] for k in ("step", "device", "host_idle")]
                       + [[f"  device: {c}", fmt(s["device_by_category"][c]),
                           fmt(mby.get(c)) if m["device_by_category"] is not None else "-"] for c in CATEGORIES]))
    print(f"step error {100 * out['error']:+.1f}%")
    h, h0 = out["host_s_per_launch_to_match"], out["profile_host_s_per_launch"]
    if h is None:
        print(f"no host rate within 0-10x the profile's ({h0 * 1e6:.1f} us per launch) prices this step as measured: "
              "the error is not the host's")
    else:
        print(f"host rate that prices this step as measured: {h * 1e6:.1f} us per launch (profile: {h0 * 1e6:.1f}; "
              "telling where the step is host-bound, as window steps at 8-16k are); "
              "`harts sim calibrate --host-only` fits it on this machine")
    return 0


def _measure(args, device, cfg, forest, trajs, budget, measure_step) -> dict[str, Any]:
    from harts.bench.sim_measure import build_net, trainer_for

    _, net = build_net(cfg.name, device)
    kind = "expanded" if args.planner == "expanded-ffd" else "plan"
    trainer = trainer_for(kind, net, forest, budget, cfg.chunk_size, planner=args.planner)
    return measure_step(trainer, trajs, budget, device, steps=args.steps, warmup=args.warmup)
