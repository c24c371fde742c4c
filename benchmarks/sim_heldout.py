"""Held-out validation of the simulator's executor model against measured steps (no GPU).

    python benchmarks/sim_heldout.py --gpu h100 --out benchmarks/results/sim
    python benchmarks/sim_heldout.py --gpu h100 --write-profile harts/sim/hardware/h100.json
    python benchmarks/sim_heldout.py --gpu h200 --measured OUT/sim_calibrate.json
    python benchmarks/sim_heldout.py --gpu h100 --rows OUT/sim_calibrate.json \
        --calibrate grpo/0@8192,long-chain/0@16384,swe-tree/0@8192,fanout/1@8192 [--write-profile ...]

The protocol: measured steps of `harts.tree.shapes` instances (family/seed@budget, each
run as the unsplit tree, the l1l2 window plan and packed expanded, one GPU) are split by
instance into a calibration set and a held-out set (`--calibrate`, default: grpo at 8k and
32k, bushy and stepwise at 16k: two budgets, three families never seen). The executor
model's launch counts are fitted to the counted launches of the window anatomy (a property
of the code path, not of the GPU), its device and host rates to the calibration set's step
times; then every held-out step is predicted. Reported per plan kind: the relative error
(predicted / measured - 1), and per instance whether the simulated order of (tree,
windows, expanded) matches the measured order on every pair whose measured times differ
by more than 5%. Nothing is fitted to the held-out set. `--write-profile` writes the
calibration set's fit into a hardware profile's `executor` section (how the shipped
h100/h200 profiles were made); `--measured` adds the rows of benchmarks/gpu/sim_calibrate.py
(their instances are held out, their calibrated profile is reported beside).

A window-suite file's `windows-floored` step (l1l2 with the microbatch floors of the
profile predicting it: the window plan with its blocks ordered for the host, or L1's
windowless plan) is kind `floored`; a row whose microbatch count the planner no longer
gives is skipped and listed.

`--chains FILE` (a benchmarks/gpu/chains.py file) adds its steps to the held-out set as
"chains:<case>": trajectories longer than the budget run as chains of windows, and the
swe-treestep-1 preset's windows, at 16-32k budgets.

`--rows FILE` (a benchmarks/gpu/sim_calibrate.py file, every step of it measured on one
revision of the code, with counted launches and kernel time): the whole protocol on that
file alone. The executor section is fitted from the base rates (`fit_profile`, what `harts
sim calibrate` runs: launch counts to counted launches, device rates to kernel time, host
rates to step time) on the `--calibrate` instances of the file, and every other instance
of the file is predicted. The launch counts are fitted to the calibration instances' counts
here too, so they must span the sequences per step (a fan-out instance: the three
instances `harts sim calibrate` measured until 2026-12-05 have 5-11 sequences per step and
leave the per-sequence launches unidentified).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harts.bench.sim_measure import DEVICE_RATES, HOST_RATES, LAUNCH_RATES  # noqa: E402
from harts.sim.executor_rates import CATEGORY_SCALES  # noqa: E402

# the files without kernel time by category fit the device rates but not the category scales
TOTAL_DEVICE_RATES = tuple(n for n in DEVICE_RATES if n not in CATEGORY_SCALES)
from harts.config.models import get_model_config  # noqa: E402
from harts.sim.executor import plan_floors  # noqa: E402
from harts.sim.executor_rates import BASE_EXECUTOR, executor_rates_from_dict, executor_rates_to_dict  # noqa: E402
from harts.sim.fit_executor import KINDS, case_of, fit_launches, fit_rates, predict, step_of  # noqa: E402
from harts.sim.hardware import HARDWARE_DIR, profile_from_dict  # noqa: E402
from harts.tree import build_forest, shapes  # noqa: E402

RESULTS = "benchmarks/results/windows"
SUITE = {"h100": [f"{RESULTS}/2026-12-05-ae26d54-window-suite-h100-{s}.json" for s in "abc"], "h200": []}
ANATOMY = f"{RESULTS}/2026-12-05-f9de154-window-anatomy-h200.json"
HOST = f"{RESULTS}/2026-12-05-f9de154-window-host-h200.json"
CALIBRATE = "grpo/0@8192,grpo/0@32768,bushy/0@16384,stepwise/0@16384"
MARGIN = 0.05


def suite_rows(path: str) -> list[dict]:
    """(instance, kind, seconds, ...) rows of a window-suite file or a sim_calibrate file."""
    data = json.loads((ROOT / path).read_text()) if not Path(path).is_absolute() else json.loads(Path(path).read_text())
    if "rows" in data:
        return [r for r in data["rows"] if "seconds" in r]
    out = []
    for k, inst in data["instances"].items():
        for kind, c in inst["cases"].items():
            if "seconds" not in c:
                continue
            if kind == "windows-floored":
                # l1l2 with the floors of the GPU's profile: the window plan (its blocks
                # ordered for the host) or L1's windowless plan
                kind = "floored"
            out.append({"instance": k, "kind": kind, "seconds": c["seconds"], "microbatches": c.get("microbatches"),
                        "rows": c.get("rows"), "budget": c.get("budget"),
                        **{m: c[m] for m in ("peak_bytes", "base_bytes", "activation_peak_bytes") if m in c}})
    return out


class Cases:
    def __init__(self, model: str, hw_dict: dict):
        self.cfg = get_model_config(model)
        self.hw = profile_from_dict(hw_dict)
        self._forests: dict[str, object] = {}

    def case(self, instance: str, kind: str, **truth):
        family, rest = instance.split("/")
        seed, budget = (int(x) for x in rest.split("@"))
        if instance not in self._forests:
            self._forests[instance] = build_forest(shapes.draw(family, seed, budget, vocab_size=min(32768, self.cfg.vocab_size)))
        floors = plan_floors(self.cfg, self.hw, budget) if kind == "floored" else None
        step = step_of(self._forests[instance], kind, budget, self.cfg.chunk_size, floors=floors)
        return case_of(instance, kind, step, self.cfg, self.hw, **truth)


def planned_case(cases: Cases, r: dict, path: str, stale: list) -> object | None:
    """Row `r` of `path` as a case, or None (noted in `stale` and printed) where it ran a
    plan other than the one the planner gives its instance today."""
    case = cases.case(r["instance"], r["kind"], measured_s=r["seconds"])
    if r.get("microbatches") in (None, case.microbatches):
        return case
    stale.append({"file": path, "instance": r["instance"], "kind": r["kind"],
                  "measured_microbatches": r["microbatches"], "planned_microbatches": case.microbatches})
    print(f"skipped {r['instance']} {r['kind']} of {path}: it ran {r['microbatches']} microbatches, "
          f"the planner gives {case.microbatches} today", flush=True)
    return None


def ranking_ok(pred: dict[str, float], meas: dict[str, float]) -> tuple[bool, list[str]]:
    """Does the simulated order match the measured one on every pair measured > 5% apart?"""
    wrong = []
    for a, b in itertools.combinations(sorted(meas), 2):
        if max(meas[a], meas[b]) / min(meas[a], meas[b]) - 1 <= MARGIN:
            continue
        if (meas[a] < meas[b]) != (pred[a] < pred[b]):
            wrong.append(f"{a}<{b}" if meas[a] < meas[b] else f"{b}<{a}")
    return not wrong, wrong


def report(rates, cases, calibration: set[str], new: set[str]) -> dict:
    """Errors and rankings per set: "calibration", "held-out" (the suite's other instances),
    "new" (the --measured steps)."""
    def which(name: str) -> str:
        return "new" if name in new else "calibration" if name in calibration else "held-out"

    rows = [{"instance": c.name, "kind": c.kind, "microbatches": c.microbatches, "measured_s": c.measured_s,
             "predicted_s": predict(rates, c), "error": predict(rates, c) / c.measured_s - 1,
             "set": which(c.name)} for c in cases]
    out: dict = {"rows": rows, "by_kind": {}, "ranking": {}}
    for which in ("new", "held-out", "calibration"):
        sel = [r for r in rows if r["set"] == which]
        out["by_kind"][which] = {k: {"cases": len(e), "mean_abs_error": sum(map(abs, e)) / len(e),
                                     "max_abs_error": max(map(abs, e)), "within_10pct": sum(abs(x) <= 0.10 for x in e)}
                                 for k in (*KINDS, "floored", "l1") if (e := [r["error"] for r in sel if r["kind"] == k])}
        ranks = {}
        for inst in sorted({r["instance"] for r in sel}):
            rs = {r["kind"]: r for r in sel if r["instance"] == inst}
            ok, wrong = ranking_ok({k: r["predicted_s"] for k, r in rs.items()}, {k: r["measured_s"] for k, r in rs.items()})
            ranks[inst] = {"match": ok, "wrong_pairs": wrong}
        out["ranking"][which] = ranks
    return out


def fit_profile_rates(gpu: str, hw_dict: dict, model: str, calibration: set[str], extra: list[str]):
    """The executor rates of `gpu` from the calibration instances (module docstring)."""
    # every fit starts from the same point (the base section), not from the profile's last fit
    section = json.loads(json.dumps(BASE_EXECUTOR))
    hw_dict = {**hw_dict, "executor": section}
    cases = Cases(model, hw_dict)
    sources: dict[str, str] = {}
    rates = executor_rates_from_dict(section, sources)
    sources = {k.removeprefix("executor."): v for k, v in sources.items()}
    whats = {k: v.get("what", "") for k, v in section.items()}
    anatomy = json.loads((ROOT / ANATOMY).read_text())["cases"]
    counted = [cases.case(*k.split(), launches=v["plain"]["kernels"], device_s=v["plain"]["kernel_s"])
               for k, v in anatomy.items()]
    rates, launch_fit = fit_launches(rates, counted)
    for n in LAUNCH_RATES:
        sources[n] = "fitted"
        whats[n] = f"fitted to the counted kernel launches of 12 steps in {ANATOMY} (the executor's code path)"
    notes = {"launches": launch_fit}
    if gpu == "h200":
        # the anatomy has no kernel time by category: the category scales stay at the base
        # section's 1 (every op at device_scale x its roofline price), an assumption
        # kernel time from the anatomy's profiles, wall time from the host file's unprofiled steps
        rates, notes["device"] = fit_rates(rates, counted, TOTAL_DEVICE_RATES, target="device")
        walls = json.loads((ROOT / HOST).read_text())["cases"]
        timed = [cases.case(*k.split(), measured_s=v["host"]["wall_s"]) for k, v in walls.items()]
        rates, notes["host"] = fit_rates(rates, timed, HOST_RATES)
        for n in TOTAL_DEVICE_RATES:
            sources[n], whats[n] = "fitted", f"fitted to the profiled kernel time of 12 steps in {ANATOMY}"
        for n in HOST_RATES:
            sources[n], whats[n] = "fitted", f"fitted to the unprofiled step times of 4 steps in {HOST}"
        truth = []
    else:
        truth = [cases.case(r["instance"], r["kind"], measured_s=r["seconds"])
                 for f in SUITE[gpu] + extra for r in suite_rows(f)]
        cal = [c for c in truth if c.name in calibration]
        rates, notes["step"] = fit_rates(rates, cal, [*TOTAL_DEVICE_RATES, *HOST_RATES])
        for n in [*TOTAL_DEVICE_RATES, *HOST_RATES]:
            sources[n] = "fitted"
            whats[n] = (f"fitted to the step times of the calibration instances {sorted(calibration)} in "
                        + ", ".join(SUITE[gpu]))
    return rates, sources, whats, notes, cases, truth


def chain_cases(path: str, model: str, rates, hw) -> list:
    """The measured steps of a benchmarks/gpu/chains.py file as cases ("chains:<case>",
    the kind as measured), their rollouts rebuilt by chains.py's own `instance`. Steps run
    again with an `--ab` setting (keys ending in FIELD=VALUE) are left out: the cases are
    priced with the default plan and kernels."""
    from dataclasses import replace

    from benchmarks.gpu.chains import instance

    data = json.loads((ROOT / path).read_text() if not Path(path).is_absolute() else Path(path).read_text())
    cfg = get_model_config(model)
    hw = replace(hw, executor=rates)
    out, forests = [], {}
    for key, c in data["cases"].items():
        if "seconds" not in c or "=" in key.split()[-1]:
            continue
        case = key.split()[0]
        if case not in forests:
            forests[case] = build_forest(instance(case, seed=data.get("seed", 0))[0])
        step = step_of(forests[case], c["kind"], c["budget"], cfg.chunk_size)
        out.append(case_of(f"chains:{case}", c["kind"], step, cfg, hw, measured_s=c["seconds"]))
    return out


def fit_from_rows(hw_dict: dict, model: str, calibration: set[str], path: str):
    """`--rows`: the executor section fitted on `path`'s calibration instances, every step
    of the file a case (module docstring)."""
    from harts.bench.sim_measure import fit_profile

    data = json.loads((ROOT / path).read_text() if not Path(path).is_absolute() else Path(path).read_text())
    rows = [r for r in data["rows"] + data.get("calibration_rows", []) if "seconds" in r]
    missing = calibration - {r["instance"] for r in rows}
    if missing:
        raise SystemExit(f"--calibrate instances not in {path}: {', '.join(sorted(missing))}")
    base = {**hw_dict, "executor": json.loads(json.dumps(BASE_EXECUTOR))}
    prof, notes = fit_profile(base, [r for r in rows if r["instance"] in calibration], model,
                              here=f"fitted to the calibration instances {sorted(calibration)} of {path}")
    sources = {k: v["source"] for k, v in prof["executor"].items()}
    whats = {k: v.get("what", "") for k, v in prof["executor"].items()}
    cases = Cases(model, prof)
    truth = [c for r in rows if (c := planned_case(cases, r, path, [])) is not None]
    return executor_rates_from_dict(prof["executor"], {}), sources, whats, notes, cases, truth


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=("h100", "h200"), default="h100")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--calibrate", default=CALIBRATE, help="calibration instances (family/seed@budget, comma-separated)")
    ap.add_argument("--measured", action="append", default=[], help="rows of benchmarks/gpu/sim_calibrate.py (held out)")
    ap.add_argument("--chains", action="append", default=[],
                    help="a benchmarks/gpu/chains.py file: its steps (trajectories longer than the budget, "
                         "swe-treestep-1 windows) predicted and held out")
    ap.add_argument("--rows", help="a sim_calibrate.py file: calibrate on its --calibrate instances, hold out the rest")
    ap.add_argument("--profile", help="predict with this profile's executor rates (e.g. sim_calibrate's "
                    "profile.json) instead of fitting; every --measured row is held out")
    ap.add_argument("--host-s-per-launch", type=float,
                    help="predict with this host rate instead of the profile's (another machine's host)")
    ap.add_argument("--out", help="folder for <date>-<rev>-heldout-<gpu>.json")
    ap.add_argument("--write-profile", help="write the fitted executor section into this hardware profile")
    args = ap.parse_args(argv)
    calibration = set(args.calibrate.split(","))
    hw_dict = json.loads((HARDWARE_DIR / f"{args.gpu}.json").read_text())
    if args.rows:
        rates, sources, whats, notes, cases, truth = fit_from_rows(hw_dict, args.model, calibration, args.rows)
    else:
        rates, sources, whats, notes, cases, truth = fit_profile_rates(args.gpu, hw_dict, args.model, calibration, [])
    if args.profile:
        prof = json.loads(Path(args.profile).read_text())
        rates = executor_rates_from_dict(prof["executor"], {})
        sources = {k: v["source"] for k, v in prof["executor"].items()}
        whats = {k: v.get("what", "") for k, v in prof["executor"].items()}
        cases, truth, calibration = Cases(args.model, prof), [], set()
    if args.host_s_per_launch is not None:
        if not args.profile:
            raise SystemExit("--host-s-per-launch needs --profile (a profile whose other rates are kept)")
        rates = rates.with_values(host_s_per_launch=args.host_s_per_launch)
        sources["host_s_per_launch"] = "assumption"
        whats["host_s_per_launch"] = f"--host-s-per-launch {args.host_s_per_launch:g} (another machine's host)"
    held, stale = [], []
    for f in args.measured:
        held += [c for r in suite_rows(f) if (c := planned_case(cases, r, f, stale)) is not None]
    held += [c for f in args.chains for c in chain_cases(f, args.model, rates, cases.hw)]
    result = {"provenance": provenance(sys.argv if argv is None else [sys.argv[0], *argv]), "gpu": args.gpu,
              "model": args.model, "calibration_instances": sorted(calibration),
              "sources": {"suite": [] if args.profile else [args.rows] if args.rows else SUITE[args.gpu],
                          "measured": args.measured, "chains": args.chains, "launches": args.rows or ANATOMY,
                          "profile": args.profile or f"{args.gpu} (fitted here)"},
              "fit": notes, "rates": executor_rates_to_dict(rates, sources, whats), "skipped_plan_changed": stale,
              **report(rates, truth + held, calibration, {c.name for c in held})}
    for which in ("new", "held-out", "calibration"):
        if not result["ranking"][which]:
            continue
        print(f"{which}:")
        for k, v in result["by_kind"][which].items():
            print(f"  {k:9s} cases {v['cases']:2d}  mean |err| {100 * v['mean_abs_error']:5.1f}%  "
                  f"max |err| {100 * v['max_abs_error']:5.1f}%  within 10% {v['within_10pct']}/{v['cases']}")
        ranks = result["ranking"][which]
        print(f"  ranking matches in {sum(r['match'] for r in ranks.values())}/{len(ranks)} instances "
              + " ".join(f"{k}:{r['wrong_pairs']}" for k, r in ranks.items() if not r["match"]))
    for r in result["rows"]:
        print(f"  {r['set'][:4]} {r['instance']:20s} {r['kind']:9s} mbs {r['microbatches']:3d} "
              f"sim {r['predicted_s']:7.3f} s  measured {r['measured_s']:7.3f} s  {100 * r['error']:+6.1f}%")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rev = result["provenance"]["git_revision"][:7] or "norev"
        tag = ("-calibrated" if args.profile else "-new" if args.measured else "") + (
            f"-host{args.host_s_per_launch * 1e6:.0f}us" if args.host_s_per_launch is not None else "")
        path = out / f"{_dt.date.today().isoformat()}-{rev}-heldout-{args.gpu}{tag}.json"
        path.write_text(json.dumps(result, indent=1, default=float))
        print(f"wrote {path}")
    if args.write_profile:
        prof = json.loads(Path(args.write_profile).read_text())
        prof["executor"] = executor_rates_to_dict(rates, sources, whats)
        Path(args.write_profile).write_text(json.dumps(prof, indent=1, default=float) + "\n")
        print(f"wrote {args.write_profile}")
    return 0


def provenance(argv: list[str]) -> dict:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    return {"git_revision": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain")),
            "command": " ".join(["python", *argv]),
            "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


if __name__ == "__main__":
    sys.exit(main())
