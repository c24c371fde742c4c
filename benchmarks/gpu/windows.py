"""Sharing windows on the GPU: a tree split into producer + consumers against the same rows
as one microbatch and against the expanded baseline at the same budget.

    python3 benchmarks/gpu/windows.py [--profile] [--fidelity] [--resident] [--steps N] [--no-autotune] --out DIR

Workloads (`harts.tree.workload` presets, vocab_size 32768 as the other GPU runs): the
generator's swe-treestep-1 (one tree of 81,747 compact rows, longest trajectory 51,460),
and a bushier tree (the same preset with branching 4 and 16 leaves: 198k compact rows)
that `l1l2` splits into one producer and 4 consumers. Cases, each on a fresh `tiny-h200`
model in bf16 with activation recomputation:

- `tree`: the whole tree as one microbatch (`TreeTrainer`, budget 131072; 262144 for the
  bushy tree),
- `windows@B`: the `l1l2` plan at budget B (`PlanTrainer`), B = 65536 and 57344,
- `expanded@B`: the trajectory-expanded baseline at the same budgets,
- `windows-resident@B` (`--resident`): the first window plan with its producers' saved
  tensors kept on the device instead of in host memory (`PlanTrainer(offload_producers=False)`).

Per case: the median of `--steps` update steps (forward, backward, AdamW) after
`--warmup` steps, each timed with a device synchronisation and perf_counter, the step's
data side prepared before the timed region (`trainer.prepare`), plus one step timed with
everything inline; peak allocated memory over the timed steps (reset between cases); for
window plans each window's retained bytes (`WindowStats.retained_bytes`) beside the plan's
estimate (`producer_retention` x producer rows, in token units, and converted to bytes
with the unsplit tree step's measured activation bytes per row). Derived: speedup over
expanded at the same budget, window / unsplit step ratio, and the window speedup as a
fraction of the unsplit tree's. `--profile`: torch.profiler over one window step and one
unsplit step of swe-treestep-1 (device time by op, top 30). `--fidelity`: bf16 gradients
and losses of the window plan, the unsplit tree and a repacked expanded run against the
expanded step at the first budget, from the same weights (`fidelity_case`). Writes DIR/windows.json with
provenance (git revision, command, versions, GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

VOCAB = 32768
BUSHY = {"branching": 4, "rollouts_per_group": 16}


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _mem(fn: str) -> int:
    return int(getattr(torch.cuda, fn)()) if DEVICE == "cuda" else 0


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def provenance(argv: list[str]) -> dict:
    from harts.bench import host_probe

    root = Path(__file__).resolve().parents[2]

    def git(*a):
        if not (root / ".git").exists():  # a copy of the tree inside another checkout: not its revision
            return ""
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - no git on the device machine is fine
            return ""

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "fla", "cudnn", "numpy"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:  # noqa: BLE001
            versions[mod] = None
    return {
        "git_rev": os.environ.get("HARTS_GIT_REV") or git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")) if not os.environ.get("HARTS_GIT_REV") else None,
        "command": " ".join(["python3", *argv]),
        "versions": versions,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("HARTS_", "TRITON_"))},
        # this machine's host: seconds per small dispatched op (harts.bench.host_probe)
        "host_probe": host_probe.probe("cuda") if torch.cuda.is_available() else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _trainer(kind: str, trajs, budget: int, model: str, kernels=None, plan_config=None):
    """(trainer, plan or None) of `kind` on a fresh `model` (bf16 on CUDA, float32 on the
    CPU); `kernels`: a `KernelConfig` (None: the environment's); `plan_config`: `PlanConfig`
    fields of the l1l2 plan (windows kinds) and of the expanded-ffd plan's chains."""
    from harts.config.models import get_model_config
    from harts.exec.factory import chained_expanded_plan, make_trainer
    from harts.exec.model.model import build_model
    from harts.plan.planners import PlanConfig, make_plan
    from harts.tree import build_forest

    # what an earlier case left: a failed case's frames (its models, its activations) live in
    # reference cycles until a collection, and a collection inside the `except` that caught
    # it cannot free them; a case after a failed fidelity run started 12 GiB up
    _free()
    cfg = get_model_config(model)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    net = build_model(cfg, seed=0, dtype=dtype, device=DEVICE, recompute=True)
    if kind == "expanded":
        # a trajectory longer than the budget: the expanded-ffd plan's chain of windows, as
        # `harts train` runs it, so every microbatch stays within the budget
        chained = chained_expanded_plan(trajs, budget, cfg.chunk_size, **(plan_config or {}))
        if chained is not None:
            return make_trainer("plan", net, chained, kernels=kernels), chained
    if kind in ("expanded", "tree"):
        return make_trainer(kind, net, kernels=kernels), None
    floors = {}
    if kind == "windows-floored":
        floors = window_floors_here(cfg, budget)
    plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size,
                                                             **floors, **(plan_config or {})))
    # windows-resident: the producers' saved tensors left on the device (no HostOffload);
    # windows-stored: the producers' blocks not checkpointed, all they save in host memory
    return make_trainer("plan", net, plan, offload_producers=kind != "windows-resident",
                        producer_recompute=kind != "windows-stored", kernels=kernels), plan


