"""The simulator's peak memory against measured peaks (no GPU).

    python benchmarks/sim_memory.py --gpu h100 \
        --suite benchmarks/results/windows/2026-12-06-f183e91-window-suite-h100-seed5.json \
        --chains benchmarks/results/chains/2026-12-05-805d091-chains-h100.json [--json OUT]

Every step of the given files (`--suite`: benchmarks/gpu/window_suite.py files, each
instance's unsplit tree, l1l2 window plan and packed expanded step, read by
benchmarks/sim_heldout.py's `suite_rows`; `--chains`: benchmarks/gpu/chains.py files, their
rollouts rebuilt by chains.py's `instance`) is planned again as the GPU ran it
(`fit_executor.step_of`: the same planner and budget; a step whose plan no longer has the
measured microbatch count is left out and listed) and simulated on one GPU of `--gpu`'s
profile. Reported per step: the simulated peak (`SimResult.peak_memory_bytes`) against the
measured peak of allocated memory (`peak_bytes`: weights, gradients and optimizer state
included), and the part above the weights and optimizer state (`activation_peak_bytes`
against the simulated peak less its static bytes). Per plan kind: mean and largest
absolute error of the peak, and how many are within 5% and 10%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sim_heldout import suite_rows  # noqa: E402
from harts.bench.provenance import write_result  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.config.parallel import ParallelConfig  # noqa: E402
from harts.sim.executor import ExecutorCostModel  # noqa: E402
from harts.sim.fit_executor import step_of  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.sim.simulate import simulate  # noqa: E402
from harts.tree import build_forest, shapes  # noqa: E402

GIB = 2**30


def suite_steps(path: str, vocab: int):
    """(name, kind, budget, rollouts key, measured row) of a window-suite file."""
    for r in suite_rows(path):
        if "peak_bytes" in r:
            fam, rest = r["instance"].split("/")
            seed, budget = (int(x) for x in rest.split("@"))
            yield r["instance"], r["kind"], budget, ("shapes", fam, seed, budget, vocab), r


def chain_steps(path: str):
    """(name, kind, budget, rollouts key, measured case) of a benchmarks/gpu/chains.py file."""
    for key, case in json.loads(Path(path).read_text())["cases"].items():
        if "peak_bytes" in case:
            name = key.split()[0]
            yield f"chains:{name}", case["kind"], int(case["budget"]), ("chains", name), case


def rollouts(key: tuple):
    if key[0] == "chains":
        from benchmarks.gpu.chains import instance

        return instance(key[1])[0]
    _, fam, seed, budget, vocab = key
    return shapes.draw(fam, seed, budget, vocab_size=vocab)


def row(name: str, kind: str, budget: int, forest, case: dict, model, hw, static: float) -> dict:
    step = step_of(forest, kind, budget, model.chunk_size, unsplit_budget=max(budget, 131072))
    out = {"step": name, "kind": kind, "budget": budget, "microbatches": len(step.microbatches),
           "measured_microbatches": case.get("microbatches")}
    if case.get("microbatches") is not None and case["microbatches"] != len(step.microbatches):
        out["skipped"] = "plan changed"
        return out
    res = simulate(step, "non-overlap", model, ParallelConfig(), hw, cost_model="executor")
    out.update(simulated_peak_bytes=res.peak_memory_bytes, measured_peak_bytes=case["peak_bytes"],
               simulated_static_bytes=static, measured_base_bytes=case.get("base_bytes"),
               simulated_activation_bytes=res.peak_memory_bytes - static,
               measured_activation_bytes=case.get("activation_peak_bytes"),
               error=res.peak_memory_bytes / case["peak_bytes"] - 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=("h100", "h200"), default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--suite", action="append", default=[], help="a window_suite.py file (repeatable)")
    ap.add_argument("--chains", action="append", default=[], help="a chains.py file (repeatable)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, hw = get_model_config(args.model), load_hardware(args.gpu)
    static = ExecutorCostModel(model, ParallelConfig(), hw).static_bytes(0)
    vocab = min(32768, model.vocab_size)  # benchmarks/gpu/windows.py's VOCAB
    steps = [s for f in args.suite for s in suite_steps(f, vocab)] + [s for f in args.chains for s in chain_steps(f)]
    forests: dict[tuple, object] = {}
    rows = []
    for name, kind, budget, key, case in steps:
        if key not in forests:
            forests[key] = build_forest(rollouts(key))
        r = row(name, kind, budget, forests[key], case, model, hw, static)
        rows.append(r)
        if "skipped" in r:
            print(f"{name:22s} {kind:8s} skipped: {r['skipped']}", flush=True)
            continue
        act = r["measured_activation_bytes"]
        print(f"{name:22s} {kind:8s} mbs {r['microbatches']:3d}  peak sim {r['simulated_peak_bytes'] / GIB:6.2f} "
              f"measured {r['measured_peak_bytes'] / GIB:6.2f} GiB ({r['error']:+6.1%})  above static: sim "
              f"{r['simulated_activation_bytes'] / GIB:6.2f} measured {act / GIB if act else float('nan'):6.2f}",
              flush=True)
    summary = {}
    for kind in sorted({r["kind"] for r in rows}):
        errs = [abs(r["error"]) for r in rows if r["kind"] == kind and "error" in r]
        if errs:
            summary[kind] = {"steps": len(errs), "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs),
                             "within_5pct": sum(e <= 0.05 for e in errs), "within_10pct": sum(e <= 0.10 for e in errs)}
            s = summary[kind]
            print(f"{kind:8s} steps {s['steps']:2d}  mean |err| {s['mean_abs_error']:5.1%}  max {s['max_abs_error']:5.1%}  "
                  f"within 5% {s['within_5pct']}/{s['steps']}  within 10% {s['within_10pct']}/{s['steps']}")
    if args.json:
        write_result(args.json, gpu=args.gpu, model=args.model, summary=summary, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
