"""Where a window step's time goes, against the same rows unsplit: device idle attributed
to the code that launched the kernel ending each idle gap, host synchronisations by call
site, and launches by call site.

    python3 benchmarks/gpu/window_anatomy.py [--cases grpo/0@16384,swe-tree/0@16384]
        [--kinds windows,tree,expanded] [--no-autotune] --out DIR

Per case (`family/seed@budget`, drawn by `harts.tree.shapes.draw`) and kind (`windows`: the
l1l2 plan at the budget; `tree`: the same rows unsplit, budget 131072; `expanded`: the
expanded baseline at the budget), on a fresh `tiny-h200` in bf16 (benchmarks/gpu/windows.py's
trainers), after one warm-up step, one prepared step each:

- `syncs`: the host-device synchronisations of the step (`torch.cuda.set_sync_debug_mode`),
  counted by their innermost two `harts` frames;
- `plain`: torch.profiler over the step without stacks: wall, kernel time, device idle;
- `trace`: torch.profiler over the step, with Python stacks (which slow the host: its idle
  is larger than `plain`'s, the attribution is what it is for). The device's kernels in time
  order; a gap before a kernel (the device idle, no kernel of the step running) is charged
  to the innermost `harts` frame of the host code that launched that kernel, and so are
  launches. The sum of gaps is the device idle time of the step. `launch_ops`: the same
  kernels by kind (`launch_kind`: memsets and fills, copies and casts apart), by the
  innermost profiled op around their launch and by the autograd node whose backward ran it.

With `--host`, only the host instead: cProfile over one prepared step (own and cumulative
time by function, the top `--host-top` of each in the JSON, the whole profile in
DIR/<case>_<kind>.pstats for `python -m pstats`) and the step's wall without a profiler.

Writes DIR/window_anatomy.json with provenance; prints the largest idle and launch sites.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import windows as W  # noqa: E402  (benchmarks/gpu/windows.py: trainers, provenance)


def _site(frames: list[str], depth: int = 2) -> str:
    own = [f for f in frames if "harts/" in f and "benchmarks/" not in f]
    if not own:
        return "other: " + (frames[0] if frames else "?")
    return " < ".join(own[:depth])


def sync_sites(trainer, trajs, budget: int) -> dict:
    """The synchronisations one prepared step makes, by call site."""
    import traceback as tb

    prepared = trainer.prepare(trajs, budget)
    W._sync()
    sites: Counter = Counter()
    orig = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            frames = [f"{fr.filename.split('/harts/')[-1] if '/harts/' in fr.filename else fr.filename}:"
                      f"{fr.lineno} {fr.name}" for fr in reversed(tb.extract_stack()[:-1])]
            frames = [("harts/" + f) if not f.startswith("/") else f for f in frames]
            sites[_site(frames)] += 1
        else:
            orig(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step(trajs, budget, prepared=prepared)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = orig
    W._sync()
    return {"total": sum(sites.values()), "sites": sites.most_common(40)}


def trace_sites(trainer, trajs, budget: int, with_stack: bool = True) -> dict:
    """Device idle gaps and launches of one prepared step, by the launching harts frame."""
    from torch.profiler import ProfilerActivity, profile

    prepared = trainer.prepare(trajs, budget)
    W._sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
        t0 = time.perf_counter()
        trainer.step(trajs, budget, prepared=prepared)
        W._sync()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())
    events = events.get("traceEvents", events)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    index = _by_thread(events, "python_function")

    def frames_at(tid, ts) -> list[str]:
        return [e["name"] for e in _enclosing(index, tid, ts)]

    def norm(name: str) -> str:
        # "…/harts/exec/tree.py(345): _kda_rounds" -> "harts/exec/tree.py:345 _kda_rounds"
        if "(" in name and "): " in name:
            path, rest = name.split("(", 1)
            line, fn = rest.split("): ", 1)
            if "/harts/" in path:
                path = "harts/" + path.split("/harts/")[-1]
            return f"{path}:{line} {fn}"
        return name

    kernels.sort(key=lambda e: e["ts"])
    idle_by: Counter = Counter()
    launch_by: Counter = Counter()
    kernel_by: Counter = Counter()
    name_n: Counter = Counter()
    name_s: Counter = Counter()
    idle_total = 0.0
    busy_until = None
    site_cache: dict = {}
    for k in kernels:
        corr = k.get("args", {}).get("correlation")
        lz = launches.get(corr)
        key = (lz["tid"], lz["ts"]) if lz is not None else None
        if key not in site_cache:
            site_cache[key] = _site([norm(f) for f in frames_at(*key)]) if key is not None else "unattributed"
        site = site_cache[key]
        launch_by[site] += 1
        kernel_by[site] += k["dur"] / 1e6
        name_n[k["name"][:160]] += 1
        name_s[k["name"][:160]] += k["dur"] / 1e6
        if busy_until is not None and k["ts"] > busy_until:
            gap = (k["ts"] - busy_until) / 1e6
            idle_by[site] += gap
            idle_total += gap
        end = k["ts"] + k["dur"]
        busy_until = end if busy_until is None else max(busy_until, end)
    span = (busy_until - kernels[0]["ts"]) / 1e6 if kernels else 0.0
    syncs = Counter()
    for e in launches.values():
        if "Synchronize" in e["name"] or ("Memcpy" in e["name"] and "Async" not in e["name"]):
            syncs[e["name"]] += 1
    del prepared
    return {"wall_s": wall, "kernel_span_s": span, "kernel_s": sum(kernel_by.values()), "idle_s": idle_total,
            "kernels": len(kernels), "runtime_syncs": dict(syncs),
            "idle_sites": [(s, v) for s, v in idle_by.most_common(25)],
            "launch_sites": [(s, n, kernel_by[s]) for s, n in launch_by.most_common(40)],
            # every launching site and every kernel name: launches and device seconds
            "kernel_sites": [(s, launch_by[s], v) for s, v in kernel_by.most_common()],
            "kernel_names": [(s, name_n[s], v) for s, v in name_s.most_common()],
            "launch_ops": op_sources(events)}


def _by_thread(events: list[dict], cat: str) -> dict:
    """Per host thread, the complete events of category `cat` sorted by start (for
    `_enclosing`)."""
    per = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == cat:
            per[e["tid"]].append(e)
    index = {}
    for tid, evs in per.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        index[tid] = ([e["ts"] for e in evs], evs)
    return index


def _enclosing(index: dict, tid, ts) -> list[dict]:
    """The events of `index` on thread `tid` running at time `ts`, innermost first."""
    if tid not in index:
        return []
    starts, evs = index[tid]
    hi = bisect.bisect_right(starts, ts)
    enclosing = [e for e in evs[max(0, hi - 4000):hi] if e["ts"] + e["dur"] >= ts]
    enclosing.sort(key=lambda e: -e["ts"])
    return enclosing


AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


def launch_kind(name: str) -> str:
    """What a device activity does, finer than `kernel_kind` where launches are cheap to
    remove: memsets and fills (zero-initialised buffers), dtype conversions and device
    copies, then `kernel_kind`."""
    n = name.lower()
    if n.startswith("memset") or "fillfunctor" in n:
        return "memset or fill"
    if "copy_kernel" in n or "memcpy dtod" in n:
        return "copy or cast"
    return kernel_kind(name)


def op_sources(events: list[dict], top: int | None = None) -> list[tuple[str, str, str, int, float]]:
    """Device activities of a chrome trace by what launched them: (kind (`launch_kind`),
    the innermost profiled op around the launch on the host, the autograd node whose
    backward that op ran in ("forward" outside any), launches, device seconds), most
    launched first (the `top` most, or all). A kernel whose launch the trace does not hold
    is "unattributed"."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = _by_thread(events, "cpu_op")
    n_by: Counter = Counter()
    s_by: Counter = Counter()
    cache: dict = {}
    for k in kernels:
        lz = launches.get(k.get("args", {}).get("correlation"))
        where = (lz["tid"], lz["ts"]) if lz is not None else None
        if where not in cache:
            around = _enclosing(ops, *where) if where is not None else []
            inner = next((e["name"] for e in around if not e["name"].startswith(AUTOGRAD_NODE)), None)
            node = next((e["name"][len(AUTOGRAD_NODE):] for e in around if e["name"].startswith(AUTOGRAD_NODE)),
                        "forward")
            cache[where] = (inner or "unattributed", node if where is not None else "unattributed")
        key = (launch_kind(k["name"]), *cache[where])
        n_by[key] += 1
        s_by[key] += k["dur"] / 1e6
    return [(*key, n, s_by[key]) for key, n in n_by.most_common(top)]