def draw_case(case: str, vocab: int) -> tuple[list, int]:
    """(trajectories, budget) of "family/seed@budget" (`harts.tree.shapes.draw`) or
    "chains:NAME@budget" (benchmarks/gpu/chains.py's case NAME)."""
    if case.startswith("chains:"):
        import chains

        name, budget = case.removeprefix("chains:").split("@")
        return chains.instance(name)[0], int(budget)
    from harts.tree import shapes

    family, rest = case.split("/")
    seed, budget = (int(x) for x in rest.split("@"))
    return shapes.draw(family, seed, budget, vocab_size=vocab), budget


def case_runs(args: argparse.Namespace, vocab: int, skipped: list[str]):
    """(key "family/seed@budget kind", kind, trajectories, budget) for every case of
    `args.cases` ("family/seed@budget,...", drawn by `harts.tree.shapes.draw` once per case;
    "chains:NAME@budget": benchmarks/gpu/chains.py's case NAME)
    and kind of `args.kinds` ("windows,tree,..."; a `tree` runs the same rows unsplit at
    `args.unsplit_budget`); past `args.time_limit` seconds from the first, the keys left go
    to `skipped` instead."""

    t_start = time.perf_counter()
    for case in args.cases.split(","):
        trajs, budget = draw_case(case, vocab)
        for kind in args.kinds.split(","):
            key = f"{case} {kind}"
            if time.perf_counter() - t_start > args.time_limit:
                skipped.append(key)
                continue
            yield key, kind, trajs, args.unsplit_budget if kind == "tree" else budget


def case_error(err: BaseException) -> dict[str, str]:
    """A failed case's record (the suite goes on with the next)."""
    return {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}


def window_floors_here(cfg, budget: int) -> dict[str, float]:
    """`harts.sim.executor.plan_floors` for this GPU's shipped profile (h200 on an H200,
    else h100)."""
    from harts.sim.executor import plan_floors

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else ""
    return plan_floors(cfg, "h200" if "H200" in name else "h100", budget)


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """--no-autotune, --time-limit, --device, --out: what a per-case window script takes
    (`start_run` applies them)."""
    ap.add_argument("--no-autotune", action="store_true", help="each Triton kernel's first config that fits")
    ap.add_argument("--time-limit", type=float, default=540.0, help="start no new case past this many seconds")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs float32 (a smoke run of the script)")
    ap.add_argument("--out", default=".")


def start_run(args: argparse.Namespace) -> None:
    """The device the cases run on, and the first-config-that-fits autotuning if asked."""
    global DEVICE
    DEVICE = args.device
    if args.no_autotune:
        from common import no_autotune

        no_autotune()


def prepared_steps(trainer, trajs, budget: int, n: int) -> tuple[list[float], object]:
    """Wall seconds of `n` update steps, each prepared before its timed region (the data
    side off the clock) and timed between device synchronisations; and the last result."""
    times, res = [], None
    for _ in range(n):
        prepared = trainer.prepare(trajs, budget)
        _sync()
        t0 = time.perf_counter()
        res = trainer.step(trajs, budget, prepared=prepared)
        _sync()
        times.append(time.perf_counter() - t0)
    return times, res


