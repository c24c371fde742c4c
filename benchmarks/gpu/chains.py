"""Trajectories longer than the microbatch budget on the GPU: chains of windows against the
same rows unsplit and against ordinary trajectories at the same budget.

    python3 benchmarks/gpu/chains.py [--cases swe32k,swe16k,single131k,tree131k,chain64k]
        [--steps 2] [--no-autotune] [--ab FIELD=VALUE] [--memtrace] --out DIR

Cases (tiny-h200, bf16, activation recomputation, benchmarks/gpu/windows.py's trainers and
`run_case`: the median of `--steps` prepared steps after a warm-up, peak allocated memory):

- `swe32k`, `swe16k`: the generator's swe-treestep-1 (longest trajectory 51,460 tokens) as
  the l1l2 plan at 32,768 and 16,384 (chains where a path is longer than the budget);
- `single131k`: one 131,072-token trajectory, the l1l2 plan at 32,768 (a chain of pieces),
  beside `ordinary32k`: four trajectories of 32,000 tokens in the expanded step at 32,768
  (what a 32k-budget step of ordinary trajectories holds);
- `tree131k`: a 16,384-token prompt with three responses of 2-8k and one that runs on to
  131,072 tokens, the l1l2 plan at 32,768;
- `forks131k`: one 131,072-token trajectory with four branches of 2-8k tokens leaving it
  at positions drawn past the first 8k (forks inside later pieces of the chain, on or
  near its cuts by chance), the l1l2 plan at 32,768;
- `chain64k`: one 65,536-token trajectory, unsplit (one microbatch, budget 131,072) and the
  l1l2 plan at 16,384.

Other lengths by name: `single<N>k` (one N x 1,024-token trajectory, l1l2 at 32,768),
`chain<N>k` (one N x 1,024-token trajectory, unsplit and l1l2 at 16,384) and
`ordinary16k` (four 16,000-token trajectories, the expanded step at 16,384). A benchmark
family's instance by name, `family/seed@budget` (`harts.tree.shapes.draw`; `--seed` adds to
its seed): unsplit, the l1l2 plan with this GPU's microbatch floors (`windows-floored`, the
plan `harts train` makes) and the expanded step, all three at the budget but the unsplit.

`--seed` draws other tokens, response lengths and fork positions (the swe-treestep-1
preset is fixed). Derived: each chained case's peak over the ordinary step of its budget
(`ordinary32k` or `ordinary16k`, where it ran; total allocated, and activations above the
weights and optimizer state), and each `chain...` case's chained step over its unsplit step.
`--ab FIELD=VALUE` runs every chained (windows) case twice in the same process, without
and then with that `KernelConfig` setting (say `rectangle_triangles_min_rows=0`: the causal
squares off) or `PlanConfig` field of the window plan (say `producer_retention=0.2`: larger
chain pieces, fewer microbatches, more memory a piece; the expanded step's plan takes it
too, its long trajectories being chains of the same pieces), so a setting is compared on
one machine and one warm process, time and peak. A family instance's derived figures: its
floored window step over the unsplit step and its window peak over the expanded step's,
each with and without the setting.
Writes DIR/chains.json with provenance.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import windows as W  # noqa: E402  (benchmarks/gpu/windows.py: trainers, run_case, provenance)

CASES = ("swe32k", "swe16k", "ordinary32k", "single131k", "tree131k", "chain64k", "forks131k")


def _traj(name: str, group: str, tokens: np.ndarray, rng: np.random.Generator):
    from harts.tree.trajectory import Trajectory

    mask = rng.random(len(tokens)) < 0.9
    mask[0] = False
    return Trajectory.make(name, group, tokens, loss_mask=mask, advantage=float(rng.normal()),
                           old_logprobs=rng.normal(-2, 0.5, len(tokens)), ref_logprobs=rng.normal(-2, 0.5, len(tokens)))


def instance(case: str, seed: int = 0, scale: int = 1):
    """(trajectories, [(kind, budget), ...]) of a case; `scale` divides lengths and budgets
    (not the swe-treestep-1 preset's)."""
    trajs, runs = _instance(case, seed, scale)
    return trajs, [(kind, budget // scale) for kind, budget in runs]


def _instance(case: str, seed: int, scale: int):
    # the named cases keep their streams; other lengths draw from one keyed by the name
    rng = np.random.default_rng([seed, CASES.index(case) if case in CASES else zlib.crc32(case.encode())])

    def _tokens(rng, n: int) -> np.ndarray:
        return rng.integers(1, W.VOCAB, n // scale)

    if case in ("swe32k", "swe16k"):
        from harts.tree.workload import generate_trajectories

        return generate_trajectories("swe-treestep-1", vocab_size=W.VOCAB), [("windows", 32768 if case == "swe32k" else 16384)]
    if case == "ordinary32k":
        return [_traj(f"o{i}", f"o{i}", _tokens(rng, 32000), rng) for i in range(4)], [("expanded", 32768)]
    if case == "single131k":
        return [_traj("long", "g", _tokens(rng, 131072), rng)], [("windows", 32768)]
    if case == "tree131k":
        prompt = _tokens(rng, 16384)
        trajs = [_traj(f"r{i}", "g", np.concatenate([prompt, _tokens(rng, int(rng.integers(2048, 8192)))]), rng)
                 for i in range(3)]
        trajs.append(_traj("long", "g", np.concatenate([prompt, _tokens(rng, 131072 - 16384)]), rng))
        return trajs, [("windows", 32768)]
    if case == "forks131k":
        trunk = _tokens(rng, 131072)
        trajs = [_traj("long", "g", trunk, rng)]
        for i, at in enumerate(sorted(rng.integers(8192 // scale, len(trunk) - 1024 // scale, 4))):
            branch = _tokens(rng, int(rng.integers(2048, 8192)))  # divided by `scale` in _tokens
            trajs.append(_traj(f"b{i}", "g", np.concatenate([trunk[:at], branch]), rng))
        return trajs, [("windows", 32768)]
    if case == "ordinary16k":
        return [_traj(f"o{i}", f"o{i}", _tokens(rng, 16000), rng) for i in range(4)], [("expanded", 16384)]
    if m := re.fullmatch(r"([a-z-]+)/(\d+)@(\d+)", case):  # a benchmark family's instance
        from harts.tree import build_forest, shapes

        budget = int(m.group(3))
        trajs = shapes.draw(m.group(1), int(m.group(2)) + seed, budget // scale, vocab_size=W.VOCAB)
        rows = build_forest(trajs).compact_tokens
        return trajs, [("tree", max(131072, rows * scale)), ("windows-floored", budget), ("expanded", budget)]
    if m := re.fullmatch(r"(single|chain)(\d+)k", case):
        n = int(m.group(2)) * 1024
        trajs = [_traj("long", "g", _tokens(rng, n), rng)]
        return trajs, ([("windows", 32768)] if m.group(1) == "single" else [("tree", max(131072, n)), ("windows", 16384)])
    raise KeyError(f"unknown case {case!r}: one of {', '.join(CASES)}, ordinary16k, single<N>k, chain<N>k")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--seed", type=int, default=0, help="draw other instances of the drawn cases")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu with --scale is a smoke run of the script")
    ap.add_argument("--scale", type=int, default=1, help="divide every length and budget by this (smoke runs)")
    ap.add_argument("--ab", default="",
                    help="FIELD=VALUE of harts.config.KernelConfig or of the window plan's PlanConfig: every "
                         "chained (windows) run again with it, right after the run without it, in this process "
                         "(e.g. rectangle_triangles_min_rows=0, producer_retention=0.2)")
    ap.add_argument("--memtrace", action="store_true",
                    help="after each chained (windows) case, one step under CUDA memory history "
                         "(windows.memtrace_case: marks per microbatch, live allocations at the peak by call site)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    import dataclasses

    from harts.config.kernels import KernelConfig
    from harts.config.plan import PlanConfig

    ab = None  # run_case's keyword arguments of the second run: kernels= or plan_config=
    if args.ab:
        field, _, value = args.ab.partition("=")
        try:
            if field in {f.name for f in dataclasses.fields(PlanConfig)} - {"microbatch_tokens", "chunk_size"}:
                kind_of = type(getattr(PlanConfig(), field))
                kind_of = float if kind_of is type(None) else kind_of  # an optional number
                fields = {field: None if value.lower() == "none" else
                          value.lower() in ("1", "true") if kind_of is bool else kind_of(value)}
                PlanConfig(**fields)  # refused here if out of range
                ab = {"plan_config": fields}
            else:
                default = getattr(KernelConfig(), field, None)
                typed = type(default)(value) if type(default) in (int, float) else value
                ab = {"kernels": KernelConfig.from_env(**{field: typed})}
        except (TypeError, ValueError) as err:
            ap.error(f"--ab {args.ab}: {err}")
    if args.memtrace and args.device != "cuda":
        ap.error("--memtrace needs --device cuda (torch.cuda memory history)")
    if args.no_autotune:
        from common import no_autotune

        no_autotune()
    W.DEVICE = args.device
    from harts.config.models import get_model_config

    W.VOCAB = min(W.VOCAB, get_model_config(args.model).vocab_size)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"provenance": W.provenance(sys.argv), "model": args.model, "seed": args.seed, "cases": {},
                    "derived": {}}
    t_start = time.perf_counter()

    def save():
        result["seconds_total"] = time.perf_counter() - t_start
        (out_dir / "chains.json").write_text(json.dumps(result, indent=1, default=str))

    for case in args.cases.split(","):
        trajs, runs = instance(case, seed=args.seed, scale=args.scale)
        runs = [(kind, budget, None) for kind, budget in runs]
        if ab is not None:
            # the chained kinds again with the setting; the expanded baseline too where it is a
            # plan's field (its long trajectories are chains of the same pieces)
            again = ("windows", "windows-floored") + (("expanded",) if "plan_config" in ab else ())
            runs = [r for kind, budget, _ in runs
                    for r in ([(kind, budget, None), (kind, budget, ab)] if kind in again else [(kind, budget, None)])]
        for kind, budget, setting in runs:
            key = f"{case} {kind}@{budget}" + (f" {args.ab}" if setting is not None else "")
            try:
                row = W.run_case(kind, trajs, budget, args, **(setting or {}))
                row.pop("roles", None)
                result["cases"][key] = row
                print(f"[{key}] {row['seconds']:.3f}s peak {row['peak_bytes'] / 2**30:.2f} GiB "
                      f"(activations {row['activation_peak_bytes'] / 2**30:.2f}) mbs {row['microbatches']}", flush=True)
            except Exception as err:  # a case that fails is recorded, the others run
                result["cases"][key] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
                print(f"[{key}] FAILED {type(err).__name__}: {err}", flush=True)
            if args.memtrace and kind == "windows" and setting is None:
                try:
                    m = W.memtrace_case(kind, trajs, budget, args)
                    result.setdefault("memtrace", {})[key] = m
                    W.print_memtrace(key, m, top=10)
                except Exception as err:  # noqa: BLE001 - record and go on
                    result.setdefault("memtrace", {})[key] = {"error": f"{type(err).__name__}: {err}"}
                    print(f"[{key}] memtrace FAILED {type(err).__name__}: {err}", flush=True)
            save()
    c = result["cases"]

    def of(case: str, kind: str, ab: bool = False) -> dict:
        return next((v for k, v in c.items() if k.startswith(f"{case} {kind}@") and "seconds" in v
                     and k.endswith(f" {args.ab}") == (ab and bool(args.ab))), {})

    cases = args.cases.split(",")
    settings = (False, True) if args.ab else (False,)
    for case in cases:
        if case.startswith(("ordinary", "swe")):
            continue
        if "/" in case:  # a family instance
            b = of(case, "tree")
            for with_ab in settings:
                name = f"{case} {args.ab}" if with_ab else case
                w, e = of(case, "windows-floored", ab=with_ab), of(case, "expanded", ab=with_ab)
                if w and b:
                    result["derived"][f"{name} floored / unsplit"] = w["seconds"] / b["seconds"]
                if w and e.get("peak_bytes"):
                    result["derived"][f"{name} floored peak / expanded"] = w["peak_bytes"] / e["peak_bytes"]
            continue
        # a chained case against the ordinary step of its budget, where it ran
        budget = next((b for k, b in instance(case, seed=args.seed, scale=args.scale)[1] if k == "windows"), None)
        ref = {32768 // args.scale: "ordinary32k", 16384 // args.scale: "ordinary16k"}.get(budget)
        base = of(ref, "expanded") if ref else {}
        for with_ab in settings:
            row = of(case, "windows", ab=with_ab)
            name = f"{case} {args.ab}" if with_ab else case
            if row and base.get("peak_bytes"):
                result["derived"][f"{name} peak / {ref}"] = row["peak_bytes"] / base["peak_bytes"]
                result["derived"][f"{name} activation peak / {ref}"] = (
                    row["activation_peak_bytes"] / base["activation_peak_bytes"])
        if case.startswith("chain") and (b := of(case, "tree")):
            for with_ab in settings:
                if a := of(case, "windows", ab=with_ab):
                    name = f"{case} chained@16k {args.ab}" if with_ab else f"{case} chained@16k"
                    result["derived"][f"{name} / unsplit"] = a["seconds"] / b["seconds"]
    print(json.dumps(result["derived"], indent=1))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
