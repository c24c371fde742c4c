"""The compiled regions (`KernelConfig.compile`) against eager, in one process on one GPU.

    python3 benchmarks/gpu/compile_ab.py [--cases grpo/2@16384,fanout/2@8192] [--kinds windows,tree]
        [--backend inductor] [--steps 3] [--no-autotune] [--device cuda] [--model tiny-h200] --out DIR

Per case (`family/seed@budget`, drawn by `harts.tree.shapes.draw`) and kind (`windows`: the
l1l2 plan at the budget; `windows-resident`: the same plan with the producers' saved
tensors left on the device; `windows-stored`: the same plan with the producers' blocks not
checkpointed, everything they save held in host memory; `tree`: the same rows unsplit,
budget 131072; `expanded`: the expanded baseline at the budget), each on a fresh model from the same seed
(benchmarks/gpu/windows.py's trainers), first eager and then with `--backend`: the first
step timed on its own (it compiles), then the median of `--steps` prepared steps, the
launches of one prepared step (torch.profiler: kernels, memsets and copies), the peak
allocated memory, and the loss and gradient norm of the first step (the same weights, so
the two settings' are comparable). Derived per case: wall and launches compiled / eager.
Eager runs first in each pair, so the compiled regions are never warm for it.

`--device cpu` runs float32 on the CPU (a smoke run of the script; `--backend aot_eager`
needs no compiler). Writes DIR/compile_ab.json with provenance; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import windows as W  # noqa: E402  (benchmarks/gpu/windows.py: trainers, provenance)


def launches(trainer, trajs, budget: int) -> int | None:
    """Device activities (kernels, memsets, copies) of one prepared step; None off CUDA."""
    if W.DEVICE != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    prepared = trainer.prepare(trajs, budget)
    W._sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.step(trajs, budget, prepared=prepared)
        W._sync()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def run(kind: str, trajs, budget: int, kernels, args) -> dict:
    trainer, _ = W._trainer(kind, trajs, budget, args.model, kernels=kernels)
    W._sync()
    t0 = time.perf_counter()
    first = trainer.step(trajs, budget)
    W._sync()
    first_s = time.perf_counter() - t0
    if W.DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, _ = W.prepared_steps(trainer, trajs, budget, args.steps)
    out = {"compile": str(kernels.compile), "first_step_s": first_s, "seconds": statistics.median(times),
           "all_seconds": times, "peak_bytes": int(W._mem("max_memory_allocated")),
           "launches": launches(trainer, trajs, budget), "loss": first.losses["loss"],
           "grad_norm": first.grad_norm, "microbatches": len(first.microbatches)}
    del trainer, first
    W._free()
    return out


def main(argv: list[str]) -> int:
    from harts.config.kernels import KernelConfig
    from harts.config.models import get_model_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--cases", default="grpo/2@16384,fanout/2@8192")
    ap.add_argument("--kinds", default="windows,tree")
    ap.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--unsplit-budget", type=int, default=131072)
    W.add_run_args(ap)
    args = ap.parse_args(argv)
    W.start_run(args)
    base = KernelConfig.from_env(compile="off")
    vocab = min(W.VOCAB, get_model_config(args.model).vocab_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"provenance": W.provenance([sys.argv[0], *argv]), "model": args.model, "backend": args.backend,
              "kernels": base.to_dict(), "cases": {}, "skipped": []}
    t_start = time.perf_counter()
    for key, kind, trajs, b in W.case_runs(args, vocab, result["skipped"]):
        try:
            eager = run(kind, trajs, b, base, args)
            comp = run(kind, trajs, b, base.replace(compile=args.backend), args)
        except Exception as exc:  # noqa: BLE001 - a case that fails is recorded; the others still run
            result["cases"][key] = W.case_error(exc)
            print(f"[{key}] failed: {exc!r}", flush=True)
            continue
        r = {"eager": eager, "compiled": comp, "wall_ratio": comp["seconds"] / eager["seconds"],
             "launch_ratio": (comp["launches"] / eager["launches"]) if eager["launches"] else None,
             "loss_rel_diff": abs(comp["loss"] - eager["loss"]) / max(abs(eager["loss"]), 1e-30),
             "grad_norm_rel_diff": abs(comp["grad_norm"] - eager["grad_norm"]) / max(eager["grad_norm"], 1e-30)}
        result["cases"][key] = r
        lr = f"{r['launch_ratio']:.3f}" if r["launch_ratio"] is not None else "-"
        print(f"[{key}] wall {eager['seconds']:.3f}s -> {comp['seconds']:.3f}s ({r['wall_ratio']:.3f}x), "
              f"launches {eager['launches']} -> {comp['launches']} ({lr}), first step "
              f"{eager['first_step_s']:.1f}s -> {comp['first_step_s']:.1f}s, peak "
              f"{eager['peak_bytes'] / 2**30:.2f} -> {comp['peak_bytes'] / 2**30:.2f} GiB, loss rel diff "
              f"{r['loss_rel_diff']:.1e}", flush=True)
        (out / "compile_ab.json").write_text(json.dumps(result, indent=1, default=str))
    result["seconds_total"] = time.perf_counter() - t_start
    (out / "compile_ab.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
