"""Check that two revisions train bitwise alike: the same step records and the same
weights after the last step, for every layout and mesh.

    python scripts/compare_revisions.py REV_A REV_B [--dtypes float64,float32] [--steps 2]
                                        [--cases tree,dp2,...] [--json]

Each revision is checked out into a temporary git worktree and run through its own
command line (`python -m harts train`, under `torch.distributed.run` for the meshes), so
the check needs nothing of either revision's Python API and holds across moves and
renames. Every run: the same rollouts (tiny-stepwise, written by REV_A), one CPU thread
(`OMP_NUM_THREADS=1`, `HARTS_THREADS=1`), `torch.use_deterministic_algorithms(True)` in
every process (a `sitecustomize` on the path), no CUDA device, a checkpoint after the last
step. Compared per case and dtype:

- every number of every step record (`--json`), wall-clock fields (`seconds`,
  `tokens_per_s`) left out: losses, gradient norm, entropy, KL, token and row counts;
- every tensor of the last step's checkpoint (weights and optimizer state, read with
  `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`), with `torch.equal`
  and dtype: two steps' updates carry every gradient of the first step into the weights.

Exit status 0 when every case is bitwise equal, 1 otherwise (the table names what
differs and by how much).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPE = ["--schedule", "consumer-1f1b", "--old-logprobs", "input"]
# name: (processes, harts train arguments)
CASES: dict[str, tuple[int, list[str]]] = {
    "expanded": (1, ["--mode", "expanded"]),
    "tree": (1, ["--mode", "tree"]),
    "windows": (1, ["--mode", "tree", "--planner", "l1l2", "--microbatch-tokens", "256"]),
    "dp2": (2, ["--mode", "tree", "--parallel", "dp=2"]),
    "dp2ep2": (2, ["--mode", "tree", "--parallel", "dp=2,ep=2"]),
    "tp2": (2, ["--mode", "tree", "--parallel", "tp=2"]),
    "dp2tp2": (4, ["--mode", "tree", "--parallel", "dp=2,tp=2"]),
    "pp2": (2, ["--mode", "tree", "--parallel", "pp=2", *PIPE]),
    "dp2pp2": (4, ["--mode", "tree", "--parallel", "dp=2,pp=2", *PIPE]),
}
WALL_CLOCK = ("seconds", "tokens_per_s")
SITECUSTOMIZE = "import torch\ntorch.use_deterministic_algorithms(True)\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tree: Path, site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(tree)]), OMP_NUM_THREADS="1", HARTS_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _last_json(text: str) -> dict:
    """The last JSON object printed (torchrun interleaves nothing else on rank 0's stdout,
    but a revision may print a line before it)."""
    start = text.rfind("\n{")
    start = 0 if start < 0 and text.startswith("{") else start + 1
    return json.loads(text[start:])


def _run(tree: Path, site: Path, work: Path, procs: int, args: list[str], dtype: str, steps: int,
         rollouts: Path) -> tuple[list[dict], dict]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    work.mkdir(parents=True)
    shutil.copy(rollouts, work / "rollouts.jsonl")
    train = ["train", "--input", "rollouts.jsonl", "--steps", str(steps), "--dtype", dtype, "--json",
             "--checkpoint-dir", "ckpt", "--checkpoint-every", str(steps), *args]
    if procs == 1:
        cmd = [sys.executable, "-m", "harts", *train]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
               "--master-port", str(_free_port()), "-m", "harts", *train]
    res = subprocess.run(cmd, cwd=work, env=_env(tree, site), capture_output=True, text=True, timeout=1200)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}")
    records = [{k: v for k, v in step.items() if k not in WALL_CLOCK} for step in _last_json(res.stdout)["steps"]]
    (last,) = [d for d in (work / "ckpt").iterdir() if d.name == f"step-{steps:06d}"]
    dcp_to_torch_save(last, work / "state.pt")
    state = torch.load(work / "state.pt", weights_only=False)
    return records, _flatten(state)


def _flatten(obj, prefix: str = "") -> dict:
    import torch

    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix.rstrip(".")] = obj
    return out


def _compare(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> dict:
    import torch

    (rec_a, ten_a), (rec_b, ten_b) = a, b
    numbers = [(i, k) for i, (x, y) in enumerate(zip(rec_a, rec_b, strict=True)) for k in sorted(set(x) | set(y))]
    differ = [f"step {i + 1} {k}: {rec_a[i].get(k)!r} vs {rec_b[i].get(k)!r}" for i, k in numbers
              if rec_a[i].get(k) != rec_b[i].get(k)
              and not (isinstance(rec_a[i].get(k), float) and math.isnan(rec_a[i][k])
                       and isinstance(rec_b[i].get(k), float) and math.isnan(rec_b[i][k]))]
    names = sorted(set(ten_a) | set(ten_b))
    tensors_differ = []
    for n in names:
        x, y = ten_a.get(n), ten_b.get(n)
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape:
            tensors_differ.append(f"{n}: {'missing' if x is None or y is None else 'dtype/shape'}")
        elif not torch.equal(x, y):
            gap = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else "int"
            tensors_differ.append(f"{n}: max |diff| {gap}")
    return {"records": len(numbers), "records_differ": differ, "tensors": len(names),
            "tensors_differ": tensors_differ, "equal": not differ and not tensors_differ}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev_a")
    p.add_argument("rev_b")
    p.add_argument("--dtypes", default="float64,float32")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        p.error(f"unknown cases {unknown}")
    results = []
    with tempfile.TemporaryDirectory(prefix="harts-compare-") as tmp:
        tmp = Path(tmp)
        site = tmp / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        trees = {}
        for label, rev in (("a", args.rev_a), ("b", args.rev_b)):
            trees[label] = tmp / label
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[label]), rev],
                           check=True, capture_output=True)
        try:
            rollouts = tmp / "rollouts.jsonl"
            subprocess.run([sys.executable, "-m", "harts", "workload", "generate", "--workload", "tiny-stepwise",
                            "--out", str(rollouts)], env=_env(trees["a"], site), check=True, capture_output=True)
            for case in cases:
                procs, extra = CASES[case]
                for dtype in args.dtypes.split(","):
                    runs = [_run(trees[label], site, tmp / "runs" / f"{case}-{dtype}-{label}", procs, extra,
                                 dtype, args.steps, rollouts) for label in ("a", "b")]
                    row = {"case": case, "dtype": dtype, **_compare(*runs)}
                    results.append(row)
                    if not args.json:
                        print(f"{case:9s} {dtype:8s} {'EQUAL' if row['equal'] else 'DIFFER'}  "
                              f"{row['records']} step numbers, {row['tensors']} checkpoint tensors", flush=True)
                        for line in (row["records_differ"] + row["tensors_differ"])[:8]:
                            print(f"    {line}")
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    ok = all(r["equal"] for r in results)
    if args.json:
        print(json.dumps({"rev_a": args.rev_a, "rev_b": args.rev_b, "steps": args.steps, "cases": results,
                          "equal": ok}, indent=1))
    else:
        print(("all equal: " if ok else "NOT equal: ") + f"{args.rev_a} vs {args.rev_b}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
