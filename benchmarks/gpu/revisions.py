"""The single-process tree step's speedup over the expanded step at two source trees of
HARTS, on the same rollouts, in one run (does a change of the code move it?).

    python3 benchmarks/gpu/revisions.py --roots OLD_TREE NEW_TREE [--workload swe-treestep-1]
        [--model tiny-h200] [--budget 131072] [--steps 2] [--no-autotune] --out DIR

A root is a directory holding a `harts/` package (`git archive REV harts | tar -x -C DIR`).
The rollouts are generated once, by the current tree's generator, and written as rollout
JSONL; each root then runs in its own process (PYTHONPATH=root) through the API both
trees share: `build_model(..., dtype=bf16, recompute=True)`, `TreeTrainer` and
`ExpandedTrainer`, `prepare` + `step`, `--warmup` steps and then the median of `--steps`,
each timed with a device synchronisation. Each root's run is also repeated with its order
reversed (expanded first) when `--both-orders` is given. Writes DIR/revisions.json with
provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> int:
    import torch

    import harts
    from harts.config.models import get_model_config
    from harts.exec.model.model import build_model
    from harts.exec.trainer import ExpandedTrainer
    from harts.exec.tree_trainer import TreeTrainer
    from harts.tree.io import load_jsonl

    if args.no_autotune:
        import triton.runtime.autotuner as autotuner

        autotuner.Autotuner._bench = lambda self, *a, **kw: [0.0, 0.0, 0.0]
    trajs = load_jsonl(args.input)
    cfg = get_model_config(args.model)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync():
        if cuda:
            torch.cuda.synchronize()

    out = {"harts_file": harts.__file__, "modes": {}}
    for mode in args.modes.split(","):
        net = build_model(cfg, seed=0, dtype=dtype, device=args.device, recompute=True)
        trainer = TreeTrainer(net) if mode == "tree" else ExpandedTrainer(net)
        for _ in range(args.warmup):
            trainer.step(trajs, args.budget)
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            prepared = trainer.prepare(trajs, args.budget)
            sync()
            t0 = time.perf_counter()
            res = trainer.step(trajs, args.budget, prepared=prepared)
            sync()
            times.append(time.perf_counter() - t0)
        out["modes"][mode] = {"seconds": statistics.median(times), "all_seconds": times,
                              "peak_bytes": int(torch.cuda.max_memory_allocated()) if cuda else 0, "loss": res.losses["loss"],
                              "microbatches": len(res.microbatches)}
        del trainer, net, prepared, res
        if cuda:
            torch.cuda.empty_cache()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--roots", nargs="+", help="source trees, each holding harts/")
    ap.add_argument("--workload", default="swe-treestep-1")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--budget", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs float32 (a smoke run of the script)")
    ap.add_argument("--both-orders", action="store_true", help="also run each root with expanded first")
    ap.add_argument("--out", default=".")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="tree,expanded", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    from harts.bench.provenance import provenance
    from harts.config.models import get_model_config
    from harts.tree.io import save_jsonl
    from harts.tree.workload import generate, preset

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = min(32768, get_model_config(args.model).vocab_size)
    trajs = generate(preset(args.workload, vocab_size=vocab)).trajectories()
    rollouts = out_dir / "rollouts.jsonl"
    save_jsonl(trajs, rollouts)
    result = {"provenance": provenance([sys.argv[0], *argv]), "workload": args.workload, "model": args.model,
              "budget": args.budget, "trajectories": len(trajs), "runs": []}
    orders = ["tree,expanded"] + (["expanded,tree"] if args.both_orders else [])
    for order in orders:
        for root in args.roots:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(root).resolve()),
                                                                 *filter(None, [os.environ.get("PYTHONPATH")])])}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--input", str(rollouts),
                   "--model", args.model, "--budget", str(args.budget), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--modes", order, "--device", args.device] + (["--no-autotune"] if args.no_autotune else [])
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(Path(root).resolve()))
            run = {"root": str(root), "order": order, "rc": proc.returncode, "wall_s": time.perf_counter() - t0}
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                run["error"] = (proc.stderr or proc.stdout)[-3000:]
                print(f"[{root} {order}] ERROR\n{run['error']}", flush=True)
            else:
                run.update(json.loads(line[len("RESULT "):]))
                m = run["modes"]
                run["speedup"] = m["expanded"]["seconds"] / m["tree"]["seconds"]
                print(f"[{root} {order}] tree {m['tree']['seconds']:.3f}s expanded {m['expanded']['seconds']:.3f}s "
                      f"speedup {run['speedup']:.3f}x ({run['harts_file']})", flush=True)
            result["runs"].append(run)
            (out_dir / "revisions.json").write_text(json.dumps(result, indent=1, default=str))
    rollouts.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