def run_case(kind: str, trajs, budget: int, args, kernels=None, plan_config=None) -> dict:
    """One case's prepared steps (`prepared_steps`), peak memory and its plan's windows;
    `kernels`: a `KernelConfig` (None: the environment's); `plan_config`: `PlanConfig` fields
    of a windows kind's l1l2 plan."""
    trainer, plan = _trainer(kind, trajs, budget, args.model, kernels=kernels, plan_config=plan_config)
    for _ in range(args.warmup):
        trainer.step(trajs, budget)
    _sync()
    base = _mem("memory_allocated")
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, res = prepared_steps(trainer, trajs, budget, args.steps)
    peak = _mem("max_memory_allocated")
    t0 = time.perf_counter()
    trainer.step(trajs, budget)
    _sync()
    inline = time.perf_counter() - t0
    out = {
        "kind": kind, "budget": budget, "seconds": statistics.median(times), "all_seconds": times,
        "inline_seconds": inline, "peak_bytes": int(peak), "base_bytes": int(base),
        "activation_peak_bytes": int(peak - base), "microbatches": len(res.microbatches),
        "rows": res.executed_rows, "expanded_tokens": res.tokens, "loss": res.losses["loss"],
        "grad_norm": res.grad_norm,
        "roles": [m.get("role") for m in res.layout],
    }
    if plan is not None:
        out["windows"] = [{"producer": w.producer, "consumers": w.consumers, "producer_rows": w.producer_rows,
                           "context_rows_read": w.context_rows_read, "retained_bytes": w.retained_bytes,
                           "held_bytes": w.held_bytes, "offloaded_bytes": w.offloaded_bytes,
                           "stash_host_bytes": w.stash_host_bytes,
                           "plan_retained_tokens": plan.producer_retention * w.producer_rows}
                          for w in trainer.windows]
        out["producer_retention"] = plan.producer_retention
        out["peak_retained_bytes"] = trainer.peak_retained_bytes
        # what the planner chose (l1l2 with floors: "chosen": "l1" for L1's windowless plan)
        # and how `harts.plan.order` ordered the blocks, where it moved them
        out["plan_info"] = {k: plan.info[k] for k in ("chosen", "block_order") if k in plan.info}
    del trainer, res  # a window run's result holds the trainer's layout: free both here
    _free()
    return out


