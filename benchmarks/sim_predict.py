"""The shipped profile's predictions for shape instances before they run (no GPU): a record
written ahead of the measurement, so the measurement is a held-out test of the simulator.

    python benchmarks/sim_predict.py --gpu h100 \
        --instances long-agent/1@16384,long-group/1@16384 [--model tiny-h200] [--out DIR]

Per instance (`harts.tree.shapes`, ordinary or long families) the executor model of the
shipped `--gpu` profile (harts/sim/hardware/<gpu>.json) prices the plan kinds the window
suite runs (benchmarks/gpu/window_suite.py): `tree` (the rows unsplit), `windows` (l1l2 at
the budget), `floored` (l1l2 with the profile's floors, its `--window-floors` case: the plan
`harts train` makes) and `expanded` (packed, expanded-ffd at the budget), one GPU; derived:
window / unsplit, floored / unsplit and expanded / windows. Writes DIR/<date>-<rev>-predicted-<gpu>.json with
provenance; `python benchmarks/sim_heldout.py --gpu GPU --profile
harts/sim/hardware/GPU.json --measured SUITE.json` later sets the measured steps beside the
same model's numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sim_heldout import Cases, provenance  # noqa: E402
from harts.sim.executor_rates import executor_rates_from_dict  # noqa: E402
from harts.sim.fit_executor import predict  # noqa: E402
from harts.sim.hardware import HARDWARE_DIR  # noqa: E402

KINDS = ("tree", "windows", "floored", "expanded")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=("h100", "h200"), default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--instances", required=True, help="family/seed@budget, comma-separated")
    ap.add_argument("--out", help="folder for <date>-<rev>-predicted-<gpu>.json")
    args = ap.parse_args(argv)
    prof = json.loads((HARDWARE_DIR / f"{args.gpu}.json").read_text())
    rates = executor_rates_from_dict(prof["executor"], {})
    cases = Cases(args.model, prof)
    rows = []
    for inst in args.instances.split(","):
        pred = {k: cases.case(inst, k) for k in KINDS}
        secs = {k: predict(rates, c) for k, c in pred.items()}
        rows.append({"instance": inst, **{f"{k}_s": secs[k] for k in KINDS},
                     **{f"{k}_microbatches": pred[k].microbatches for k in KINDS},
                     "windows_over_tree": secs["windows"] / secs["tree"],
                     "floored_over_tree": secs["floored"] / secs["tree"],
                     "expanded_over_windows": secs["expanded"] / secs["windows"]})
        r = rows[-1]
        print(f"{inst:24s} tree {r['tree_s']:6.3f} s  windows {r['windows_s']:6.3f} s ({r['windows_microbatches']} mbs)"
              f"  expanded {r['expanded_s']:6.3f} s  windows/tree {r['windows_over_tree']:.3f}"
              f"  floored/tree {r['floored_over_tree']:.3f} ({r['floored_microbatches']} mbs)", flush=True)
    result = {"provenance": provenance([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
              "gpu": args.gpu, "model": args.model, "profile": f"harts/sim/hardware/{args.gpu}.json", "rows": rows}
    if args.out:
        import datetime as dt

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rev = result["provenance"]["git_revision"][:7] or "norev"
        path = out / f"{dt.date.today().isoformat()}-{rev}-predicted-{args.gpu}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
