"""Where an update step's time goes, on the GPU: kernel time by kernel, device time by op and
Python call site, and synchronising calls and GPU idle gaps by host op.

    python3 benchmarks/gpu/op_profile.py [profile] [opsites] [syncs] [--schemes treestep] [--out DIR]

Each section warms a fresh tiny-h200 trainer per mode (tree, then expanded) on the first
`--schemes` entry's workload (step.py's STEP_WORKLOADS), prepares the data side one step
ahead as the step benchmark does, and profiles one step.

`profile`: CUDA kernel time summed by kernel (every kernel: benchmarks/sim_vs_h200.py reads
it as the measured side), wall time, the GPU-busy share, the top ops by input shape.
`opsites`: each aten op's self device time by (op, innermost harts/ frame).
`syncs`: every synchronising CUDA call of one step with its Python stack (torch's sync debug
mode), and the GPU idle gaps attributed to the host op running during them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:  # run as a script: this folder would
    sys.path[0] = _ROOT  # the repository root, not this folder, first on the path
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.gpu.common import Section, add_kernel_args, run_suite  # noqa: E402
from benchmarks.gpu.step import STEP_WORKLOADS  # noqa: E402
from harts.bench.step import kind_seconds  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.exec.factory import make_trainer  # noqa: E402
from harts.exec.model.model import build_model  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402


def _warm_trainers(args, out: dict):
    """(mode, trainer, trajectories) for tree then expanded mode on the first --schemes
    entry's workload (default treestep), each trainer on a fresh tiny model after one
    warm-up step; records the workload in `out` and frees each model after its turn."""
    name, over = STEP_WORKLOADS[args.schemes[0]]
    out.update(workload=name, overrides=over, kernel_config=args.kernels.to_dict())
    trajs = generate(preset(name, vocab_size=get_model_config(args.model).vocab_size, **over)).trajectories()
    for mode in ("tree", "expanded"):
        net = build_model(get_model_config(args.model), seed=0, dtype=torch.bfloat16, device="cuda", recompute=True)
        trainer = make_trainer(mode, net, kernels=args.kernels)
        trainer.step(trajs, args.microbatch_tokens)
        torch.cuda.synchronize()
        yield mode, trainer, trajs
        del trainer, net
        torch.cuda.empty_cache()


def sec_profile(args):
    """Where a step's time goes: one tree and one expanded update under torch.profiler
    (after a warm-up step), CUDA kernel time summed by kernel name, plus wall time and the
    GPU-busy share (kernel time / wall: far below 1 means the host is the bottleneck)."""

    out = {"scheme": args.schemes[0]}
    for mode, trainer, trajs in _warm_trainers(args, out):
        prepared = trainer.prepare(trajs, args.microbatch_tokens)  # the data side ahead, as the step bench
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            t0 = time.perf_counter()
            trainer.step(trajs, args.microbatch_tokens, prepared=prepared)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        agg = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                a = agg.setdefault(e.name, [0.0, 0])
                a[0] += e.device_time / 1e6
                a[1] += 1
        busy = sum(v[0] for v in agg.values())
        # every kernel (sorted): with only the top 40 the tail (0.11 s tree / 0.32 s expanded in
        # benchmarks/results/profile/2026-11-29-05c3a9b-profile.json) lands in sim_vs_h200's
        # "other" category, GEMMs included
        top = sorted(agg.items(), key=lambda kv: -kv[1][0])
        # kernel time by the work it scales with: what the ideal speedup is weighted with
        by_kind = {k.value: t for k, t in kind_seconds({n: v[0] for n, v in agg.items()}).items()}
        out[mode] = {"wall_s": wall, "kernel_s": busy, "busy_share": busy / wall, "kind_seconds": by_kind,
                     "top": [{"kernel": k[:160], "seconds": v[0], "calls": v[1]} for k, v in top]}
        print(f"[profile] {mode}: wall {wall:.2f}s kernels {busy:.2f}s", flush=True)
        for k, v in top[:25]:
            print(f"   {v[0]*1e3:9.1f} ms {v[1]:6d}  {k[:110]}", flush=True)
        ops = [(e.key, e.input_shapes, e.self_device_time_total / 1e6, e.count)
               for e in prof.key_averages(group_by_input_shape=True)]
        ops = sorted(ops, key=lambda r: -r[2])[:40]
        out[mode]["top_ops"] = [{"op": a, "shapes": str(b)[:200], "seconds": c, "calls": d} for a, b, c, d in ops]
        for a, b, c, d in ops[:25]:
            print(f"   op {c*1e3:9.1f} ms {d:6d}  {a} {str(b)[:120]}", flush=True)
        del trainer  # so that the generator's cleanup frees the model before the next mode
    return out


def _site_of(e) -> str:
    """The innermost harts/ Python frame above a profiler event (the python tracer's frames
    are parent events named 'path(line): function'), else the autograd node running it."""
    p = e.cpu_parent
    while p is not None:
        if "harts/" in p.name and "(" in p.name:
            return p.name.split("harts/", 1)[-1]
        if p.name.startswith("autograd::engine::evaluate_function"):  # a built-in backward node
            return "autograd " + p.name.split(": ", 1)[-1]
        p = p.cpu_parent
    return "-"


def op_sites(events, attr: str) -> dict:
    """{(aten op, site): [seconds, calls]} of each op's self time `attr` (microseconds)."""
    agg: dict[tuple[str, str], list] = {}
    for e in events:
        t = getattr(e, attr, 0.0)
        if t <= 0 or not e.name.startswith("aten::"):
            continue
        a = agg.setdefault((e.name, _site_of(e)), [0.0, 0])
        a[0] += t / 1e6
        a[1] += 1
    return agg