def profile_case(kind: str, trajs, budget: int, args, top: int = 30) -> dict:
    from torch.profiler import ProfilerActivity, profile

    trainer, _ = _trainer(kind, trajs, budget, args.model)
    trainer.step(trajs, budget)
    prepared = trainer.prepare(trajs, budget)
    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        trainer.step(trajs, budget, prepared=prepared)
        _sync()
        wall = time.perf_counter() - t0
    ops = sorted(((e.key, e.self_device_time_total / 1e6, e.count, e.self_cpu_time_total / 1e6)
                  for e in prof.key_averages()), key=lambda r: -r[1])
    kernel_s = sum(e.device_time / 1e6 for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    del trainer, prepared
    _free()
    return {"kind": kind, "budget": budget, "wall_s": wall, "kernel_s": kernel_s,
            "top_ops": [{"op": k, "device_s": s, "calls": c} for k, s, c, _ in ops[:top] if s > 0],
            "all_ops": [{"op": k, "device_s": s, "calls": c, "self_cpu_s": cpu} for k, s, c, cpu in ops],
            # host time spent waiting for the device, and the device's idle share of the wall
            "sync_cpu_s": sum(cpu for k, _, _, cpu in ops if k in ("cudaStreamSynchronize", "cudaDeviceSynchronize")),
            "device_idle_s": max(wall - kernel_s, 0.0)}


def _harts_site(frames: list[dict]) -> str:
    """The innermost frames of an allocation's Python stack inside harts (two levels)."""
    own = [f for f in frames if "/harts/" in f.get("filename", "")]
    if not own:
        return "other: " + (frames[0].get("name", "?") if frames else "?")
    return " < ".join(f"{f['filename'].split('/harts/')[-1]}:{f['line']} {f['name']}" for f in own[:2])


def memtrace_case(kind: str, trajs, budget: int, args, top: int = 25) -> dict:
    """One prepared step under CUDA memory history: allocated memory at every microbatch's
    forward start and at every producer backward, the peak between consecutive marks, and
    at the step's peak the live allocations made during the step grouped by their innermost
    harts call site."""
    if DEVICE != "cuda":
        raise RuntimeError("--memtrace needs CUDA (torch.cuda.memory history)")
    trainer, _ = _trainer(kind, trajs, budget, args.model)
    trainer.step(trajs, budget)
    prepared = trainer.prepare(trajs, budget)
    _sync()
    marks = []

    def mark(what: str) -> None:
        _sync()
        marks.append({"at": what, "allocated": _mem("memory_allocated"), "peak_since_last": _mem("max_memory_allocated")})
        torch.cuda.reset_peak_memory_stats()

    mbs = prepared.microbatches
    roles = [it[3].info.get("role", "") for it in mbs.items] if hasattr(mbs, "items") else ["mb"] * len(mbs)
    count = [0]

    def forward_mark(mod, inp):
        mark(f"forward {count[0]} {roles[count[0] % len(roles)]}")
        count[0] += 1

    hook = trainer.model.register_forward_pre_hook(forward_mark)
    # the plan layout's since the step runner took layouts; the trainer's before
    owner = getattr(trainer, "layout", trainer)
    pb = getattr(owner, "_producer_backward", None)
    if pb is not None:
        def producer_backward(window, pb=pb):
            mark(f"producer {window.producer} backward")
            pb(window)
        owner._producer_backward = producer_backward
    base = _mem("memory_allocated")
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    trainer.step(trajs, budget, prepared=prepared)
    mark("end")
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    hook.remove()
    events = [e for trace in snap["device_traces"] for e in trace]
    cur, peak, peak_i = 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            cur += e["size"]
        elif e["action"] == "free_completed":
            cur -= e["size"]
        if cur > peak:
            peak, peak_i = cur, i
    live: dict[int, tuple[int, str]] = {}
    for e in events[: peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _harts_site(e.get("frames", [])))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_site: dict[str, list[int]] = {}
    for size, site in live.values():
        acc = by_site.setdefault(site, [0, 0])
        acc[0] += size
        acc[1] += 1
    sites = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    del trainer, prepared, snap, events, live
    _free()
    return {"kind": kind, "budget": budget, "base_bytes": base, "step_peak_above_base": peak, "marks": marks,
            "at_peak": [{"site": s, "bytes": b, "tensors": n} for s, (b, n) in sites]}


def fidelity_case(trajs, budget: int, args) -> dict:
    """bf16 gradients and losses of the window plan, the unsplit tree and a repacked expanded
    run, each against the expanded step at `budget`, from the same weights (no optimizer
    step): relative L2 error and cosine of the whole gradient, loss difference
    (`<run>_vs_expanded`). Each bf16 run, the expanded one included, also against the
    expanded step in float32 from the same (bf16-valued) weights (`<run>_vs_float32`): the
    difference of two bf16 runs carries both runs' rounding, so a ratio of two such
    differences measures the baseline's rounding as much as the plan's (on the CPU, where
    benchmarks/window_fidelity.py compares with float64, the bf16-to-bf16 ratio spanned
    0.89-2.49 while the ratio to float64 stayed within 0.96-1.07)."""
    from harts.config.models import get_model_config
    from harts.exec.factory import make_trainer
    from harts.exec.model.model import build_model
    from harts.plan.planners import PlanConfig, make_plan
    from harts.tree import build_forest

    _free()  # what an earlier case left (`_trainer`)
    # the MoE aux loss summed over the step: with a per-microbatch aux loss, plans that pack
    # the step differently compute different losses, not the same one rounded differently
    cfg = get_model_config(args.model).replace(aux_scope="global")
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    net = build_model(cfg, seed=0, dtype=dtype, device=DEVICE, recompute=True)
    plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size))

    def rel(grads, ref) -> dict:
        num = sum(float((g.float() - r.float()).pow(2).sum()) for g, r in zip(grads, ref, strict=True))
        den = sum(float(r.float().pow(2).sum()) for r in ref)
        dot = sum(float((g.float() * r.float()).sum()) for g, r in zip(grads, ref, strict=True))
        nrm = sum(float(g.float().pow(2).sum()) for g in grads)
        return {"grad_rel_l2": (num / den) ** 0.5, "grad_cosine": dot / (nrm * den) ** 0.5}

    # the float32 reference: the same weights, widened (exact), the expanded step at the budget
    wide = build_model(cfg, seed=0, dtype=torch.float32, device=DEVICE, recompute=True)
    with torch.no_grad():
        for pw, pn in zip(wide.parameters(), net.parameters(), strict=True):
            pw.copy_(pn.float())
    ref32_loss = make_trainer("expanded", wide).forward_backward(trajs, budget).losses["loss"]
    ref32 = [p.grad.detach().clone() for p in wide.parameters() if p.grad is not None]
    del wide
    _free()
    runs = {"expanded": (make_trainer("expanded", net), budget),
            "expanded_repacked": (make_trainer("expanded", net), args.unsplit_budget),
            "tree": (make_trainer("tree", net), args.unsplit_budget),
            "windows": (make_trainer("plan", net, plan), budget)}
    ref, ref_loss = None, None
    out = {"budget": budget, "unsplit_budget": args.unsplit_budget, "float32_loss": ref32_loss}
    for name, (trainer, b) in runs.items():
        net.zero_grad(set_to_none=True)
        loss = trainer.forward_backward(trajs, b).losses["loss"]
        grads = [p.grad.detach().clone() for p in net.parameters() if p.grad is not None]
        del trainer
        out[f"{name}_vs_float32"] = {**rel(grads, ref32), "loss_diff": abs(loss - ref32_loss)}
        if ref is None:
            ref, ref_loss = grads, loss
            out["expanded_loss"] = loss
            continue
        out[f"{name}_vs_expanded"] = {**rel(grads, ref), "loss_diff": abs(loss - ref_loss)}
        del grads
        _free()
    del net, ref, ref32
    _free()
    return out


