"""Heddle against step-centric baselines and a known-lengths reference, per seed: the
tables `docs/ROLLOUT_SIM.md` quotes for `agentic-reasoning` (flash), `agentic-reasoning-dense`
(qwen3-32b) and `swe-agent`.

    python benchmarks/bench_rollout_heddle.py --workload agentic-reasoning --seeds 0-4 --json OUT.json
    python benchmarks/bench_rollout_heddle.py --workload swe-agent --seeds 5-14 --ablations none
    python benchmarks/bench_rollout_heddle.py --workload agentic-reasoning --seeds 0-4 --ablations variants \
        --reuse benchmarks/results/rollout/2026-12-05-574891c-agentic-reasoning-0-4.json   # Heddle's options
    python benchmarks/bench_rollout_heddle.py --workload agentic-reasoning-dense --seeds 0 \
        --set fixed_cost_scale=1.5          # one cell of the sensitivity table

Per seed, on the same trajectories: the baselines (`--baselines`, default least-loaded,
cache-aware, verl) at every usable fixed degree; "hindsight best" = the fastest of them
(router and degree picked per seed after the fact); "verl-style" = `verl` at each fixed
degree; Heddle and its ablations or its off-by-default options (`--ablations all | variants |
none | NAME,...`); the known-lengths reference
(`compare.known_lengths_schedule`, ORACLE: reads true lengths) and the three makespan
bounds. "Headroom closed" = (hindsight best / Heddle - 1) / (hindsight best / reference - 1)
in throughput terms. Markdown to stdout; `--json` writes every run, the summaries and
provenance (git revision, command, versions, time). `--reuse` takes the baselines' and the
reference's runs from an earlier `--json` instead of simulating them again (valid while
their code is unchanged).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import provenance  # noqa: E402

from harts.config.rollout import rollout_preset  # noqa: E402

ABLATIONS = ("heddle-no-priority", "heddle-no-preemption", "heddle-no-placement", "heddle-no-migration",
             "heddle-no-adaptive-mp", "heddle-anneal-layout", "heddle-no-group-predictor",
             "heddle-no-live-migration", "heddle-no-dynamic-mp")
# options off in Heddle by default: moves decided on the step's predicted makespan (every kind,
# tool-call migration only, tool-call migration and stealing), drain-and-merge of workers as
# the tail forms, makespan-decided tool-call migration with drain-and-merge, the tail shield,
# predicted-tail pools (layout from the twin, or the fixed rule), the posterior length
# predictor, and homes by count with makespan-decided tool-call migration and no preemption
# (with and without the posterior predictor)
VARIANTS = ("heddle-makespan-moves", "heddle-makespan-tool", "heddle-makespan-tool-steal", "heddle-drain-merge",
            "heddle-makespan-tool-drain", "heddle-tail-shield", "heddle-tail-pools", "heddle-tail-pools-rule",
            "heddle-posterior", "heddle-count-homes", "heddle-count-homes-posterior")


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def run_seed(workload: str, overrides: dict, seed: int, gpus: int, baselines: tuple[str, ...],
             heddles: tuple[str, ...], reference: bool, reuse: dict | None = None, hold_layout: bool = False) -> dict:
    from harts.sim.rollout import generate_trajectories, get_policy, simulate_rollout
    from harts.sim.rollout.compare import known_lengths_schedule, makespan_bounds
    from harts.sim.rollout.cost import make_rollout_cost
    from harts.sim.rollout.engine import usable_degrees

    cfg = rollout_preset(workload, **overrides, seed=seed)
    cost = make_rollout_cost(cfg)
    specs = generate_trajectories(cfg)
    runs = []

    def record(name, mp, r, wall, extra=None):
        runs.append({"policy": name, "mp": mp, "makespan_s": r.makespan_s,
                     "throughput_tokens_per_s": r.throughput_tokens_per_s, "gpu_utilization": r.gpu_utilization,
                     "preemptions": r.preemptions, "recomputed_tokens": r.recomputed_tokens,
                     "migrations": r.migrations, "merges": r.merges, "layout": list(r.initial_degrees),
                     "wall_s": wall} | (extra or {}))

    if reuse is not None:  # the baselines and the reference of an earlier run of this seed (same code for them)
        runs += [r for r in reuse["runs"] if r["policy"] in baselines or (reference and r["policy"] == "known-lengths")]
        baselines = ()
        if reference:
            reference = False
    for name in baselines:
        for d in usable_degrees(cfg, cost):
            if gpus % d:
                continue
            t0 = time.perf_counter()
            r = simulate_rollout(dataclasses.replace(cfg, baseline_mp=d), get_policy(name), gpus, specs=specs, cost=cost)
            record(name, d, r, time.perf_counter() - t0)
    for name in heddles:
        t0 = time.perf_counter()
        pol = get_policy(name)
        if hold_layout:  # Heddle and its variants start from the preset's baseline_mp everywhere
            pol = dataclasses.replace(pol, adaptive_mp=False)
        r = simulate_rollout(cfg, pol, gpus, specs=specs, cost=cost)
        record(name, cfg.baseline_mp, r, time.perf_counter() - t0)
    if reference:
        t0 = time.perf_counter()
        r, info = known_lengths_schedule(cfg, specs, cost, gpus)
        record("known-lengths", 0, r, time.perf_counter() - t0, {"schedule": info})
    bounds = makespan_bounds(cfg, specs, cost, gpus)
    return {"seed": seed, "runs": runs, "bounds_s": bounds, "generated_tokens": sum(s.generated_tokens for s in specs)}


def summarize(res: dict, verl_mps: list[int]) -> dict:
    runs = res["runs"]
    base = [r for r in runs if r["policy"] in ("round-robin", "least-loaded", "cache-aware", "verl")]
    best = min(base, key=lambda r: r["makespan_s"])
    out = {"seed": res["seed"], "best_baseline": f"{best['policy']}@MP{best['mp']}",
           "best_baseline_s": best["makespan_s"], "bound_s": max(res["bounds_s"].values())}
    for r in runs:
        if r["policy"] == "verl":
            out[f"verl@MP{r['mp']}_s"] = r["makespan_s"]
        elif r["policy"].startswith("heddle") or r["policy"] == "known-lengths":
            out[f"{r['policy']}_s"] = r["makespan_s"]
    if "heddle_s" in out:
        out["heddle_vs_best"] = best["makespan_s"] / out["heddle_s"]
        for mp in verl_mps:
            if f"verl@MP{mp}_s" in out:
                out[f"heddle_vs_verl@MP{mp}"] = out[f"verl@MP{mp}_s"] / out["heddle_s"]
        if "known-lengths_s" in out:
            ref = best["makespan_s"] / out["known-lengths_s"] - 1.0
            out["reference_vs_best"] = ref + 1.0
            out["headroom_closed"] = (out["heddle_vs_best"] - 1.0) / ref if ref > 0 else None
    return out


def sweep_load(args, overrides: dict) -> int:
    """Heddle against the hindsight-best baseline and the known-lengths reference as the
    trajectories per GPU vary (the prompt count changes; everything else is the preset's)."""
    cfg = rollout_preset(args.workload, **overrides)
    seeds = _seeds(args.seeds)
    baselines = tuple(args.baselines.split(","))
    rows, t0 = [], time.perf_counter()
    for load in (float(x) for x in args.sweep_load.split(",")):
        prompts = max(1, round(load * args.gpus / cfg.rollouts_per_prompt))
        ov = overrides | {"num_prompts": prompts}
        jobs = [(args.workload, ov, s, args.gpus, baselines, ("heddle",), not args.no_reference) for s in seeds]
        with ProcessPoolExecutor(max(1, args.jobs)) as ex:
            res = list(ex.map(run_seed, *zip(*jobs, strict=True)))
        sums = [summarize(r, []) for r in res]
        rows.append({"trajectories_per_gpu": prompts * cfg.rollouts_per_prompt / args.gpus, "num_prompts": prompts,
                     "summaries": sums, "results": res})
    print(f"## {args.workload} {overrides or ''}: load sweep on {args.gpus} x {cfg.hardware}, seeds {seeds}\n")
    print("| trajectories / GPU | hindsight best s (mean) | heddle s (mean) | heddle / best (mean, min) "
          "| known-lengths / best (mean) |\n|---|---|---|---|---|")
    for row in rows:
        s = row["summaries"]
        ref = [x["reference_vs_best"] for x in s if "reference_vs_best" in x]
        print(f"| {row['trajectories_per_gpu']:g} | {sum(x['best_baseline_s'] for x in s) / len(s):.1f} "
              f"| {sum(x['heddle_s'] for x in s) / len(s):.1f} "
              f"| {sum(x['heddle_vs_best'] for x in s) / len(s):.3f}x, {min(x['heddle_vs_best'] for x in s):.3f}x "
              f"| {(sum(ref) / len(ref)) if ref else float('nan'):.3f}x |")
    print(f"\n{time.perf_counter() - t0:.0f} s wall")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "workload": args.workload,
                                               "overrides": overrides, "gpus": args.gpus, "seeds": seeds,
                                               "sweep": rows}, indent=1) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="agentic-reasoning")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--baselines", default="least-loaded,cache-aware,verl")
    ap.add_argument("--ablations", default="all", help="'all', 'none' or a comma-separated list")
    ap.add_argument("--no-reference", action="store_true", help="skip the known-lengths reference")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--jobs", type=int, default=1, help="seeds simulated in parallel processes")
    ap.add_argument("--sweep-load", metavar="N,N,...",
                    help="trajectories per GPU to sweep (sets num_prompts); prints Heddle / hindsight best per load")
    ap.add_argument("--json", help="write runs, summaries and provenance here")
    ap.add_argument("--reuse", metavar="JSON",
                    help="take the baselines' and the reference's runs from this earlier --json of the same workload, "
                         "overrides and GPUs (only Heddle's runs are simulated)")
    ap.add_argument("--hold-layout", action="store_true",
                    help="Heddle and its variants without adaptive MP: every worker at the preset's baseline_mp")
    args = ap.parse_args()
    overrides = {k: ast.literal_eval(v) for k, _, v in (kv.partition("=") for kv in args.set)}
    if args.sweep_load:
        return sweep_load(args, overrides)
    seeds = _seeds(args.seeds)
    named = {"none": (), "all": ABLATIONS, "variants": VARIANTS}
    abl = named[args.ablations] if args.ablations in named else tuple(args.ablations.split(","))
    heddles = ("heddle", *abl)
    baselines = tuple(args.baselines.split(","))
    reuse = {s: None for s in seeds}
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        if (old["workload"], old["overrides"], old["gpus"]) != (args.workload, overrides, args.gpus):
            raise SystemExit(f"--reuse {args.reuse}: another workload, overrides or GPU count")
        by_seed = {r["seed"]: r for r in old["results"]}
        if missing := [s for s in seeds if s not in by_seed]:
            raise SystemExit(f"--reuse {args.reuse}: no runs of seeds {missing}")
        reuse = {s: by_seed[s] for s in seeds}
    t0 = time.perf_counter()
    job = (args.workload, overrides)
    jobs = [(*job, s, args.gpus, baselines, heddles, not args.no_reference, reuse[s], args.hold_layout)
            for s in seeds]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            results = list(ex.map(run_seed, *zip(*jobs, strict=True)))
    else:
        results = [run_seed(*j) for j in jobs]
    wall = time.perf_counter() - t0
    cfg = rollout_preset(args.workload, **overrides)
    mps = sorted({r["mp"] for res in results for r in res["runs"] if r["policy"] == "verl"})
    sums = [summarize(r, mps) for r in results]
    print(f"## {args.workload} {overrides or ''}: {cfg.num_trajectories} trajectories, {cfg.model} on {args.gpus} x "
          f"{cfg.hardware}, KV {cfg.kv_alloc}/{cfg.preemption}\n")
    head = ["seed", "hindsight best", "best s", *[f"verl MP{m} s" for m in mps], "known-lengths s (ORACLE)", "heddle s",
            "heddle / best", *[f"/ verl MP{m}" for m in mps], "headroom closed", "bound s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for s in sums:
        cells = [str(s["seed"]), s["best_baseline"], f(s["best_baseline_s"], ".1f"),
                 *[f(s.get(f"verl@MP{m}_s"), ".1f") for m in mps], f(s.get("known-lengths_s"), ".1f"),
                 f(s.get("heddle_s"), ".1f"), f(s.get("heddle_vs_best"), ".3f") + "x",
                 *[f(s.get(f"heddle_vs_verl@MP{m}"), ".2f") + "x" for m in mps],
                 f(s.get("headroom_closed"), ".0%"), f(s["bound_s"], ".1f")]
        print("| " + " | ".join(cells) + " |")

    def mean(key):
        v = [s[key] for s in sums if s.get(key) is not None]
        return sum(v) / len(v) if v else None

    print(f"\nmean heddle / hindsight best {f(mean('heddle_vs_best'), '.3f')}x (min "
          f"{f(min((s['heddle_vs_best'] for s in sums if 'heddle_vs_best' in s), default=None), '.3f')}x); "
          f"reference / best {f(mean('reference_vs_best'), '.3f')}x; headroom closed (mean of seeds) "
          f"{f(mean('headroom_closed'), '.0%')}; "
          + "; ".join(f"heddle / verl MP{m} {f(mean(f'heddle_vs_verl@MP{m}'), '.2f')}x" for m in mps))
    if abl:
        print("\n### Heddle and each variant: makespan s per seed, Heddle / hindsight best, headroom closed\n")
        print("| policy | " + " | ".join(f"seed {s['seed']}" for s in sums)
              + " | mean / best | min / best | headroom closed |\n|" + "---|" * (len(sums) + 4))
        for a in heddles:
            ratios = [s["best_baseline_s"] / s[f"{a}_s"] for s in sums]
            closed = [(x - 1.0) / (s["reference_vs_best"] - 1.0) for x, s in zip(ratios, sums, strict=True)
                      if s.get("reference_vs_best", 1.0) > 1.0]
            print(f"| {a} | " + " | ".join(f"{s[f'{a}_s']:.1f}" for s in sums)
                  + f" | {sum(ratios) / len(ratios):.3f}x | {min(ratios):.3f}x | "
                  + (f"{sum(closed) / len(closed):.0%}" if closed else "-") + " |")
        print("\n### Ablation: makespan relative to Heddle's (> 1: the mechanism helps)\n")
        print("| variant | " + " | ".join(f"seed {s['seed']}" for s in sums) + " | mean |\n|" + "---|" * (len(sums) + 2))
        for a in abl:
            v = [s[f"{a}_s"] / s["heddle_s"] for s in sums]
            print(f"| {a} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {sum(v) / len(v):.3f} |")
    print(f"\n{wall:.0f} s wall")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "workload": args.workload,
                                               "overrides": overrides, "gpus": args.gpus, "seeds": seeds,
                                               "summaries": sums, "results": results, "wall_s": wall},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
