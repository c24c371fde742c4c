"""Refit one rate of a hardware profile, the consumers' device seconds per producer row
(`consumer_device_s_per_producer_row`), to one measured window step; every other rate kept.

    python benchmarks/sim_refit_consumer.py --gpu h100 \
        --revisions benchmarks/results/chains/2026-12-07-b9cf708-chain64k-rowrange-h100.json \
        --root gpusnap/new [--write harts/sim/hardware/h100.json]

The step is a `benchmarks/gpu/revisions.py` file's window step of one root on one
`--shapes` case (a `harts.tree.shapes` instance family/seed@budget, or `chains:NAME@budget`,
a case of benchmarks/gpu/chains.py), planned by today's l1l2 (a plan with another
microbatch count than the one that ran is refused). The rate is solved so that the
executor model's one-GPU step (`harts.sim.fit_executor.predict`, what `harts sim` prices)
equals the measured median; the profile's other rates stay as they were fitted. Validate on
other steps with `python benchmarks/sim_heldout.py --gpu h100 --profile PROFILE --measured ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

RATE = "consumer_device_s_per_producer_row"


def window_case(shape: str, model: str, hw_dict: dict, measured_s: float):
    if not shape.startswith("chains:"):
        from sim_heldout import Cases

        return Cases(model, hw_dict).case(shape, "windows", measured_s=measured_s)
    from chains import instance  # benchmarks/gpu/chains.py

    from harts.config.models import get_model_config
    from harts.sim.fit_executor import case_of, step_of
    from harts.sim.hardware import profile_from_dict
    from harts.tree import build_forest

    cfg = get_model_config(model)
    name, budget = shape.removeprefix("chains:").split("@")
    step = step_of(build_forest(instance(name)[0]), "windows", int(budget), cfg.chunk_size)
    return case_of(shape, "windows", step, cfg, profile_from_dict(hw_dict), measured_s=measured_s)


def main(argv: list[str] | None = None) -> int:
    from scipy.optimize import brentq

    from harts.sim.executor_rates import executor_rates_from_dict
    from harts.sim.fit_executor import predict
    from harts.sim.hardware import HARDWARE_DIR

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=("h100", "h200"), default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--revisions", required=True, help="a benchmarks/gpu/revisions.py result file")
    ap.add_argument("--root", required=True, help="the root (source tree) of that file whose window step is fitted")
    ap.add_argument("--write", help="write the profile with the refitted rate here")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.revisions).read_text())
    if "runs" not in data:
        print(f"{args.revisions} is not a benchmarks/gpu/revisions.py result (no 'runs')", file=sys.stderr)
        return 2
    run = next((r for r in data["runs"] if r["root"] == args.root), None)
    if run is None or "windows" not in run["modes"]:
        print(f"no window step of root {args.root!r} in {args.revisions}", file=sys.stderr)
        return 2
    measured = run["modes"]["windows"]
    prof_path = HARDWARE_DIR / f"{args.gpu}.json"
    prof = json.loads(prof_path.read_text())
    case = window_case(run["set"], args.model, prof, measured["seconds"])
    if case.microbatches != measured["microbatches"]:
        print(f"{run['set']}: the step ran {measured['microbatches']} microbatches, l1l2 plans "
              f"{case.microbatches} today", file=sys.stderr)
        return 2
    rates = executor_rates_from_dict(prof["executor"], {})

    def err(value: float) -> float:
        return predict(dataclasses.replace(rates, **{RATE: value}), case) - measured["seconds"]

    old = getattr(rates, RATE)
    if err(0.0) > 0:
        print(f"{run['set']}: priced {err(0.0):+.3f} s over the measured step with no consumer term; "
              "the other rates, not this one, overprice it", file=sys.stderr)
        return 2
    new = brentq(err, 0.0, max(old, 1e-9) * 100)
    print(f"{run['set']} windows measured {measured['seconds']:.3f} s ({measured['microbatches']} microbatches): "
          f"priced {predict(rates, case):.3f} s with {RATE} = {old:.4g}; {new:.4g} prices it exactly")
    if args.write:
        commit = data["provenance"].get("git_revision", "")[:7]
        prof["executor"][RATE] = {
            "value": new, "source": "fitted",
            "what": (f"fitted alone (the other rates kept) to the l1l2 window step of {run['set']} measured on one "
                     f"{data['provenance'].get('device', {}).get('name', args.gpu)} ({args.revisions}, root "
                     f"{args.root}, {commit}): python benchmarks/sim_refit_consumer.py --gpu {args.gpu} "
                     f"--revisions {args.revisions} --root {args.root}; was {old:.4g}")}
        Path(args.write).write_text(json.dumps(prof, indent=1) + "\n")
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