def print_memtrace(label: str, m: dict, top: int | None = None) -> None:
    """A `memtrace_case` result: the step's peak, the per-microbatch marks and the live
    allocations at the peak by call site (the `top` largest, default all)."""
    print(f"[memtrace {label}] base {m['base_bytes']/2**30:.2f} GiB, step peak +{m['step_peak_above_base']/2**30:.2f} GiB",
          flush=True)
    for k in m["marks"]:
        print(f"   {k['at']:<28} allocated {k['allocated']/2**30:6.2f} GiB  peak since last "
              f"{k['peak_since_last']/2**30:6.2f} GiB", flush=True)
    for r in m["at_peak"][:top]:
        print(f"   {r['bytes']/2**30:7.2f} GiB {r['tensors']:6d}  {r['site'][:140]}", flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--budgets", type=int, nargs="+", default=[65536, 57344])
    ap.add_argument("--unsplit-budget", type=int, default=131072)
    ap.add_argument("--no-bushy", action="store_true", help="skip the bushier tree")
    ap.add_argument("--bushy-budget", type=int, default=65536)
    ap.add_argument("--no-expanded", action="store_true", help="skip the expanded baselines")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--memtrace", action="store_true",
                    help="CUDA memory history of one window step per workload: per-microbatch marks, live tensors at the peak by call site")
    ap.add_argument("--fidelity", action="store_true",
                    help="bf16 gradients of windows, tree and a repacked expanded run against expanded")
    ap.add_argument("--resident", action="store_true",
                    help="also each workload's first window plan with its producers' saved tensors kept on the device")
    ap.add_argument("--no-autotune", action="store_true", help="each Triton kernel's first config that fits")
    ap.add_argument("--time-limit", type=float, default=480.0, help="start no new case past this many seconds")
    ap.add_argument("--out", default=".")
    ap.add_argument("--workload", default="swe-treestep-1", help="preset (a small one for a CPU smoke run)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs float32 (a smoke run of the script)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if args.no_autotune:
        from common import no_autotune

        no_autotune()
    from harts.tree.workload import generate, preset

    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"provenance": provenance([sys.argv[0], *argv]), "model": args.model, "dtype": "bfloat16",
              "steps": args.steps, "warmup": args.warmup, "cases": {}, "profile": {}, "skipped": []}

    def save():
        (out_dir / "windows.json").write_text(json.dumps(result, indent=1, default=str))

    base_wl = args.workload
    workloads = {base_wl: ({}, args.budgets, args.unsplit_budget)}
    if not args.no_bushy:
        workloads[f"{base_wl}-bushy"] = (BUSHY, [args.bushy_budget], 2 * args.unsplit_budget)
    # most informative first: the unsplit step and the windows, then the baselines
    plan = []
    for wl, (_over, budgets, unsplit) in workloads.items():
        plan.append((wl, "tree", unsplit))
        plan += [(wl, "windows", b) for b in budgets]
    if args.resident:
        plan += [(wl, "windows-resident", budgets[0]) for wl, (_over, budgets, _unsplit) in workloads.items()]
    if args.profile:
        plan.append((base_wl, "profile", args.budgets[0]))
    if args.memtrace:
        plan += [(wl, "memtrace", budgets[0]) for wl, (_over, budgets, _unsplit) in workloads.items()]
    if not args.no_expanded:
        for wl, (_over, budgets, _unsplit) in workloads.items():
            plan += [(wl, "expanded", b) for b in budgets]
        plan.append((base_wl, "expanded", args.unsplit_budget))
    if args.fidelity:  # last: the comparisons above need the expanded steps
        plan.append((base_wl, "fidelity", args.budgets[0]))
    trajs_of = {}
    for wl, kind, budget in plan:
        if time.perf_counter() - t_start > args.time_limit:
            result["skipped"].append(f"{wl} {kind}@{budget}")
            continue
        if wl not in trajs_of:
            over = workloads[wl][0]
            from harts.config.models import get_model_config

            vocab = min(VOCAB, get_model_config(args.model).vocab_size)
            trajs_of[wl] = generate(preset(base_wl, vocab_size=vocab, **over)).trajectories()
            from harts.tree import build_forest

            f = build_forest(trajs_of[wl])
            result.setdefault("workloads", {})[wl] = {
                "preset": base_wl, "overrides": over, "compact_rows": f.compact_tokens,
                "expanded_tokens": f.expanded_tokens, "longest": int(f.traj_length.max())}
        trajs = trajs_of[wl]
        name = f"{wl} {kind}@{budget}"
        t0 = time.perf_counter()
        try:
            if kind == "fidelity":
                result["fidelity"] = fidelity_case(trajs, budget, args)
                for k, v in result["fidelity"].items():
                    print(f"[fidelity] {k}: {v}", flush=True)
            elif kind == "memtrace":
                m = memtrace_case("windows", trajs, budget, args)
                result.setdefault("memtrace", {})[wl] = m
                print_memtrace(wl, m)
            elif kind == "profile":
                result["profile"]["windows"] = profile_case("windows", trajs, budget, args)
                result["profile"]["tree"] = profile_case("tree", trajs, args.unsplit_budget, args)
                for k, p in result["profile"].items():
                    print(f"[profile] {k}: wall {p['wall_s']:.2f}s kernels {p['kernel_s']:.2f}s "
                          f"(device idle {p['device_idle_s']:.3f}s, host in syncs {p['sync_cpu_s']:.3f}s)", flush=True)
                    for r in p["top_ops"][:30]:
                        print(f"   {r['device_s']*1e3:9.1f} ms {r['calls']:6d}  {r['op'][:90]}", flush=True)
                # where the window step's extra device time goes: per op, windows minus tree
                w_ops = {r["op"]: r for r in result["profile"]["windows"]["all_ops"]}
                t_ops = {r["op"]: r for r in result["profile"]["tree"]["all_ops"]}
                diff = sorted(((w_ops.get(o, {}).get("device_s", 0.0) - t_ops.get(o, {}).get("device_s", 0.0), o,
                                w_ops.get(o, {}).get("calls", 0), t_ops.get(o, {}).get("calls", 0))
                               for o in set(w_ops) | set(t_ops)), key=lambda r: -abs(r[0]))
                result["profile"]["windows_minus_tree"] = [
                    {"op": o, "device_s": d, "calls_windows": cw, "calls_tree": ct} for d, o, cw, ct in diff[:40]]
                print("[profile] windows - tree, device time by op:", flush=True)
                for d, o, cw, ct in diff[:30]:
                    print(f"   {d*1e3:+9.1f} ms calls {cw:6d} vs {ct:6d}  {o[:90]}", flush=True)
            else:
                r = run_case(kind, trajs, budget, args)
                r["workload"] = wl
                result["cases"][name] = r
                print(f"[{name}] {r['seconds']:.3f}s (inline {r['inline_seconds']:.3f}s) peak "
                      f"{r['peak_bytes']/2**30:.1f} GiB mbs {r['microbatches']} rows {r['rows']}", flush=True)
                for w in r.get("windows", []):
                    print(f"    window p{w['producer']} c{w['consumers']}: retained {w['retained_bytes']/2**30:.2f} GiB, "
                          f"held {w['held_bytes']/2**30:.2f} GiB, offloaded {w['offloaded_bytes']/2**30:.2f} GiB, "
                          f"plan {w['plan_retained_tokens']:.0f} tokens", flush=True)
        except Exception as err:  # noqa: BLE001 - record and go on with the other cases
            result["cases"][name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
            print(f"[{name}] ERROR {type(err).__name__}: {err}", flush=True)
            _free()
        print(f"   ({time.perf_counter() - t0:.0f}s)", flush=True)
        save()
    # derived comparisons
    cases = result["cases"]
    summary = {}
    for wl, (_over, budgets, unsplit) in workloads.items():
        tree = cases.get(f"{wl} tree@{unsplit}", {})
        act_per_row = tree["activation_peak_bytes"] / tree["rows"] if "rows" in tree else None
        for b in budgets:
            win, exp = cases.get(f"{wl} windows@{b}", {}), cases.get(f"{wl} expanded@{b}", {})
            s = {}
            if "seconds" in win and "seconds" in tree:
                s["window_over_unsplit"] = win["seconds"] / tree["seconds"]
            if "seconds" in win and "seconds" in exp:
                s["speedup_windows"] = exp["seconds"] / win["seconds"]
                s["speedup_unsplit_same_budget"] = exp["seconds"] / tree["seconds"] if "seconds" in tree else None
                if s.get("speedup_unsplit_same_budget"):
                    s["speedup_fraction_of_unsplit"] = s["speedup_windows"] / s["speedup_unsplit_same_budget"]
                if exp["peak_bytes"]:
                    s["peak_windows_over_expanded"] = win["peak_bytes"] / exp["peak_bytes"]
            if act_per_row and "windows" in win:
                s["retained"] = [{"retained_bytes": w["retained_bytes"],
                                  "plan_estimate_bytes": w["plan_retained_tokens"] * act_per_row,
                                  "measured_retention": w["retained_bytes"] / (w["producer_rows"] * act_per_row),
                                  "held_bytes": w.get("held_bytes"),
                                  "measured_held_retention": (w.get("held_bytes") or 0) / (w["producer_rows"] * act_per_row)}
                                 for w in win["windows"]]
                s["activation_bytes_per_row_unsplit"] = act_per_row
            res = cases.get(f"{wl} windows-resident@{b}", {})
            if "seconds" in res and "seconds" in win:
                # the producers' saved tensors kept on the device: what the host offload costs and saves
                s["offload_seconds_over_resident"] = win["seconds"] / res["seconds"]
                s["peak_resident_bytes"] = res["peak_bytes"]
                if exp.get("peak_bytes"):
                    s["peak_resident_over_expanded"] = res["peak_bytes"] / exp["peak_bytes"]
            summary[f"{wl}@{b}"] = s
            print(f"[summary] {wl}@{b}: {json.dumps(s, default=str)}", flush=True)
    result["summary"] = summary
    result["seconds_total"] = time.perf_counter() - t_start
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
