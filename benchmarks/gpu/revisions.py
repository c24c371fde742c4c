"""The single-process step times of two source trees of HARTS on the same rollouts, in one
run (does a change of the code move them?): the unsplit tree, the expanded baseline (packed,
and prefix-merged with `prefix`) and a window plan.

    python3 benchmarks/gpu/revisions.py --roots OLD_TREE NEW_TREE [--workload swe-treestep-1]
        [--shapes grpo/0@16384,...] [--model tiny-h200] [--budget 131072]
        [--baselines treestep,stepwise,grpo,bushy] [--window-budget 57344]
        [--modes tree,expanded,prefix,windows] [--steps 5] [--no-autotune] --out DIR

A root is a directory holding a `harts/` package (`git archive REV harts | tar -x -C DIR`).
The rollouts are generated once, by the current tree's generator (the `--workload` preset,
each `--baselines` workload of benchmarks/gpu/baselines.py, and each `--shapes` instance
`family/seed@budget` of `harts.tree.shapes`), and written as
rollout JSONL; each root runs in one process of its own for the whole run (PYTHONPATH=root;
imports, kernel compilation and caches paid once), asked for each set in turn with the roots
alternating set by set, through the API both trees share: `build_model(..., dtype=bf16, recompute=True)`, `TreeTrainer`,
`ExpandedTrainer`, (`prefix`) `PrefixMergedTrainer` and (`windows`) `PlanTrainer` over the `l1l2` plan at the window budget
(the preset's `--window-budget`, a shape instance's own budget), `prepare` + `step`, `--warmup` steps and then the median of `--steps`,
each timed with a device synchronisation. Each root's run is also repeated with its order
reversed (expanded first) when `--both-orders` is given. Writes DIR/revisions.json with
provenance, and the table so far, after every run; each root's stderr goes to
DIR/worker-<i>.log.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> int:
    """`--worker`: one set (`--input`), or with `--serve` one set per JSON line of stdin
    ({"input", "window_budget", "exp_at_window", "modes"}), each answered by a RESULT line
    (or ERROR with the traceback) on stdout, so a root's imports, kernel compilation and
    caches are paid once for every set."""
    if not args.serve:
        print("RESULT " + json.dumps(run_set(args)), flush=True)
        return 0
    import traceback

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        args.input, args.window_budget, args.modes = req["input"], req["window_budget"], req["modes"]
        args.expanded_at_window_budget = req["exp_at_window"]
        try:
            print("RESULT " + json.dumps(run_set(args)), flush=True)
        except Exception:  # noqa: BLE001 - reported to the parent, the next set runs
            print("ERROR " + json.dumps(traceback.format_exc()[-3000:]), flush=True)
    return 0


_PATCHED: list[bool] = []


def run_set(args: argparse.Namespace) -> dict:
    import torch

    import harts
    from harts.config.models import get_model_config
    from harts.exec.model.model import build_model
    from harts.exec.trainer import ExpandedTrainer
    from harts.exec.tree_trainer import TreeTrainer
    from harts.tree.io import load_jsonl

    if args.no_autotune and not _PATCHED:
        from common import no_autotune

        no_autotune()
        _PATCHED.append(True)
    trajs = load_jsonl(args.input)
    cfg = get_model_config(args.model)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync():
        if cuda:
            torch.cuda.synchronize()

    out = {"harts_file": harts.__file__, "modes": {}}
    for mode in args.modes.split(","):
        net = build_model(cfg, seed=0, dtype=dtype, device=args.device, recompute=True)
        budget = args.budget
        if mode == "windows":
            from harts.exec.window import PlanTrainer
            from harts.plan.planners import PlanConfig, make_plan
            from harts.tree import build_forest

            budget = args.window_budget
            plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=budget,
                                                                     chunk_size=cfg.chunk_size))
            trainer = PlanTrainer(net, plan)
        elif mode == "prefix":
            from harts.exec.prefix_trainer import PrefixMergedTrainer

            trainer = PrefixMergedTrainer(net)
        else:
            trainer = TreeTrainer(net) if mode == "tree" else ExpandedTrainer(net)
            if mode == "expanded":
                budget = args.window_budget if args.expanded_at_window_budget else args.budget
        for _ in range(args.warmup):
            trainer.step(trajs, budget)
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            prepared = trainer.prepare(trajs, budget)
            sync()
            t0 = time.perf_counter()
            res = trainer.step(trajs, budget, prepared=prepared)
            sync()
            times.append(time.perf_counter() - t0)
        out["modes"][mode] = {"seconds": statistics.median(times), "all_seconds": times,
                              "peak_bytes": int(torch.cuda.max_memory_allocated()) if cuda else 0, "loss": res.losses["loss"],
                              "microbatches": len(res.microbatches), "budget": budget}
        del trainer, net, prepared, res
        gc.collect()  # what an earlier mode left in a cycle is not this mode's peak
        if cuda:
            torch.cuda.empty_cache()
    return out


def _table(result: dict, sets: list, modes: list[str], roots: list[str]) -> dict:
    """Per set and mode: each root's median over its runs, and its ratio to the first root's;
    the fastest step beside the median (one slow step, a garbage collection or a clock
    change, moves a median of two)."""
    table = {}
    for name, *_ in sets:
        for mode in modes:
            medians, fastest = [], []
            for root in roots:
                runs = [r for r in result["runs"] if r["set"] == name and r["root"] == str(root)
                        and mode in r.get("modes", {})]
                vals = [r["modes"][mode]["seconds"] for r in runs]
                steps = [x for r in runs for x in r["modes"][mode]["all_seconds"]]
                medians.append(statistics.median(vals) if vals else None)
                fastest.append(min(steps) if steps else None)
            if all(m is not None for m in medians):
                table[f"{name} {mode}"] = {"roots": [str(r) for r in roots], "seconds": medians,
                                           "ratios": [m / medians[0] for m in medians],
                                           "fastest_seconds": fastest,
                                           "fastest_ratios": [m / fastest[0] for m in fastest]}
    return table


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--roots", nargs="+", help="source trees, each holding harts/")
    ap.add_argument("--workload", default="swe-treestep-1", help="a harts.tree.workload preset, or none")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--budget", type=int, default=131072, help="the unsplit tree's (and the preset's expanded) budget")
    ap.add_argument("--window-budget", type=int, default=57344, help="the preset's window plan budget")
    ap.add_argument("--shapes", default="", help="harts.tree.shapes instances family/seed@budget (or chains:NAME@budget, a case of chains.py), comma-separated: "
                    "each runs its window plan and expanded baseline at its budget, the tree unsplit")
    ap.add_argument("--baselines", default="", help="benchmarks/gpu/baselines.py workloads (treestep, stepwise, grpo, "
                    "bushy), comma-separated: each set as --workload's, at --budget and --window-budget")
    ap.add_argument("--expanded-at-window-budget", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs float32 (a smoke run of the script)")
    ap.add_argument("--both-orders", action="store_true", help="also run each root with expanded first")
    ap.add_argument("--out", default=".")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="tree,expanded,windows",
                    help="comma-separated: tree (unsplit), expanded (packed), prefix (prefix-merged), windows (l1l2)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    from harts.bench.provenance import provenance
    from harts.config.models import get_model_config
    from harts.tree.io import save_jsonl
    from harts.tree.workload import generate, preset

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = min(32768, get_model_config(args.model).vocab_size)
    sets = []  # (name, trajectories, window budget, expanded at the window budget)
    if args.workload and args.workload != "none":
        sets.append((args.workload, generate(preset(args.workload, vocab_size=vocab)).trajectories(),
                     args.window_budget, False))
    if args.baselines:
        if str(Path(__file__).resolve().parents[2]) not in sys.path:
            sys.path.append(str(Path(__file__).resolve().parents[2]))
        from benchmarks.gpu.baselines import workload as baseline_workload

        for name in args.baselines.split(","):
            sets.append((f"baselines/{name}", baseline_workload(name, vocab), args.window_budget, False))
    if args.shapes:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from windows import draw_case  # benchmarks/gpu/windows.py

    for spec in filter(None, args.shapes.split(",")):
        trajs, budget = draw_case(spec, vocab)
        sets.append((spec, trajs, budget, True))
    result = {"provenance": provenance([sys.argv[0], *argv]), "workload": args.workload, "shapes": args.shapes,
              "model": args.model, "budget": args.budget, "window_budget": args.window_budget,
              "trajectories": {name: len(t) for name, t, _, _ in sets}, "runs": []}
    modes = args.modes.split(",")
    orders = [",".join(modes)] + ([",".join(reversed(modes))] if args.both_orders else [])
    # one serving worker per root for the whole run, asked for each set in turn, the roots
    # alternating set by set
    workers = []
    for i, root in enumerate(args.roots):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(root).resolve()),
                                                             *filter(None, [os.environ.get("PYTHONPATH")])])}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--serve",
               "--model", args.model, "--budget", str(args.budget), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--device", args.device] + (["--no-autotune"] if args.no_autotune else [])
        log = open(out_dir / f"worker-{i}.log", "w")  # noqa: SIM115 - closed after the run
        workers.append((subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, bufsize=1, env=env, cwd=str(Path(root).resolve())), log))
    try:
        for k, (name, trajs, window_budget, exp_at_window) in enumerate(sets):
            rollouts = out_dir / f"rollouts-{k}.jsonl"
            save_jsonl(trajs, rollouts)
            for order in orders:
                for root, (proc, _) in zip(args.roots, workers, strict=True):
                    t0 = time.perf_counter()
                    proc.stdin.write(json.dumps({"input": str(rollouts.resolve()), "window_budget": window_budget,
                                                 "exp_at_window": exp_at_window, "modes": order}) + "\n")
                    proc.stdin.flush()
                    reply = next((ln for ln in proc.stdout if ln.startswith(("RESULT ", "ERROR "))), None)
                    run = {"set": name, "root": str(root), "order": order, "rc": proc.poll(),
                           "wall_s": time.perf_counter() - t0}
                    if reply is None or reply.startswith("ERROR "):
                        run["error"] = json.loads(reply[len("ERROR "):]) if reply else "the worker exited"
                        print(f"[{name} {root} {order}] ERROR\n{run['error']}", flush=True)
                    else:
                        run.update(json.loads(reply[len("RESULT "):]))
                        times = " ".join(f"{m} {v['seconds']:.3f}s" for m, v in run["modes"].items())
                        print(f"[{name} {root} {order}] {times} ({run['harts_file']})", flush=True)
                    result["runs"].append(run)
                    # written after every run, with the table so far: a run cut short keeps it
                    result["table"] = _table(result, sets, modes, args.roots)
                    (out_dir / "revisions.json").write_text(json.dumps(result, indent=1, default=str))
            rollouts.unlink()
    finally:
        for proc, log in workers:
            if proc.stdin:
                proc.stdin.close()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
    table = _table(result, sets, modes, args.roots)
    result["table"] = table
    (out_dir / "revisions.json").write_text(json.dumps(result, indent=1, default=str))
    for key, row in table.items():
        print(f"{key:32s} " + " ".join(f"{v:.3f}s" for v in row["seconds"])
              + "  ratio " + " ".join(f"{x:.3f}" for x in row["ratios"])
              + "  fastest-step ratio " + " ".join(f"{x:.3f}" for x in row["fastest_ratios"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
