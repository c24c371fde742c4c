"""bf16 gradient error of the window plan against the unsplit tree's, over the shape
families (CPU, the reference kernels; no GPU).

    python benchmarks/window_fidelity.py [--families grpo,bushy,...] [--seeds 6 7] [--budgets 512 1024]
        [--json FILE]

For each `harts.tree.shapes` instance (`family/seed@budget`) a small model with
tiny-h200's layers (8 layers, three KDA per MLA, MoE with a shared expert; small widths,
chunk 16) takes one forward/backward from the same weights four ways: the expanded
baseline in float64 (the reference), and in bf16 the expanded baseline at the budget, the
unsplit tree (one microbatch) and the l1l2 window plan at the budget. Reported per bf16
run: the relative L2 error of the whole gradient against the float64 reference
(`err_*`), and against the bf16 expanded step at the budget (`vs_expanded_*`, the metric
of benchmarks/gpu/window_suite.py's `--fidelity`), and the windows' error over the
tree's. The MoE's aux loss is summed over the step (`aux_scope="global"`), so every run
computes the same loss. The CPU runs the reference kernels (attention, KDA, MoE loop), so
this measures the plans' own numerics (the producer's stash in bf16, the gradients summed
over consumers and microbatches), not the GPU kernels' rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gather_launches import narrow_tiny_h200  # the same small model (benchmarks/gather_launches.py)


def _grads(net) -> list:
    return [p.grad.detach().double().clone() for p in net.parameters() if p.grad is not None]


def _rel(a: list, b: list) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.pow(2).sum()) for y in b)
    return (num / den) ** 0.5


def measure(family: str, seed: int, budget: int) -> dict:
    import torch

    from harts.exec.factory import make_trainer
    from harts.exec.model.model import build_model
    from harts.plan.planners import PlanConfig, make_plan
    from harts.tree import build_forest, shapes

    cfg = narrow_tiny_h200(chunk_size=16, aux_scope="global")
    trajs = shapes.draw(family, seed, budget, vocab_size=cfg.vocab_size)
    forest = build_forest(trajs)
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size))
    big = 1 << 30
    runs = [("reference", torch.float64, "expanded", None, big), ("expanded", torch.bfloat16, "expanded", None, budget),
            ("tree", torch.bfloat16, "tree", None, big), ("windows", torch.bfloat16, "plan", plan, budget)]
    grads, out = {}, {"instance": f"{family}/{seed}@{budget}", "rows": int(forest.compact_tokens),
                      "trajectories": len(trajs), "consumers": len(plan.consumers())}
    for name, dtype, kind, p, b in runs:
        net = build_model(cfg, seed=0, dtype=dtype, recompute=True)
        trainer = make_trainer(kind, net, p) if p is not None else make_trainer(kind, net)
        res = trainer.forward_backward(trajs, b)
        grads[name] = _grads(net)
        out[f"microbatches_{name}"] = len(res.microbatches)
        del trainer, net
    for name in ("expanded", "tree", "windows"):
        out[f"err_{name}"] = _rel(grads[name], grads["reference"])
    for name in ("tree", "windows"):
        out[f"vs_expanded_{name}"] = _rel(grads[name], grads["expanded"])
    out["windows_over_tree"] = out["err_windows"] / out["err_tree"]
    out["windows_over_tree_vs_expanded"] = out["vs_expanded_windows"] / out["vs_expanded_tree"]
    return out


def main(argv: list[str] | None = None) -> int:
    from harts.tree import shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(shapes.FAMILIES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[6])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--json")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    rows = []
    print(f"{'instance':22s} {'rows':>5s} {'mbs':>3s}  err vs float64: expanded   tree  windows  "
          "windows/tree | vs bf16 expanded: windows/tree", flush=True)
    for family in args.families.split(","):
        for seed in args.seeds:
            for budget in args.budgets:
                r = measure(family, seed, budget)
                rows.append(r)
                print(f"{r['instance']:22s} {r['rows']:5d} {r['microbatches_windows']:3d}  "
                      f"{r['err_expanded']:.5f} {r['err_tree']:.5f} {r['err_windows']:.5f}  {r['windows_over_tree']:.3f}"
                      f"        | {r['windows_over_tree_vs_expanded']:.3f}", flush=True)
    ratios = sorted(r["windows_over_tree"] for r in rows)
    if ratios:
        print(f"windows / tree error against float64: median {ratios[len(ratios) // 2]:.3f}, "
              f"max {ratios[-1]:.3f}, within 1.05 on {sum(x <= 1.05 for x in ratios)} of {len(ratios)}")
    if args.json:
        from harts.bench.provenance import provenance

        Path(args.json).write_text(json.dumps({"provenance": provenance([sys.argv[0], *argv]), "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