def host_profile(trainer, trajs, budget: int, top: int = 45, dump: Path | None = None) -> dict:
    """cProfile over one prepared step: the host's time by function (own time and
    cumulative), and the step's wall time without any profiler (median of 2). `dump`: a
    file the whole profile is written to (`pstats`, callers and callees included)."""
    import cProfile
    import pstats

    walls, _ = W.prepared_steps(trainer, trajs, budget, 2)
    prepared = trainer.prepare(trajs, budget)
    W._sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    trainer.step(trajs, budget, prepared=prepared)
    W._sync()
    prof.disable()
    wall = time.perf_counter() - t0
    if dump is not None:
        prof.dump_stats(dump)
    st = pstats.Stats(prof)

    def name(fn):
        path, line, func = fn
        if "/harts/" in path:
            path = "harts/" + path.split("/harts/")[-1]
        elif "site-packages/" in path:
            path = path.split("site-packages/")[-1]
        return f"{path}:{line} {func}"

    rows = [(name(fn), cc, nc, tt, ct) for fn, (cc, nc, tt, ct, _) in st.stats.items()]
    return {"wall_s": sorted(walls)[len(walls) // 2], "all_wall_s": walls, "cprofile_wall_s": wall,
            "by_own": [(n, nc, tt, ct) for n, cc, nc, tt, ct in sorted(rows, key=lambda r: -r[3])[:top]],
            "by_cumulative": [(n, nc, tt, ct) for n, cc, nc, tt, ct in sorted(rows, key=lambda r: -r[4])[:top]]}


def main(argv: list[str]) -> int:
    from harts.config.models import get_model_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--cases", default="grpo/0@16384,swe-tree/0@16384")
    ap.add_argument("--kinds", default="windows,tree")
    ap.add_argument("--unsplit-budget", type=int, default=131072)
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--host", action="store_true", help="only the host profile (cProfile) and plain wall times")
    ap.add_argument("--host-top", type=int, default=45, help="functions listed per ordering in the JSON (--host)")
    ap.add_argument("--time-limit", type=float, default=540.0)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if args.no_autotune:
        from common import no_autotune

        no_autotune()
    vocab = min(W.VOCAB, get_model_config(args.model).vocab_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"provenance": W.provenance([sys.argv[0], *argv]), "model": args.model, "cases": {}, "skipped": []}
    t_start = time.perf_counter()
    for key, kind, trajs, b in W.case_runs(args, vocab, result["skipped"]):
        try:
            trainer, _ = W._trainer(kind, trajs, b, args.model)
            trainer.step(trajs, b)
            W._sync()
            if args.host:
                dump = out / (key.replace("/", "_").replace("@", "_").replace(" ", "_") + ".pstats")
                h = host_profile(trainer, trajs, b, top=args.host_top, dump=dump)
                result["cases"][key] = {"host": h}
                print(f"[{key}] wall {h['wall_s']:.3f}s (cProfile {h['cprofile_wall_s']:.3f}s)", flush=True)
                for n, nc, tt, ct in h["by_own"][:25]:
                    print(f"   own {tt * 1e3:7.1f} ms cum {ct * 1e3:7.1f} ms calls {nc:6d}  {n[:110]}", flush=True)
                trainer = None
                W._free()
                (out / "window_anatomy.json").write_text(json.dumps(result, indent=1, default=str))
                continue
            plain = trace_sites(trainer, trajs, b, with_stack=False)
            r = {"plain": {k: plain[k] for k in ("wall_s", "kernel_span_s", "kernel_s", "idle_s", "kernels",
                                                 "runtime_syncs")},
                 "syncs": sync_sites(trainer, trajs, b), "trace": trace_sites(trainer, trajs, b)}
            result["cases"][key] = r
            t = r["trace"]
            print(f"[{key}] wall {plain['wall_s']:.3f}s kernels {plain['kernel_s']:.3f}s idle {plain['idle_s']:.3f}s "
                  f"launches {plain['kernels']} syncs {r['syncs']['total']} {plain['runtime_syncs']}; with stacks: "
                  f"wall {t['wall_s']:.3f}s idle {t['idle_s']:.3f}s", flush=True)
            for s, v in t["idle_sites"][:8]:
                print(f"   idle {v * 1e3:7.1f} ms  {s[:150]}", flush=True)
            for s, n in r["syncs"]["sites"][:6]:
                print(f"   sync {n:5d}  {s[:150]}", flush=True)
            for kind_, op, node, n, v in t["launch_ops"][:12]:
                print(f"   launches {n:5d} {v * 1e3:7.2f} ms  {kind_}: {op[:60]} ({node[:50]})", flush=True)
        except Exception as err:  # noqa: BLE001 - record and go on
            result["cases"][key] = W.case_error(err)
            print(f"[{key}] ERROR {type(err).__name__}: {err}", flush=True)
        trainer = None
        W._free()
        (out / "window_anatomy.json").write_text(json.dumps(result, indent=1, default=str))
    result["windows_minus_tree"] = differences(result["cases"])
    result["seconds_total"] = time.perf_counter() - t_start
    (out / "window_anatomy.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


# kinds of kernel by name pattern, first match wins (the last: everything else)
KINDS = (("memory copies", ("memcpy",)), ("grouped GEMMs", ("groupproblemshape",)),
         ("dense GEMMs", ("nvjet", "gemm", "cutlass")),
         ("attention", ("fmha", "flash", "attn", "sdpa", "cudnn")),
         ("KDA", ("kda", "chunk_", "wy_", "dhu", "fwd_h", "solve_tril", "kkt", "gated_delta", "recompute_w_u")),
         ("row indexing", ("index", "gather", "scatter")), ("reductions", ("reduce",)),
         ("elementwise and cat", ("elementwise", "cat")), ("optimizer", ("adam", "multi_tensor", "foreach")),
         ("conv", ("conv",)), ("norms", ("norm",)))


def kernel_kind(name: str) -> str:
    n = name.lower()
    return next((kind for kind, keys in KINDS if any(k in n for k in keys)), "other")


def differences(cases: dict, top: int = 30) -> dict:
    """Per case with both a `windows` and a `tree` trace: device seconds and launches of the
    window step minus the unsplit step's, by launching site, by kernel name and by kind of
    kernel (`kernel_kind`), largest first."""
    out = {}
    for key, r in cases.items():
        case, kind = key.rsplit(" ", 1)
        other = cases.get(f"{case} tree", {})
        if kind != "windows" or "trace" not in r or "trace" not in other:
            continue
        w, t = r["trace"], other["trace"]
        entry = {"kernel_s": w["kernel_s"] - t["kernel_s"], "kernels": w["kernels"] - t["kernels"]}
        print(f"[{case}] windows minus tree: {entry['kernel_s'] * 1e3:+.1f} ms of kernels, {entry['kernels']:+d} launches")
        for field in ("kernel_sites", "kernel_names"):
            a = {s: (n, v) for s, n, v in w[field]}
            b = {s: (n, v) for s, n, v in t[field]}
            rows = sorted(((a.get(s, (0, 0.0))[1] - b.get(s, (0, 0.0))[1], a.get(s, (0, 0))[0] - b.get(s, (0, 0))[0], s)
                           for s in set(a) | set(b)), key=lambda x: -abs(x[0]))
            entry[field] = [{"what": s, "device_s": d, "launches": n} for d, n, s in rows[:top]]
            for d, n, s in rows[:15]:
                print(f"   {field[7:]:5s} {d * 1e3:+7.2f} ms {n:+6d}  {s[:130]}", flush=True)
        if "launch_ops" in w and "launch_ops" in t:
            ops: dict[tuple, list] = {}
            for sign, side in ((1, w), (-1, t)):
                for kind_, op, node, n, v in side["launch_ops"]:
                    o = ops.setdefault((kind_, op, node), [0.0, 0])
                    o[0] += sign * v
                    o[1] += sign * n
            entry["launch_ops"] = [{"what": f"{k[0]}: {k[1]} ({k[2]})", "device_s": v[0], "launches": v[1]}
                                   for k, v in sorted(ops.items(), key=lambda kv: -abs(kv[1][1]))[:top]]
        kinds: dict[str, list] = {}
        for sign, side in ((1, w), (-1, t)):
            for name, n, v in side["kernel_names"]:
                k = kinds.setdefault(kernel_kind(name), [0.0, 0])
                k[0] += sign * v
                k[1] += sign * n
        entry["kernel_kinds"] = [{"what": k, "device_s": v[0], "launches": v[1]}
                                 for k, v in sorted(kinds.items(), key=lambda kv: -abs(kv[1][0]))]
        for r in entry["kernel_kinds"]:
            print(f"   kind  {r['device_s'] * 1e3:+7.2f} ms {r['launches']:+6d}  {r['what']}", flush=True)
        out[case] = entry
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