def sec_opsites(args):
    """Which ops and which Python call sites spend a step's device time: one tree and one
    expanded update (data side prepared ahead, after a warm-up step) under torch.profiler
    with stacks; each op's *self* device time (the kernels it launches itself) summed by
    (op, innermost harts/ frame; "autograd" for backward nodes, which run without one).
    The copies, gathers and scatters the tree adds are what this is for."""

    out = {"scheme": args.schemes[0]}
    for mode, trainer, trajs in _warm_trainers(args, out):
        prepared = trainer.prepare(trajs, args.microbatch_tokens)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            trainer.step(trajs, args.microbatch_tokens, prepared=prepared)
            torch.cuda.synchronize()
        agg = op_sites(prof.events(), "self_device_time_total")
        top = sorted(agg.items(), key=lambda kv: -kv[1][0])[:80]
        out[mode] = [{"op": k[0], "site": k[1][:160], "seconds": v[0], "calls": v[1]} for k, v in top]
        print(f"[opsites] {mode}: {sum(v[0] for v in agg.values()):.3f} s of self device time", flush=True)
        for k, v in top[:40]:
            print(f"   {v[0]*1e3:8.1f} ms {v[1]:5d}  {k[0][:40]:40s} {k[1][:90]}", flush=True)
        del trainer
    return out


