"""Sharing windows over shape families: each family's instances, drawn at each budget,
as a window plan against the same rows unsplit and against the expanded baseline at the
same budget.

    python3 benchmarks/gpu/window_suite.py [--families grpo,bushy,...] [--budgets 8192 16384 32768]
        [--seeds 0] [--fidelity] [--profile] [--memtrace] [--steps N] [--no-autotune] --out DIR

Instances come from `harts.tree.shapes` (`draw(family, seed, budget)`: every trajectory
fits the budget, one tree is larger than it, at most four budgets of compact rows), so a
family is the same shape at every budget and new seeds draw new instances; `--families`
also takes the long families (`shapes.LONG_FAMILIES`, `long-agent,long-group`: a path of
1.5-4 budgets, cut into a chain of windows; up to six budgets of rows). Per instance,
on a fresh `tiny-h200` model in bf16 with activation recomputation (the cases of
benchmarks/gpu/windows.py, whose `run_case`, `profile_case` and `fidelity_case` this
suite calls):

- `tree`: the whole instance unsplit (`TreeTrainer`, budget `--unsplit-budget`, 131072,
  or the instance's rows where it holds more);
- `windows@B`: the `l1l2` plan at the budget (`PlanTrainer`);
- `expanded@B`: the trajectory-expanded baseline at the budget;
- with `--window-floors`, `windows-floored@B`: the `l1l2` plan with the microbatch floors of
  this GPU's shipped profile (`harts.sim.executor.window_floors`): L1's windowless plan
  where it is the cheaper.

Per case the median of `--steps` prepared steps after `--warmup`, and peak allocated
memory. Derived per instance: window step / unsplit step, speedup of the windows over
expanded@B, that speedup as a share of the unsplit one (expanded@B / unsplit), peak of
the windows over expanded@B. `--fidelity`: bf16 gradient error (relative L2) of the
window plan and of the unsplit tree against the expanded step at B in float32 from the
same weights, and their ratio (`fidelity_windows_over_tree_float32`, the table's column);
also against the bf16 expanded step (`fidelity_windows_over_tree`, which carries the
baseline's own rounding). `--profile`: device time by op of one window step minus one unsplit
step, for each family's first instance at the middle budget. `--memtrace`: the window
and expanded steps under CUDA memory history (`windows.memtrace_case`). Writes DIR/window_suite.json
with provenance (git revision, command, versions, GPU); prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import windows as W  # noqa: E402  (benchmarks/gpu/windows.py: the cases and provenance)


def main(argv: list[str]) -> int:
    from harts.tree import build_forest, shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--families", default=",".join(shapes.FAMILIES))
    ap.add_argument("--budgets", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--unsplit-budget", type=int, default=131072)
    ap.add_argument("--window-floors", action="store_true",
                    help="also `windows-floored@B`: l1l2 with the microbatch floors of this GPU's profile "
                         "(harts.sim.executor.window_floors), windows only where they pay")
    ap.add_argument("--kinds", default="tree,windows,expanded",
                    help="the steps to time per instance, in this order (windows-floored is added by --window-floors)")
    ap.add_argument("--fidelity", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--memtrace", action="store_true",
                    help="CUDA memory history of one window step and one expanded step per instance "
                         "(windows.memtrace_case: marks per microbatch, live allocations at the peak by call site)")
    W.add_run_args(ap)
    args = ap.parse_args(argv)
    W.start_run(args)
    from harts.config.models import get_model_config

    vocab = min(W.VOCAB, get_model_config(args.model).vocab_size)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"provenance": W.provenance([sys.argv[0], *argv]), "model": args.model, "dtype": "bfloat16",
              "steps": args.steps, "warmup": args.warmup, "unsplit_budget": args.unsplit_budget,
              "instances": {}, "skipped": []}

    def save() -> None:
        (out_dir / "window_suite.json").write_text(json.dumps(result, indent=1, default=str))

    t_start = time.perf_counter()
    families = args.families.split(",")
    middle = sorted(args.budgets)[len(args.budgets) // 2]
    for family in families:
        for seed in args.seeds:
            for budget in args.budgets:
                key = f"{family}/{seed}@{budget}"
                if time.perf_counter() - t_start > args.time_limit:
                    result["skipped"].append(key)
                    continue
                trajs = shapes.draw(family, seed, budget, vocab_size=vocab)
                f = build_forest(trajs)
                inst = {"family": family, "seed": seed, "budget": budget, "trajectories": len(trajs),
                        "compact_rows": f.compact_tokens, "expanded_tokens": f.expanded_tokens,
                        "longest": int(f.traj_length.max()), "cases": {}}
                result["instances"][key] = inst
                # the unsplit step holds every row in one microbatch, a long family's too
                names = args.kinds.split(",")
                if args.window_floors and "windows-floored" not in names:
                    names.append("windows-floored")
                kinds = [(k, max(args.unsplit_budget, f.compact_tokens) if k == "tree" else budget) for k in names]
                for kind, b in kinds:
                    t0 = time.perf_counter()
                    try:
                        r = W.run_case(kind, trajs, b, args)
                        inst["cases"][kind] = r
                        print(f"[{key} {kind}@{b}] {r['seconds']:.4f}s peak {r['peak_bytes'] / 2**30:.2f} GiB "
                              f"mbs {r['microbatches']} rows {r['rows']} ({time.perf_counter() - t0:.0f}s)", flush=True)
                    except Exception as err:  # noqa: BLE001 - record and go on
                        inst["cases"][kind] = W.case_error(err)
                        print(f"[{key} {kind}@{b}] ERROR {type(err).__name__}: {err}", flush=True)
                    save()  # a run stopped by its time limit keeps every case it finished
                if args.fidelity:
                    try:
                        fid = W.fidelity_case(trajs, budget, args)
                        inst["fidelity"] = fid
                    except Exception as err:  # noqa: BLE001
                        inst["fidelity"] = W.case_error(err)
                        print(f"[{key}] fidelity ERROR {type(err).__name__}: {err}", flush=True)
                if args.memtrace:
                    for kind in ("windows", "expanded"):
                        try:
                            m = W.memtrace_case(kind, trajs, budget, args)
                            inst.setdefault("memtrace", {})[kind] = m
                            W.print_memtrace(f"{key} {kind}", m, top=8)
                        except Exception as err:  # noqa: BLE001
                            inst.setdefault("memtrace", {})[kind] = W.case_error(err)
                            print(f"[{key}] memtrace {kind} ERROR {type(err).__name__}: {err}", flush=True)
                if args.profile and seed == args.seeds[0] and budget == middle:
                    try:
                        pw = W.profile_case("windows", trajs, budget, args)
                        pt = W.profile_case("tree", trajs, args.unsplit_budget, args)
                        w_ops = {r["op"]: r for r in pw.pop("all_ops")}
                        t_ops = {r["op"]: r for r in pt.pop("all_ops")}
                        diff = sorted(((w_ops.get(o, {}).get("device_s", 0.0) - t_ops.get(o, {}).get("device_s", 0.0),
                                        o, w_ops.get(o, {}).get("calls", 0), t_ops.get(o, {}).get("calls", 0))
                                       for o in set(w_ops) | set(t_ops)), key=lambda r: -abs(r[0]))
                        inst["profile"] = {"windows": pw, "tree": pt, "windows_minus_tree": [
                            {"op": o, "device_s": d, "calls_windows": cw, "calls_tree": ct}
                            for d, o, cw, ct in diff[:40]]}
                        print(f"[{key} profile] wall windows {pw['wall_s']:.3f}s (kernels {pw['kernel_s']:.3f}s) "
                              f"tree {pt['wall_s']:.3f}s (kernels {pt['kernel_s']:.3f}s)", flush=True)
                        for d, o, cw, ct in diff[:12]:
                            print(f"   {d * 1e3:+8.1f} ms calls {cw:6d} vs {ct:6d}  {o[:80]}", flush=True)
                    except Exception as err:  # noqa: BLE001
                        inst["profile"] = W.case_error(err)
                inst["summary"] = summarize(inst)
                save()
    rows = [(k, v["summary"]) for k, v in result["instances"].items()]
    result["table"] = {k: s for k, s in rows}
    result["seconds_total"] = time.perf_counter() - t_start
    save()
    print(f"\n{'instance':24s} {'rows':>7s} {'x':>5s} {'win/unsplit':>11s} {'win/exp':>8s} {'share':>6s} "
          f"{'peak w/e':>8s} {'fid w/t':>7s} {'floored/unsplit':>15s}")
    for k, s in rows:
        def f(x, fmt):
            return format(x, fmt) if isinstance(x, (int, float)) else "-"
        print(f"{k:24s} {f(s.get('compact_rows'), '7d')} {f(s.get('compression'), '5.2f')} "
              f"{f(s.get('window_over_unsplit'), '11.3f')} {f(s.get('speedup_windows'), '8.2f')} "
              f"{f(s.get('share_of_unsplit_speedup'), '6.2f')} {f(s.get('peak_windows_over_expanded'), '8.3f')} "
              f"{f(s.get('fidelity_windows_over_tree_float32', s.get('fidelity_windows_over_tree')), '7.3f')} "
              f"{f(s.get('floored_over_unsplit'), '15.3f')}")
    return 0


def summarize(inst: dict) -> dict:
    c = inst["cases"]
    tree, win, exp = c.get("tree", {}), c.get("windows", {}), c.get("expanded", {})
    s = {"compact_rows": inst["compact_rows"], "compression": inst["expanded_tokens"] / inst["compact_rows"]}
    if "seconds" in win and "seconds" in tree:
        s["window_over_unsplit"] = win["seconds"] / tree["seconds"]
        s["window_microbatches"] = win["microbatches"]
        s["consumers"] = sum(1 for r in win["roles"] if r == "consumer")
    if "seconds" in win and "seconds" in exp:
        s["speedup_windows"] = exp["seconds"] / win["seconds"]
        if "seconds" in tree:
            s["speedup_unsplit"] = exp["seconds"] / tree["seconds"]
            s["share_of_unsplit_speedup"] = s["speedup_windows"] / s["speedup_unsplit"]
        if exp.get("peak_bytes"):
            s["peak_windows_over_expanded"] = win["peak_bytes"] / exp["peak_bytes"]
    fid = inst.get("fidelity", {})
    if "windows_vs_expanded" in fid and "tree_vs_expanded" in fid:
        s["fidelity_windows_over_tree"] = (fid["windows_vs_expanded"]["grad_rel_l2"]
                                           / fid["tree_vs_expanded"]["grad_rel_l2"])
    if "windows_vs_float32" in fid and "tree_vs_float32" in fid:
        # against the float32 step: each bf16 run's own rounding error (the ratio to read)
        s["fidelity_windows_over_tree_float32"] = (fid["windows_vs_float32"]["grad_rel_l2"]
                                                   / fid["tree_vs_float32"]["grad_rel_l2"])
    if "seconds" in tree:
        s["unsplit_rows_per_s"] = tree["rows"] / tree["seconds"]
    if "seconds" in win:
        s["window_rows_per_s"] = win["rows"] / win["seconds"]
    floored = c.get("windows-floored", {})
    if "seconds" in floored and "seconds" in tree:
        s["floored_over_unsplit"] = floored["seconds"] / tree["seconds"]
        s["floored_microbatches"] = floored["microbatches"]
        if exp.get("peak_bytes"):
            s["peak_floored_over_expanded"] = floored["peak_bytes"] / exp["peak_bytes"]
    return s


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
