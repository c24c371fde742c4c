"""The update step, tree against expanded: one RL update (forward, backward, optimizer) of
tiny-h200 on a generated SWE workload, timed both ways on one GPU (bf16, recompute).

    python3 benchmarks/gpu/step.py [step] [--schemes treestep stepwise] [--steps 5] [--out DIR]

Reports the speedup (expanded seconds / tree seconds, data side prepared one step ahead),
the ideal speedup (the expanded step's profiled kernel time by work kind, scaled by each
kind's work ratio: harts.sim.flops.ideal_speedup), the FLOP and token ratios of the layout,
both peaks and seconds. The prefix-merged baseline is benchmarks/gpu/baselines.py's. Kernel
choices: `--tree-attention`, `--baseline-attention`, `--conv`, `--fwd-h` (the library's
defaults when left out).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:  # run as a script: this folder would
    sys.path[0] = _ROOT  # the repository root, not this folder, first on the path
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.gpu.common import Section, add_kernel_args, run_suite  # noqa: E402
from harts.bench.step import step_benchmark  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402

STEP_WORKLOADS = {
    # the generator's SWE calibration, one prompt group (one GPU)
    "treestep": ("swe-treestep-1", {}),
    # stepwise at full SWE shape is 8.6M expanded tokens: too long an expanded step for one
    # GPU; 1 rollout at a 24k context cap (385k expanded tokens) keeps a stepwise group's shape
    "stepwise": ("swe-stepwise-1", {"rollouts_per_group": 1, "max_context": 24576}),
}


def add_step_args(ap) -> None:
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--schemes", nargs="+", default=["treestep", "stepwise"], choices=sorted(STEP_WORKLOADS))
    ap.add_argument("--microbatch-tokens", type=int, default=131072)
    add_kernel_args(ap, "tree_attention", "baseline_attention", "conv", "fwd_h")


def workload(args, scheme: str):
    name, over = STEP_WORKLOADS[scheme]
    vocab = get_model_config(args.model).vocab_size
    return name, over, generate(preset(name, vocab_size=vocab, **over)).trajectories()


def sec_step(args):
    runs = []
    for scheme in args.schemes:
        name, over, trajs = workload(args, scheme)
        r = step_benchmark(trajs, model=args.model, microbatch_tokens=args.microbatch_tokens,
                           steps=args.steps, warmup=1, kernels=args.kernels)
        r.update(scheme=scheme, workload=name, overrides=over, kernel_config=args.kernels.to_dict())
        runs.append(r)
        print(f"[step] {scheme}: speedup {r.get('speedup'):.2f}x ideal {r['ideal']:.2f}x "
              f"(tokens {r['token_ratio']:.2f}x, FLOPs {r['flop_ratio']:.2f}x) exp {r['expanded']['seconds']:.2f}s "
              f"tree {r['tree']['seconds']:.2f}s peak exp {r['expanded_peak_bytes'] / 2**30:.1f} GiB "
              f"tree {r['tree_peak_bytes'] / 2**30:.1f} GiB", flush=True)
    return runs


def summary(runs):
    return [(r["scheme"], f"{r['speedup']:.3f}x (ideal {r['ideal']:.3f}x, {r['of_ideal']:.3f} of it); "
             f"expanded {r['expanded']['seconds']:.3f} s, tree {r['tree']['seconds']:.3f} s") for r in runs]


SECTIONS = [Section("step", sec_step, "tree vs expanded update step per scheme (speedup, ideal, ratios, peaks)", summary)]


def add_args(ap) -> None:
    add_step_args(ap)
    ap.add_argument("--steps", type=int, default=5, help="timed steps each way (median)")


if __name__ == "__main__":
    sys.exit(run_suite("step", SECTIONS, __doc__, add_args))
