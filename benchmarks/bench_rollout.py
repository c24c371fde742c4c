"""Rollout throughput of Heddle, its ablations and the step-centric baselines on a
long-tail agentic workload, over 5 seeds (the table the >= 2x target is read from).

    python benchmarks/bench_rollout.py [--workload agentic-longtail] [--gpus 32]
        [--seeds 0,1,2,3,4] [--baseline-mps 4,8] [--json OUT.json]
    python benchmarks/bench_rollout.py --workload agentic-longtail-loaded --json OUT.json
    python benchmarks/bench_rollout.py --workload agentic-reasoning --seeds 0 \
        --policies least-loaded,cache-aware --set action_group_sigma=0.0   # a variant's bound
    python benchmarks/bench_rollout.py --workload agentic-reasoning --set model="'qwen3-32b'" \
        --bounds-only          # the makespan bounds per seed, no policy simulated

Every policy runs the same trajectories per seed (`harts.sim.rollout.compare`); the best
baseline of a seed is the fastest of round-robin / least-loaded / cache-aware at any of
the fixed degrees given. Heddle and its ablations start from the workload's baseline_mp.
`--set KEY=VALUE` (repeatable) overrides a field of the preset; `--policies` runs a subset.
`--oracle` is a diagnostic, not a policy: Heddle's predictor is replaced by the true
remaining tokens and turns (what no scheduler can know), to measure how much of the gap to
the bound is prediction.
Markdown tables to stdout; --json writes every run, the per-seed summaries and
provenance (git revision, command line, package versions).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from harts.config.rollout import rollout_preset  # noqa: E402
from harts.sim.rollout.compare import compare  # noqa: E402
from harts.sim.rollout.policies import known_policies  # noqa: E402


def provenance() -> dict:
    import numpy

    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True,
                                    text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        rev, dirty = "unknown", None
    return {"git_rev": rev, "git_dirty": dirty, "command": " ".join([sys.executable, *sys.argv]),
            "python": platform.python_version(), "numpy": numpy.__version__, "platform": platform.platform(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def install_oracle_predictor() -> None:
    """Replace the engine's remaining-length predictor with the truth (diagnostic only)."""
    import harts.sim.rollout.engine as engine

    def oracle(spec, turns_done, generated, action_prior, budget_tokens=float("inf"), max_turns=float("inf"),
               elapsed=0, prior_weight=0.0):
        rest = spec.turns[turns_done:]
        return max(sum(t.action_tokens for t in rest) - elapsed, 1.0), float(max(len(rest), 1))

    engine.predict_remaining = oracle