def _gap_attribution(trace_path: str, min_gap_us: float = 10.0, top: int = 25) -> dict:
    """GPU idle gaps of a chrome trace (kernel end -> next kernel start, >= min_gap_us),
    each attributed to the innermost aten op the host was running at the gap's middle
    ("-": host Python between ops) and to the kernel that ended the gap."""
    import bisect

    ev = json.load(open(trace_path))["traceEvents"]
    kern = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in ev
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    ops = sorted((e for e in ev if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    op_ts = [e["ts"] for e in ops]
    gaps, end = [], None
    for a, b, name in kern:
        if end is not None and a - end >= min_gap_us:
            gaps.append((end, a, name))
        end = b if end is None else max(end, b)
    by_op, by_next = {}, {}
    for a, b, name in gaps:
        mid = (a + b) / 2
        j = bisect.bisect_right(op_ts, mid)
        best = None
        for e in ops[max(0, j - 300):j]:
            if e["ts"] + e.get("dur", 0) >= mid and (best is None or e.get("dur", 0) < best.get("dur", 0)):
                best = e
        for d, k in ((by_op, best["name"][:120] if best else "-"), (by_next, name[:120])):
            x = d.setdefault(k, [0.0, 0])
            x[0] += (b - a) / 1e6
            x[1] += 1
    span = (kern[-1][1] - kern[0][0]) / 1e6 if kern else 0.0
    busy = sum(b - a for a, b, _ in kern) / 1e6

    def fmt(d):
        return [{"where": k, "seconds": v[0], "gaps": v[1]} for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]

    return {"span_s": span, "kernel_s": busy, "gap_s": sum(b - a for a, b, _ in gaps) / 1e6, "gaps": len(gaps),
            "by_op": fmt(by_op), "by_next_kernel": fmt(by_next)}


def sec_syncs(args):
    """Why the GPU idles in a step (tree and expanded, the first --schemes entry): every synchronising
    CUDA call of one step with the Python stack that made it (torch's sync debug mode), and
    the step's GPU idle gaps attributed to the host op running during them and the kernel
    ending them (under the profiler host times are inflated: read the shares)."""
    import traceback as tb
    import warnings


    out = {"scheme": args.schemes[0]}
    for mode, trainer, trajs in _warm_trainers(args, out):
        sites = {}
        orig = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None, sites=sites):
            frames = [f for f in tb.extract_stack()[:-1] if ("harts/" in f.filename or "/fla/" in f.filename)]
            where = " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/work/')[-1]}:{f.lineno}"
                                for f in frames[-3:][::-1]) or f"{filename}:{lineno}"
            x = sites.setdefault(where, [0, str(message)[:80]])
            x[0] += 1

        warnings.showwarning = record
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    prepared = trainer.prepare(trajs, args.microbatch_tokens)
                    n_prep = sum(v[0] for v in sites.values())
                    trainer.step(trajs, args.microbatch_tokens, prepared=prepared)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
        finally:
            warnings.showwarning = orig
        torch.cuda.synchronize()
        total = sum(v[0] for v in sites.values())
        res = {"syncs_in_step": total - n_prep, "syncs_in_prepare": n_prep,
               "sites": [{"where": k, "count": v[0], "message": v[1]} for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])[:40]]}
        print(f"[syncs] {mode}: {total - n_prep} syncs in the step, {n_prep} in prepare", flush=True)
        for r in res["sites"][:20]:
            print(f"   {r['count']:5d}  {r['where']}", flush=True)
        for label, use_prepared in (("prefetched", True), ("inline", False)):
            prepared = trainer.prepare(trajs, args.microbatch_tokens) if use_prepared else None
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                trainer.step(trajs, args.microbatch_tokens, prepared=prepared)
                torch.cuda.synchronize()
            path = f"/tmp/trace_{mode}_{label}.json"
            prof.export_chrome_trace(path)
            res[f"gaps_{label}"] = g = _gap_attribution(path)
            print(f"[gaps] {mode} {label}: span {g['span_s']:.3f}s kernels {g['kernel_s']:.3f}s gaps {g['gap_s']:.3f}s "
                  f"in {g['gaps']}", flush=True)
            for r in g["by_op"][:12]:
                print(f"   op {r['seconds']*1e3:8.1f} ms {r['gaps']:5d}  {r['where']}", flush=True)
            for r in g["by_next_kernel"][:10]:
                print(f"   next {r['seconds']*1e3:8.1f} ms {r['gaps']:5d}  {r['where']}", flush=True)
        out[mode] = res
        del trainer  # so that the generator's cleanup frees the model before the next mode
    return out


def sum_profile(out):
    return [(m, f"wall {out[m]['wall_s']:.3f} s, kernels {out[m]['kernel_s']:.3f} s, busy {out[m]['busy_share']:.2f}")
            for m in ("tree", "expanded") if m in out]


def sum_opsites(out):
    return [(m, f"{sum(r['seconds'] for r in out[m]):.3f} s self device time in the top {len(out[m])} (op, site)")
            for m in ("tree", "expanded") if m in out]


def sum_syncs(out):
    return [(m, f"{out[m]['syncs_in_step']} syncs in the step, {out[m]['syncs_in_prepare']} in prepare; "
                f"gaps {out[m]['gaps_prefetched']['gap_s']:.3f} s") for m in ("tree", "expanded") if m in out]


SECTIONS = [
    Section("profile", sec_profile, "kernel time by kernel, wall, GPU-busy share", sum_profile),
    Section("opsites", sec_opsites, "device time by aten op and harts/ call site", sum_opsites),
    Section("syncs", sec_syncs, "synchronising calls and idle gaps by host op", sum_syncs,
            default=False),
]


def add_args(ap) -> None:
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--schemes", nargs="+", default=["treestep"], choices=sorted(STEP_WORKLOADS),
                    help="the first one is profiled")
    ap.add_argument("--microbatch-tokens", type=int, default=131072)
    add_kernel_args(ap, "tree_attention", "baseline_attention", "conv")


if __name__ == "__main__":
    sys.exit(run_suite("op_profile", SECTIONS, __doc__, add_args))
