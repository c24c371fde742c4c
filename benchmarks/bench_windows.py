"""Sharing windows: retained producer memory per window and the extra work of splitting.

    python benchmarks/bench_windows.py [--json]

For generated presets (structure only) planned by `l1l2` at a budget where trees exceed a
microbatch, for every sharing window: producer rows, consumers, and the producer state
retained until its backward, in bytes for the Tiny model in bf16 (KDA states fp32) —
`retained`: what harts.exec.window keeps, which is what consumers read (KV of the
context rows, conv inputs of the W-1 rows above each consumer root, KDA
inputs of replayed rows and one K x V state per head per consumer start and KDA layer),
next to `all inputs`: every producer row's mixing inputs plus every chunk state its
rounds hand on (what a stash that keeps everything would hold; our first version did).
Extra work compared with executing each tree in one microbatch: executed rows (rows
computed twice) and KDA replay tokens, from the same LocalLayout/replay_schedule the
executor runs. Then a measured CPU run (tiny-cpu, float32) of the same executor for the
bytes it actually held.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from harts.config.models import get_model_config
from harts.config.plan import PlanConfig
from harts.exec.tree_layout import LocalLayout, replay_schedule
from harts.exec.window import piece_rows
from harts.plan.planners import make_plan
from harts.tree.workload import generate, preset

BYTES = 2  # bf16


def per_row_bytes(cfg) -> dict[str, int]:
    mla = cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    H, K, V = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_v_dim
    conv = H * (K + K + V)
    kda_inputs = H * (3 * K + V + 1)
    return {
        "attention": mla * BYTES * cfg.num_mla_layers,
        "conv": conv * BYTES * cfg.num_kda_layers,
        "kda_inputs": kda_inputs * BYTES * cfg.num_kda_layers,
        "kda_state": H * K * V * 4 * cfg.num_kda_layers,  # states stay fp32
    }


def study(name: str, budget: int, model: str) -> dict:
    cfg = get_model_config(model)
    wl = generate(preset(name))
    forest = wl.forest()
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=cfg.chunk_size))
    per = per_row_bytes(cfg)
    B, W = cfg.chunk_size, cfg.conv_window
    one_replay = replay_schedule(LocalLayout.full(forest), B).replay_tokens
    replay = 0
    executed = 0
    windows = []
    consumers = plan.consumers()
    states_handed: dict[int, int] = {}
    for m in plan.microbatches:
        comp = piece_rows(forest, m.pieces)
        ctx_rows = piece_rows(forest, m.context)
        layout = LocalLayout.of_rows(forest, comp, ctx_rows)
        sch = replay_schedule(layout, B)
        replay += sch.replay_tokens
        executed += comp.size
        if m.id in consumers:
            # chunk states this producer's rounds hand on (kept by our executor)
            states_handed[m.id] = sum(int(r.gather_rows.size) // B for r in sch.rounds)
    for p, cs in consumers.items():
        prod_rows = piece_rows(forest, plan.microbatches[p].pieces)
        ctx_union, roots, replay_rows = set(), 0, 0
        for c in cs:
            m = plan.microbatches[c]
            ctx_rows = piece_rows(forest, m.context)
            ctx_union.update(ctx_rows.tolist())
            layout = LocalLayout.of_rows(forest, piece_rows(forest, m.pieces), ctx_rows)
            sch = replay_schedule(layout, B)
            roots += len(sch.external) + sum(1 for r in sch.rounds for i in r.init_round.tolist() if i == -1)
            replay_rows += sch.replay_tokens
        n_ctx = len(ctx_union)
        held = prod_rows.size * (per["attention"] + per["conv"] + per["kda_inputs"])
        held += states_handed[p] * per["kda_state"]
        needed = (n_ctx * per["attention"] + roots * (W - 1) * per["conv"]
                  + replay_rows * per["kda_inputs"] + roots * per["kda_state"])
        windows.append({"producer": p, "consumers": len(cs), "producer_rows": int(prod_rows.size),
                        "context_rows": n_ctx, "all_inputs_bytes": int(held), "retained_bytes": int(needed)})
    held = [w["all_inputs_bytes"] for w in windows] or [0]
    needed = [w["retained_bytes"] for w in windows] or [0]
    return {
        "workload": name, "model": model, "microbatch_tokens": budget,
        "microbatches": plan.num_microbatches, "windows": len(windows),
        "compact_tokens": forest.compact_tokens, "executed_rows": int(executed),
        "extra_rows": int(executed - forest.compact_tokens),
        "replay_one_microbatch": int(one_replay), "replay_plan": int(replay),
        "extra_replay": int(replay - one_replay),
        "peak_all_inputs_bytes": int(max(held)),
        "peak_retained_bytes": int(max(needed)), "mean_retained_bytes": float(np.mean(needed)),
        "window_detail": windows,
    }


def measured_cpu() -> dict:
    import torch

    from harts.exec.factory import make_trainer
    from harts.exec.model.model import build_model
    from harts.tree import build_forest

    trajs = generate(preset("small-treestep", seed=1)).trajectories()
    forest = build_forest(trajs)
    budget = max(int(forest.traj_length.max()) + 5, forest.compact_tokens // 3)
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget))
    trainer = make_trainer("plan", build_model("tiny-cpu", dtype=torch.float32), plan)
    trainer.forward_backward(trajs, budget)
    return {"workload": "small-treestep seed 1", "model": "tiny-cpu fp32", "microbatch_tokens": budget,
            "windows": len(trainer.windows),
            "held_bytes": [w.retained_bytes for w in trainer.windows],
            "producer_rows": [w.producer_rows for w in trainer.windows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cases = [("swe-treestep-8", 65536), ("swe-treestep-16", 98304), ("swe-stepwise-8", 98304)]
    rows = [study(n, b, args.model) for n, b in cases]
    cpu = measured_cpu()
    if args.json:
        from harts.bench.provenance import provenance  # git revision, command, packages, device
        print(json.dumps({"provenance": provenance(), "analytic": rows, "measured_cpu": cpu}, indent=2))
        return
    print(f"{'workload':16} {'budget':>7} {'mbs':>4} {'win':>4} {'extra rows':>10} {'replay 1mb':>10} "
          f"{'replay plan':>11} {'peak retained':>13} {'all inputs':>10}")
    for r in rows:
        print(f"{r['workload']:16} {r['microbatch_tokens']:7d} {r['microbatches']:4d} {r['windows']:4d} "
              f"{r['extra_rows']:10d} {r['replay_one_microbatch']:10d} {r['replay_plan']:11d} "
              f"{r['peak_retained_bytes'] / 2**30:11.2f}GB {r['peak_all_inputs_bytes'] / 2**30:8.2f}GB")
    print(f"measured on CPU ({cpu['workload']}, {cpu['model']}): {cpu['windows']} window(s), retained "
          f"{cpu['held_bytes']} bytes for {cpu['producer_rows']} producer rows")


if __name__ == "__main__":
    main()