def bounds_only(cfg, args, seeds, overrides) -> int:
    """The critical-path, tail-set and work bounds of each seed (no policy simulated)."""
    import dataclasses

    from harts.sim.rollout.compare import makespan_bounds
    from harts.sim.rollout.cost import make_rollout_cost
    from harts.sim.rollout.workload import generate_trajectories

    cost = make_rollout_cost(cfg)
    rows = []
    for seed in seeds:
        c = dataclasses.replace(cfg, seed=seed)
        b = makespan_bounds(c, generate_trajectories(c), cost, args.gpus)
        rows.append({"seed": seed, "critical_path_s": b["critical_path"], "tail_bound_s": b["tail_set"],
                     "work_bound_s": b["work"]})
    print(f"## Makespan bounds: {args.workload} {overrides or ''}, {cfg.model} on {args.gpus} x {cfg.hardware}\n")
    print("| seed | critical path s | tail-set bound s | work bound s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['critical_path_s']:.1f} | {r['tail_bound_s']:.1f} | {r['work_bound_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "workload": args.workload,
                                               "overrides": overrides, "gpus": args.gpus, "bounds": rows},
                                              indent=2) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="agentic-longtail")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--baseline-mps", default="4,8")
    ap.add_argument("--policies", help="comma-separated subset of the registered policies (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the workload preset (a Python literal), repeatable")
    ap.add_argument("--oracle", action="store_true",
                    help="diagnostic: Heddle's predictor reads the true remaining lengths (not a policy)")
    ap.add_argument("--bounds-only", action="store_true",
                    help="print the three makespan bounds per seed and simulate no policy")
    ap.add_argument("--json", help="write results + provenance here")
    args = ap.parse_args()
    if args.oracle:
        install_oracle_predictor()
    overrides = {}
    for kv in args.set:
        key, _, value = kv.partition("=")
        overrides[key] = ast.literal_eval(value)
    cfg = rollout_preset(args.workload, **overrides)
    policies = tuple(args.policies.split(",")) if args.policies else tuple(known_policies())
    seeds = tuple(int(s) for s in args.seeds.split(","))
    mps = tuple(int(s) for s in args.baseline_mps.split(","))
    if args.bounds_only:
        return bounds_only(cfg, args, seeds, overrides)
    t0 = time.perf_counter()
    runs, summaries = compare(cfg, args.gpus, seeds, policies, mps,
                              progress=lambda s: print(f"  {s}", file=sys.stderr, flush=True))
    wall = time.perf_counter() - t0
    label = f"{args.workload} {overrides}" if overrides else args.workload
    label += ", ORACLE predictor (diagnostic)" if args.oracle else ""
    print(f"## Rollout: {cfg.num_trajectories} trajectories ({label}), {cfg.model} on {args.gpus} x "
          f"{cfg.hardware}, seeds {list(seeds)}\n")
    print("| seed | policy | MP | tok/s | makespan s | GPU util | migrations | layout |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        mp = "adaptive" if len(set(r.worker_degrees)) > 1 else r.worker_degrees[0]
        print(f"| {r.seed} | {r.policy} | {mp} "
              f"| {r.throughput_tokens_per_s:,.0f} | {r.makespan_s:.1f} | {r.gpu_utilization:.1%} | {r.migrations} "
              f"| {'/'.join(map(str, r.worker_degrees))}{f' (+{r.merges} merges)' if r.merges else ''} |")
    pols = list(policies)
    print("\n## Speedup over the best step-centric baseline of each seed\n")
    print("| policy | " + " | ".join(f"seed {s.seed}" for s in summaries) + " | mean |")
    print("|---|" + "---|" * (len(summaries) + 1))
    for p in pols:
        vals = [s.speedup.get(p) for s in summaries]
        ok = [v for v in vals if v is not None]
        tail = f" | {sum(ok) / len(ok):.2f}x |" if ok else " | - |"
        print(f"| {p} | " + " | ".join("-" if v is None else f"{v:.2f}x" for v in vals) + tail)
    print("| best baseline | " + " | ".join(s.best_baseline for s in summaries) + " | |")
    print("| bound on any policy | " + " | ".join(f"{s.speedup_cap:.2f}x" for s in summaries)
          + f" | {sum(s.speedup_cap for s in summaries) / len(summaries):.2f}x |")
    print("\nMakespans (s): best baseline / critical path / tail-set bound / work bound / heddle: " + "; ".join(
        f"seed {s.seed}: {s.best_baseline_makespan_s:.1f} / {s.critical_path_s:.1f} / {s.tail_bound_s:.1f} / "
        f"{s.work_bound_s:.1f} / "
        + next((f"{r.makespan_s:.1f}" for r in runs if r.seed == s.seed and r.policy == "heddle"), "-")
        for s in summaries))
    print(f"\n{wall:.1f} s wall")
    if args.json:
        out = {"provenance": provenance(), "workload": args.workload, "overrides": overrides, "oracle": args.oracle,
               "gpus": args.gpus,
               "seeds": list(seeds),
               "baseline_mps": list(mps), "wall_s": wall,
               "runs": [r.__dict__ | {"worker_degrees": list(r.worker_degrees)} for r in runs],
               "summaries": [{"seed": s.seed, "best_baseline": s.best_baseline,
                              "best_baseline_throughput": s.best_baseline_throughput,
                              "best_baseline_makespan_s": s.best_baseline_makespan_s,
                              "bound_makespan_s": s.bound_makespan_s, "speedup_cap": s.speedup_cap,
                              "critical_path_s": s.critical_path_s, "tail_bound_s": s.tail_bound_s,
                              "work_bound_s": s.work_bound_s,
                              "speedup": s.speedup} for s in summaries]}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
