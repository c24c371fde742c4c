"""The tree step against the baselines a user would pick: one RL update of tiny-h200 timed
in tree mode, in packed expanded mode and in prefix-merged expanded mode (a sequence that
is a prefix of another runs inside it), on four shapes, each with the ideal speedup per
baseline (the baseline's profiled kernel time by work kind, scaled by each kind's work
ratio: `harts.sim.flops.ideal_speedup`).

    python3 benchmarks/gpu/baselines.py [treestep] [stepwise] [grpo] [bushy] [--steps 3] [--out DIR]

Sections (one JSON each, with provenance):
- treestep: swe-treestep-1 (the generator's SWE tree-step calibration, no copies);
- stepwise: swe-stepwise-1, one rollout at a 24k context cap (nested prefixes: what
  prefix merging removes);
- grpo: a plain GRPO group, one 6,144-token prompt shared by 16 responses;
- bushy: a branching-4 tree of 16 leaves with turns of a few hundred tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:  # run as a script: this folder would
    sys.path[0] = _ROOT  # the repository root, not this folder, first on the path
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

from benchmarks.gpu.common import Section, add_kernel_args, run_suite  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.tree.trajectory import Trajectory  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402

# name -> (preset, overrides); "grpo" is built by `grpo_group`
WORKLOADS: dict[str, tuple[str, dict]] = {
    "treestep": ("swe-treestep-1", {}),
    "stepwise": ("swe-stepwise-1", {"rollouts_per_group": 1, "max_context": 24576}),
    "grpo": ("grpo-group", {"prompt_tokens": 6144, "responses": 16, "response_median": 1000}),
    # turns of a few hundred tokens: actions ~160, observations ~200 (lighter tail)
    "bushy": ("swe-treestep-1", {"branching": 4, "rollouts_per_group": 16, "obs_median": 200.0,
                                 "obs_sigma": 0.6, "obs_range": (10, 2000)}),
}


def grpo_group(vocab_size: int, prompt_tokens: int = 6144, responses: int = 16, response_median: float = 1000,
               response_sigma: float = 0.5, response_range: tuple[int, int] = (64, 4096), seed: int = 0
               ) -> list[Trajectory]:
    """One prompt sampled `responses` times: each trajectory is the shared prompt (not
    trained) plus its own response (trained, lognormal length), distinct first tokens."""
    rng = np.random.default_rng([seed, 7])
    prompt = rng.integers(0, vocab_size, prompt_tokens)
    out = []
    for i in range(responses):
        n = int(np.clip(round(response_median * np.exp(response_sigma * rng.normal())), *response_range))
        resp = rng.integers(0, vocab_size, n)
        resp[0] = i % vocab_size
        tokens = np.concatenate([prompt, resp])
        mask = np.zeros(tokens.size, bool)
        mask[prompt_tokens:] = True
        old = np.where(mask, -rng.exponential(1.0, tokens.size), 0.0)
        out.append(Trajectory.make(f"grpo/r{i}", "grpo", tokens, mask, float(rng.normal()), old))
    return out


def workload(name: str, vocab_size: int) -> list[Trajectory]:
    base, over = WORKLOADS[name]
    if base == "grpo-group":
        return grpo_group(vocab_size, **over)
    return generate(preset(base, vocab_size=vocab_size, **over)).trajectories()


def _section(name: str):
    def run(args):
        from harts.bench.step import step_benchmark

        trajs = workload(name, get_model_config(args.model).vocab_size)
        r = step_benchmark(trajs, model=args.model, microbatch_tokens=args.microbatch_tokens, steps=args.steps,
                           warmup=1, kernels=args.kernels, baselines=("packed", "prefix-merged"))
        r.update(workload=name, definition=WORKLOADS[name], kernel_config=args.kernels.to_dict())
        for b, v in r["baselines"].items():
            print(f"[baselines] {name}: over {b} {v['speedup']:.2f}x, ideal {v['ideal']:.2f}x, "
                  f"{v['of_ideal']:.3f} of it", flush=True)
        return r
    return run


def summary(r):
    return [(b, f"{v['speedup']:.3f}x (ideal {v['ideal']:.3f}x, {v['of_ideal']:.3f} of it; token ratio "
                f"{v['token_ratio']:.2f}x)") for b, v in r["baselines"].items()]


SECTIONS = [Section(n, _section(n), f"tree vs packed and prefix-merged on {n} ({WORKLOADS[n][0]})", summary)
            for n in WORKLOADS]


def add_args(ap) -> None:
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--microbatch-tokens", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (median)")
    add_kernel_args(ap, "tree_attention", "baseline_attention", "conv", "fwd_h")


if __name__ == "__main__":
    sys.exit(run_suite("baselines", SECTIONS, __doc__, add_args))
