"""What a window step moves and computes beyond the same rows unsplit, op by op, on the CPU.

    python benchmarks/window_traffic.py [--case grpo/2@2048] [--model tiny-h200] [--shrink 2]
        [--kinds windows,tree] [--json FILE]

One update step of a drawn instance (`harts.tree.shapes.draw(family, seed, budget)`) as the
l1l2 window plan at the budget and as the unsplit tree (budget 131072), in float32 on the
CPU, under a `TorchDispatchMode` that counts, for every aten op call, the bytes of its tensor
inputs and outputs (none for a view) and the FLOPs of its matrix products, keyed by the op and its call site:
the innermost `harts/` Python frame, or in the backward the autograd node running it. The
counts do not depend on the device, so where a window step's extra bytes and FLOPs go is
read here and priced on a GPU by bandwidth: a site whose bytes grow with the producer's
rows times the consumers, or with the microbatches, shows up as windows minus tree.

On the CPU the attention, KDA and MoE ops run their float64-capable references (dense
masks, the chunked-recurrence reference, the per-expert loop), not the GPU's kernels, so
those sites' counts are the references'; the executor's own code (the stash and its row
gathers, the loss and LM head, gradient accumulation, the producer's backward) is the same
code on both. It showed the consumers' loss forming the logits of every shared row they
read again: `exec/loss.py` 128 GFLOP in the window step against 94 in the unsplit one on
grpo/2@1024 with `--shrink 4` (benchmarks/results/windows/2026-12-05-db7998e-window-traffic-grpo2-1024.json);
with each target's loss term computed where its row is, 94 and 94
(benchmarks/results/windows/2026-12-06-fcbdb27-window-traffic-grpo2-1024.json).

`--shrink N` divides the model's widths (d_model, FFN widths, heads, latent rank) by N and
the expert count by N, so a step of a 2k-budget instance runs in a few minutes on two cores;
the sites are the same, their bytes scale with the widths. Prints the largest differences
by site and by op; `--json` writes every row with provenance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

_MATMULS = {"mm": 1, "addmm": 1, "bmm": 1, "baddbmm": 1, "_grouped_mm": 1}


# frames that only start passes or backwards: an op below them is charged to the autograd
# node running it (or "-"), not to them
_DRIVERS = ("exec/step.py", "exec/layouts/plan.py", "exec/trainer.py", "exec/window.py")


def _site() -> str:
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if "/harts/" in path and "/benchmarks/" not in path:
            rel = path.split("/harts/")[-1]
            if not rel.startswith(_DRIVERS):
                return f"{rel}:{f.f_code.co_name}"
            break
        f = f.f_back
    node = torch._C._current_autograd_node()
    return f"autograd {node.name()}" if node is not None else "-"


def _flops(name: str, args) -> float:
    if name not in _MATMULS:
        return 0.0
    ts = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm", "bmm"):
        a, b = ts[0], ts[1]
    elif name == "_grouped_mm":  # [M, K] x [G, K, N] (or 3-d both): 2 M K N
        a, b = ts[0], ts[1]
        return 2.0 * a.shape[0] * a.shape[-1] * b.shape[-1] if a.dim() == 2 else 2.0 * a.numel() * b.shape[-1]
    else:
        a, b = ts[1], ts[2]
    return 2.0 * a.numel() * b.shape[-1]


class Traffic(TorchDispatchMode):
    """Per (op, site): calls, tensor bytes in + out, matmul FLOPs."""

    def __init__(self):
        super().__init__()
        self.rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        # a view moves nothing
        moved = 0 if func.is_view else sum(t.numel() * t.element_size() for t in ins + outs)
        r = self.rows[(name, _site())]
        r[0] += 1
        r[1] += moved
        r[2] += _flops(name, args)
        return out


def shrunk(cfg, n: int):
    if n <= 1:
        return cfg
    d = lambda x: max(1, x // n)  # noqa: E731
    return dataclasses.replace(
        cfg, d_model=d(cfg.d_model), dense_ffn_dim=d(cfg.dense_ffn_dim), expert_ffn_dim=d(cfg.expert_ffn_dim),
        num_experts=max(cfg.top_k, d(cfg.num_experts)), kda_num_heads=d(cfg.kda_num_heads),
        mla_num_heads=d(cfg.mla_num_heads), kv_lora_rank=d(cfg.kv_lora_rank))


def step_traffic(kind: str, trajs, budget: int, cfg) -> dict:
    from harts.exec.factory import make_trainer
    from harts.exec.model.model import build_model
    from harts.plan.planners import PlanConfig, make_plan
    from harts.tree import build_forest

    net = build_model(cfg, seed=0, dtype=torch.float32, device="cpu", recompute=True)
    if kind == "tree":
        trainer = make_trainer("tree", net)
    else:
        plan = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size))
        trainer = make_trainer("plan", net, plan)
    prepared = trainer.prepare(trajs, budget)
    mode = Traffic()
    t0 = time.perf_counter()
    with mode:
        res = trainer.step(trajs, budget, prepared=prepared)
    mbs = len(res.microbatch_rows) if hasattr(res, "microbatch_rows") else None
    return {"kind": kind, "budget": budget, "seconds": time.perf_counter() - t0, "microbatches": mbs,
            "rows": [{"op": k[0], "site": k[1], "calls": v[0], "bytes": v[1], "flops": v[2]}
                     for k, v in sorted(mode.rows.items(), key=lambda kv: -kv[1][1])]}


def difference(a: dict, b: dict, key) -> list[dict]:
    """Rows of `a` minus rows of `b`, summed by `key(row)`, largest byte difference first."""
    acc: dict = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for sign, side in ((1, a), (-1, b)):
        for r in side["rows"]:
            x = acc[key(r)]
            x[0] += sign * r["calls"]
            x[1] += sign * r["bytes"]
            x[2] += sign * r["flops"]
            x[3 if sign > 0 else 4] += r["bytes"]
    return [{"what": k, "calls": v[0], "bytes": v[1], "flops": v[2], "bytes_windows": v[3], "bytes_tree": v[4]}
            for k, v in sorted(acc.items(), key=lambda kv: -abs(kv[1][1]))]


def main(argv: list[str]) -> int:
    from harts.bench.provenance import provenance
    from harts.config.models import get_model_config
    from harts.tree import build_forest, shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="grpo/2@2048")
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--shrink", type=int, default=2)
    ap.add_argument("--unsplit-budget", type=int, default=131072)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = shrunk(get_model_config(args.model), args.shrink)
    family, rest = args.case.split("/")
    seed, budget = (int(x) for x in rest.split("@"))
    trajs = shapes.draw(family, seed, budget, vocab_size=min(cfg.vocab_size, 32768))
    f = build_forest(trajs)
    print(f"{args.case}: {len(trajs)} trajectories, {f.compact_tokens} rows, {f.expanded_tokens} expanded", flush=True)
    win = step_traffic("windows", trajs, budget, cfg)
    tree = step_traffic("tree", trajs, args.unsplit_budget, cfg)
    tot = {k: (sum(r["bytes"] for r in s["rows"]), sum(r["flops"] for r in s["rows"]), sum(r["calls"] for r in s["rows"]))
           for k, s in (("windows", win), ("tree", tree))}
    for k, (b, fl, c) in tot.items():
        print(f"{k:8s} {b / 1e9:9.2f} GB {fl / 1e12:8.3f} TFLOP {c:7d} op calls", flush=True)
    by_site = difference(win, tree, lambda r: r["site"])
    by_op = difference(win, tree, lambda r: r["op"])
    for title, rows in (("site", by_site), ("op", by_op)):
        print(f"\nwindows minus tree by {title}: GB, GFLOP, calls")
        for r in rows[:args.top]:
            print(f"  {r['bytes'] / 1e9:+8.3f} GB {r['flops'] / 1e9:+9.2f} GF {r['calls']:+6d}  {r['what'][:110]}")
    if args.json:
        out = {"provenance": provenance([sys.argv[0], *argv]), "case": args.case, "model": args.model,
               "shrink": args.shrink, "compact_rows": f.compact_tokens, "totals": tot,
               "windows": win, "tree": tree, "by_site": by_site, "by_op": by_op}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
