"""The host rate measured on a machine, held out on that machine's other steps (no GPU).

    python benchmarks/sim_host_fit.py --gpu h100 --suite FILE [--suite FILE ...] \
        --calibrate grpo/9,bushy/9 [--calibrate stepwise/9,grpo/9 ...] [--json OUT.json]

What `harts sim calibrate --host-only` does on a GPU, replayed on window-suite files
(benchmarks/gpu/window_suite.py) measured on one machine: `host_s_per_launch` alone fitted
(harts.bench.sim_measure.calibrate_host's least squares) to the window and expanded steps
of the `--calibrate` instances (family/seed, any budget of the files), every other rate the
shipped profile's; then every step of the other instances predicted by the shipped profile
and by the fitted one. Each `--calibrate` is one split. Prints per split the fitted rate
and, for both profiles, the held-out window steps' and all held-out steps' errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sim_heldout import suite_rows as heldout_rows  # noqa: E402
from harts.bench.provenance import provenance  # noqa: E402
from harts.bench.sim_measure import HOST_KINDS, measured_cases  # noqa: E402
from harts.sim.fit_executor import UNSPLIT_BUDGET, fit_rates, predict  # noqa: E402
from harts.sim.hardware import HARDWARE_DIR  # noqa: E402


def suite_rows(path: str) -> list[dict]:
    """A window-suite file's tree, window and expanded steps (benchmarks/sim_heldout.py's
    `suite_rows`) as `harts.bench.sim_measure` rows: with the family, seed and budget of
    their instance "family/seed@budget" (an unsplit step's own budget is the unsplit one)."""
    out = []
    for r in heldout_rows(path):
        if r["kind"] in ("tree", "windows", "expanded"):
            family, rest = r["instance"].split("/")
            seed, budget = (int(x) for x in rest.split("@"))
            out.append({**r, "family": family, "seed": seed, "budget": budget})
    return out


def errors(rates, cases) -> list[dict]:
    return [{"instance": c.name, "kind": c.kind, "measured_s": c.measured_s, "predicted_s": predict(rates, c),
             "error": predict(rates, c) / c.measured_s - 1} for c in cases]


def summary(errs: list[dict]) -> dict:
    def of(sel):
        return {"cases": len(sel), "max_abs_error": max((abs(e["error"]) for e in sel), default=0.0),
                "within_10pct": sum(abs(e["error"]) <= 0.1 for e in sel)}

    return {"windows": of([e for e in errs if e["kind"] == "windows"]), "all": of(errs)}


def split(base: dict, model: str, rows: list[dict], calibrate: set[str]) -> dict:
    def name(r):
        return f"{r['family']}/{r['seed']}"

    unknown = calibrate - {name(r) for r in rows}
    if unknown:
        raise SystemExit(f"--calibrate instances not in the suites: {', '.join(sorted(unknown))}")
    cal = [r for r in rows if name(r) in calibrate and r["kind"] in HOST_KINDS]
    held = [r for r in rows if name(r) not in calibrate]
    if not held:
        raise SystemExit(f"--calibrate {','.join(sorted(calibrate))} leaves no instance of the suites held out")
    hw, cal_cases, _ = measured_cases(base, cal, model, UNSPLIT_BUDGET)
    fitted, fit = fit_rates(hw.executor, cal_cases, ["host_s_per_launch"])
    _, held_cases, stale = measured_cases(base, held, model, UNSPLIT_BUDGET)
    shipped, refit = errors(hw.executor, held_cases), errors(fitted, held_cases)
    return {"calibrate": sorted(calibrate), "host_s_per_launch": fitted.host_s_per_launch,
            "shipped_host_s_per_launch": hw.executor.host_s_per_launch, "fit": fit, "skipped_plan_changed": stale,
            "shipped": {"summary": summary(shipped), "rows": shipped},
            "fitted": {"summary": summary(refit), "rows": refit}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=("h100", "h200"), default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--suite", action="append", required=True, help="window-suite files measured on one machine")
    ap.add_argument("--calibrate", action="append", required=True,
                    help="family/seed instances to fit the host rate on (comma-separated); repeat for more splits")
    ap.add_argument("--json", help="write the splits with provenance")
    args = ap.parse_args(argv)
    base = json.loads((HARDWARE_DIR / f"{args.gpu}.json").read_text())
    rows = [r for f in args.suite for r in suite_rows(f)]
    out = []
    for cal in args.calibrate:
        s = split(base, args.model, rows, set(cal.split(",")))
        out.append(s)
        print(f"calibrated on {','.join(s['calibrate'])}: host {s['host_s_per_launch'] * 1e6:.1f} us per launch "
              f"(shipped {s['shipped_host_s_per_launch'] * 1e6:.1f})")
        for which in ("shipped", "fitted"):
            w, a = s[which]["summary"]["windows"], s[which]["summary"]["all"]
            print(f"  {which:8s} held-out windows within 10% {w['within_10pct']}/{w['cases']} "
                  f"(max {100 * w['max_abs_error']:.1f}%), all steps {a['within_10pct']}/{a['cases']} "
                  f"(max {100 * a['max_abs_error']:.1f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(sys.argv if argv is None else
                                                                        [sys.argv[0], *argv]),
                                               "gpu": args.gpu, "model": args.model, "suites": args.suite,
                                               "splits": out}, indent=1,
                                              default=lambda o: o.item() if hasattr(o, "item") else str(o)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
