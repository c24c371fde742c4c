"""CPU benchmark: one full update step (forward, backward, AdamW) in tree vs expanded mode.

    python benchmarks/bench_tree_step.py [--json] [--repeats 3]

tiny-cpu model, float32, the same trajectories and token budget for both modes, best of
`--repeats` steps each (timings on a shared 2-core machine are noisy; the ratio within
one run is what to read). Reported next to the work ratios (summaries of work, not bounds):
`compression` = expanded / compact tokens, and `token_ratio` = expanded / (compact +
KDA replay) tokens, the executed-token ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from harts.exec.factory import make_trainer
from harts.exec.model.model import build_model
from harts.tree.workload import generate, preset

WORKLOADS = {
    # scaled-down SWE shapes that a 2-core CPU steps through in seconds
    "stepwise": ("small-stepwise", dict(num_groups=1, rollouts_per_group=2, turns_median=10.0, seed=1)),
    "treestep": ("small-treestep", dict(num_groups=2, seed=1)),
}


def bench(scheme: str, repeats: int, budget: int) -> dict:
    name, over = WORKLOADS[scheme]
    trajs = generate(preset(name, vocab_size=512, **over)).trajectories()
    times = {}
    results = {}
    for mode in ("expanded", "tree"):
        trainer = make_trainer(mode, build_model("tiny-cpu", seed=0))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = trainer.step(trajs, budget)
            best = min(best, time.perf_counter() - t0)
        times[mode] = best
        results[mode] = res
    tree = results["tree"]
    expanded_tokens = tree.tokens
    compact = tree.executed_rows
    replay = sum(m["replay_tokens"] for m in tree.layout)
    return {
        "scheme": scheme,
        "workload": f"{name} {over}",
        "trajectories": len(trajs),
        "expanded_tokens": expanded_tokens,
        "compact_tokens": compact,
        "replay_tokens": replay,
        "compression": expanded_tokens / compact,
        "token_ratio": expanded_tokens / (compact + replay),
        "expanded_seconds": times["expanded"],
        "tree_seconds": times["tree"],
        "speedup": times["expanded"] / times["tree"],
        "kda_rounds": max(m["kda_rounds"] for m in tree.layout),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--microbatch-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [bench(s, args.repeats, args.microbatch_tokens) for s in WORKLOADS]
    if args.json:
        from harts.bench.provenance import provenance  # git revision, command, packages, device
        print(json.dumps({"provenance": provenance(), "rows": rows}, indent=2))
        return
    print(f"{'scheme':9} {'expanded':>9} {'compact':>8} {'replay':>7} {'compress':>9} {'flop lim':>9} "
          f"{'exp s':>7} {'tree s':>7} {'speedup':>8}")
    for r in rows:
        print(f"{r['scheme']:9} {r['expanded_tokens']:9d} {r['compact_tokens']:8d} {r['replay_tokens']:7d} "
              f"{r['compression']:8.2f}x {r['token_ratio']:8.2f}x {r['expanded_seconds']:7.2f} "
              f"{r['tree_seconds']:7.2f} {r['speedup']:7.2f}x")


if __name__ == "__main__":
    main()
