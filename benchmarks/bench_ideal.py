"""CPU: the workload generator's shapes and the simulated ideal per baseline.

    python benchmarks/bench_ideal.py [--model tiny-h200] [--json PATH]

For each workload: trajectories (distinct / copies), the forest's compression, the
prefix-merged baseline's rows, and, one GPU, the whole step as one microbatch on the
simulator's roofline (h200): the ideal speedup over packed and over prefix-merged
(`harts.sim.flops.simulated_ideal`) and the simulator's own speedup, which never exceeds it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harts.config.models import get_model_config  # noqa: E402
from harts.sim.flops import simulated_ideal  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.tree.prefix import duplicate_counts, forest_host_lengths  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402

OLD = {"allow_duplicates": True, "last_turn_branching": True}
WORKLOADS = [
    ("swe-treestep-1", {}), ("swe-treestep-1", OLD),
    ("swe-stepwise-1", {"rollouts_per_group": 1, "max_context": 24576}),
    ("swe-treestep-1", {"branching": 4, "rollouts_per_group": 16, "obs_median": 200.0, "obs_sigma": 0.6,
                        "obs_range": (10, 2000)}),
    ("swe-treestep-64", {}), ("swe-treestep-64", OLD),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    model, hw = get_model_config(args.model), load_hardware("h200")
    rows = []
    for name, over in WORKLOADS:
        f = generate(preset(name, **over)).forest()
        r = {"workload": name, "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in over.items()},
             "trajectories": f.num_trajectories, **duplicate_counts(f), "expanded_tokens": f.expanded_tokens,
             "compact_tokens": f.compact_tokens, "compression": f.compression,
             "prefix_merged_tokens": int(forest_host_lengths(f).sum())}
        for base in ("expanded", "prefix-merged"):
            ideal, sim = simulated_ideal(f, model, hw, baseline=base)
            r[base] = {"ideal": ideal.ideal, "simulated_speedup": sim, "parts": ideal.to_dict()}
        rows.append(r)
        print(f"{name:16s} {json.dumps(r['overrides'])[:60]:60s} trajs {r['trajectories']:4d} "
              f"(copies {r['duplicate_trajectories']:3d}) compression {r['compression']:6.2f}x "
              f"prefix-merged rows {r['prefix_merged_tokens']:>10,} | packed: ideal {r['expanded']['ideal']:6.2f}x "
              f"sim {r['expanded']['simulated_speedup']:6.2f}x | prefix-merged: ideal "
              f"{r['prefix-merged']['ideal']:6.2f}x sim {r['prefix-merged']['simulated_speedup']:6.2f}x", flush=True)
    if args.json:
        from harts.bench.provenance import provenance  # git revision, command, packages, device
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "model": args.model, "hardware": "h200", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
