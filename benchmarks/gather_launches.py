"""Kernel launches of the row gathers' backwards in one step, by occurrence levels and by
one gather-add, over the shape families (CPU, counted, no GPU).

    python benchmarks/gather_launches.py [--families fanout,grpo,...] [--seeds 2] [--budget 4096]
        [--kinds tree,windows] [--json FILE]

A `RowGather` (harts/exec/ops/gather.py) has a backward that sums each source row's
gradients over its occurrences in its index (a KDA round's replayed rows: the last partial
chunk of a fork is read again by every sequence below it). By occurrence levels that is
the first level's gather (1 launch if every row occurs, 2 if most do, else a zero-fill, a
gather and a copy: 3) and a gather and an `index_add_` per further level; on the CUDA path
(one fixed-order gather-add, `segment_sum.gather_add`, or the one gather where every row
occurs once) it is one launch. For each `harts.tree.shapes` instance (`family/seed@budget`), the step's gather
backwards are counted both ways while one step of a small model with tiny-h200's layers
(8 layers, three KDA per MLA, chunk 64; small widths: the counts depend on the layout, not
the widths) runs on the CPU: `tree` the unsplit step, `windows` the l1l2 plan at the
budget. Per-layer launch counts of a GPU step are otherwise the same code path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def narrow_tiny_h200(**overrides):
    """tiny-h200's layers (8, three KDA per MLA, MoE with a shared expert) at small widths
    and 8 experts: a CPU-sized model whose layouts, launches and plans are tiny-h200's."""
    from harts.config.models import get_model_config

    return get_model_config("tiny-h200").replace(
        d_model=64, kda_num_heads=2, kda_head_dim=16, kda_head_v_dim=16, mla_num_heads=2, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, dense_ffn_dim=64, num_experts=8, top_k=2,
        expert_ffn_dim=16, vocab_size=512, **overrides)


def count(kind: str, family: str, seed: int, budget: int) -> dict:
    import torch

    from harts.exec.factory import make_trainer
    from harts.exec.model.model import build_model
    from harts.exec.ops import gather as G
    from harts.plan.planners import PlanConfig, make_plan
    from harts.tree import build_forest, shapes

    tally = {"levels": 0, "gather_add": 0, "backwards": 0}
    plain = G.RowGather.backward

    def backward(self, g):
        host_first, host_more = self._levels_host
        first = 1 if self.covers_all else 2 if self.mostly else (3 if host_first is not None else 1)
        tally["levels"] += first + 2 * len(host_more)
        tally["gather_add"] += 1
        tally["backwards"] += 1
        return plain(self, g)

    cfg = narrow_tiny_h200()
    trajs = shapes.draw(family, seed, budget, vocab_size=cfg.vocab_size)
    forest = build_forest(trajs)
    net = build_model(cfg, seed=0, dtype=torch.float32, recompute=True)
    if kind == "tree":
        trainer, b = make_trainer("tree", net), 1 << 30
    else:
        plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size))
        trainer, b = make_trainer("plan", net, plan), budget
    G.RowGather.backward = backward
    try:
        res = trainer.forward_backward(trajs, b)
    finally:
        G.RowGather.backward = plain
    return {"instance": f"{family}/{seed}@{budget}", "kind": kind, "sequences": len(trajs),
            "rows": int(forest.compact_tokens), "microbatches": len(res.microbatches), **tally}


def main(argv: list[str] | None = None) -> int:
    from harts.tree import shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(shapes.FAMILIES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[2])
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--kinds", default="tree,windows")
    ap.add_argument("--json")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    rows = []
    for family in args.families.split(","):
        for seed in args.seeds:
            for kind in args.kinds.split(","):
                r = count(kind, family, seed, args.budget)
                rows.append(r)
                print(f"{r['instance']:22s} {kind:8s} sequences {r['sequences']:3d} microbatches {r['microbatches']:2d} "
                      f"gather backwards {r['backwards']:4d}  launches by levels {r['levels']:5d}  "
                      f"by gather-add {r['gather_add']:4d}", flush=True)
    if args.json:
        from harts.bench.provenance import provenance

        Path(args.json).write_text(json.dumps({"provenance": provenance([sys.argv[0], *argv]), "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
