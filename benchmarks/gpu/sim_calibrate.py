"""The simulator's calibration and held-out steps on one GPU.

    bash benchmarks/gpu/run.sh "sim_calibrate"
    python3 benchmarks/gpu/sim_calibrate.py --out DIR [--seeds 1] [--budgets 8192 16384 32768]

1. `harts sim calibrate` (harts.bench.sim_measure.calibrate) on the calibration instances
   (seed 0 of grpo@8k, long-chain@16k, swe-tree@8k and fanout@8k: a step of many sequences,
   without which the per-sequence launches are not identified): op micro-benchmarks and their tree,
   windows and expanded steps, fitted into DIR/profile.json (a hardware profile);
2. new held-out instances (`--seeds`, default 1, of every `harts.tree.shapes` family at
   `--budgets`, default 8k and 16k), each as the unsplit tree, the l1l2 window plan and packed expanded: the
   median step time, and under torch.profiler the kernel time and launches; written after
   every instance to DIR/sim_calibrate.json (rows that benchmarks/sim_heldout.py reads:
   `python benchmarks/sim_heldout.py --gpu h100 --measured DIR/sim_calibrate.json` predicts
   them with the shipped profile, `--profile DIR/profile.json` with this run's).
Cases past `--time-limit` seconds are skipped and listed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harts.bench import host_probe  # noqa: E402
from harts.bench.provenance import provenance  # noqa: E402
from harts.bench.sim_measure import calibrate, measure_instances  # noqa: E402
from harts.sim.hardware import HARDWARE_DIR  # noqa: E402
from harts.tree.shapes import FAMILIES  # noqa: E402

CALIBRATION = [("grpo", 0, 8192), ("long-chain", 0, 16384), ("swe-tree", 0, 8192), ("fanout", 0, 8192)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--base", default="h200", help="profile (a shipped name or a file) whose assumptions the "
                    "calibrated one keeps")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8192, 16384])
    # two steps' times differ by up to 22% on the H100 host (benchmarks/results/sim/
    # 2026-12-05-c802182-sim-calibrate-h100.json: swe-tree/0@8192 expanded 0.905 / 1.129 s)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-calibrate", action="store_true", help="only the held-out steps")
    ap.add_argument("--no-autotune", action="store_true", help="each Triton kernel's first config that fits")
    ap.add_argument("--time-limit", type=float, default=420.0, help="start no new instance past this many seconds")
    ap.add_argument("--calibration-instances", default=",".join(f"{f}/{s}@{b}" for f, s, b in CALIBRATION),
                    help="family/seed@budget instances of the calibration (comma-separated)")
    ap.add_argument("--unsplit-budget", type=int, default=131072)
    ap.add_argument("--device", default="cuda", help="cuda; cpu is a smoke run of the script (use --model tiny-cpu)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    calibration = [(f, int(s), int(b)) for f, rest in (i.split("/") for i in args.calibration_instances.split(","))
                   for s, b in [rest.split("@")]]
    if args.no_autotune:
        from common import no_autotune

        no_autotune()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = {"provenance": provenance([sys.argv[0], *argv]), "model": args.model, "rows": [], "skipped": [],
              # this machine's host: seconds per small dispatched op (harts.bench.host_probe)
              "host_probe": host_probe.probe(args.device)}
    if not args.no_calibrate:
        # a shipped profile's name, or a profile file (as `harts sim calibrate --base`)
        base_path = Path(args.base) if Path(args.base).suffix else HARDWARE_DIR / f"{args.base}.json"
        base = json.loads(base_path.read_text())
        prof, rows = calibrate(args.model, args.device, base, calibration, steps=args.steps, warmup=args.warmup,
                               unsplit_budget=args.unsplit_budget, name="calibrated")
        (out / "profile.json").write_text(json.dumps(prof, indent=1) + "\n")
        result["calibration_rows"] = rows
        print(f"calibrated in {time.perf_counter() - t0:.0f}s: "
              + ", ".join(f"{k}={v['value']:.4g}" for k, v in prof["executor"].items()), flush=True)
    for family in args.families.split(","):
        for seed in args.seeds:
            for budget in args.budgets:
                if time.perf_counter() - t0 > args.time_limit:
                    result["skipped"].append(f"{family}/{seed}@{budget}")
                    continue
                result["rows"] += measure_instances(args.model, args.device, [(family, seed, budget)],
                                                    ("tree", "windows", "expanded"), args.steps, args.warmup,
                                                    args.unsplit_budget, profile=True)
                (out / "sim_calibrate.json").write_text(json.dumps(result, indent=1, default=str))
    result["seconds_total"] = time.perf_counter() - t0
    (out / "sim_calibrate.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"{len(result['rows'])} steps, skipped {result['skipped']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
