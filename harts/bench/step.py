"""Update-step benchmark on a CUDA device (the library behind `harts bench`).

Step benchmark: one full update (forward, backward, AdamW) of the same generated
trajectories in expanded and in tree mode, same model, dtype and microbatch token budget
(each mode packs its own microbatches under it: trajectories for expanded, whole trees by
compact size for tree). Activation recomputation is on in both. Reported per mode: the
median step time over `steps` timed steps after `warmup` (compilation, autotuning) with the
step's data side (partition, layouts, index copies) prepared one step ahead in a
background thread (`prefetched_steps`; the same for both modes), the same without
(`inline_seconds`: everything on the critical path) and the preparation's own host time, the
expanded tokens per second, and the peak allocated memory over the timed steps; plus the
token ratio expanded / (compact + KDA replay) tokens, the FLOP ratio (GEMM + attention
FLOPs, `harts.sim.flops`), which summarise the work but do not bound the speedup, and per
baseline (packed, prefix-merged) the ideal speedup (`harts.sim.flops.ideal_speedup`): the
baseline's per-op times (profiled kernel time by work kind on CUDA, the simulator's per-op
prices elsewhere) scaled by each kind's work ratio, tree over baseline.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from harts.bench.timing import prefetched_steps, sync_cuda

BASELINES = ("packed", "prefix-merged")  # the non-tree baselines `step_benchmark` can time
_MODE_KEY = {"packed": "expanded", "prefix-merged": "prefix_merged"}


def kernel_kind(name: str):
    """The `harts.sim.flops.WorkKind` a CUDA kernel's time scales with, from its name:
    attention kernels by attended pairs, the KDA state recurrence (fla's `fwd_h` / `dhu`
    kernels and HARTS's) by chunk steps, the other KDA kernels by executed KDA tokens, the
    optimizer's and clipping's multi-tensor kernels by parameters, everything else by rows."""
    from harts.sim.flops import WorkKind

    n = name.lower()
    if any(k in n for k in ("fmha", "flash", "attn", "attention", "sdpa", "flex", "cudnn_generated")):
        return WorkKind.ATTENTION_PAIRS
    if any(k in n for k in ("fwd_h", "kernel_h_", "dhu", "bwd_h")):
        return WorkKind.KDA_CHUNK_STEPS
    if any(k in n for k in ("kda", "chunk_", "wy_", "recompute_w_u", "solve_tril", "kkt", "gated_delta")):
        return WorkKind.KDA_TOKENS
    if any(k in n for k in ("adam", "multi_tensor", "foreach")):
        return WorkKind.PARAMETERS
    return WorkKind.TOKENS


def profile_kernel_seconds(trainer, trajectories, microbatch_tokens: int) -> dict[str, float]:
    """CUDA kernel seconds by kernel name of one update step (data side prepared first),
    under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    prepared = trainer.prepare(trajectories, microbatch_tokens)
    sync_cuda()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.step(trajectories, microbatch_tokens, prepared=prepared)
        sync_cuda()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.device_time / 1e6
    return out


def kind_seconds(kernel_seconds: dict[str, float]) -> dict:
    """Kernel seconds summed by `kernel_kind`."""
    out: dict = {}
    for name, t in kernel_seconds.items():
        k = kernel_kind(name)
        out[k] = out.get(k, 0.0) + t
    return out


def measured_work(mode: str, trajectories, forest, rows: int, replay: int, partition, chunk_size: int,
                  parameters: int) -> dict:
    """Work per `WorkKind` of the step a trainer ran: rows it computed, attended pairs
    (causal over its sequences, or the forest's ancestor pairs in tree mode), KDA tokens
    (replay included), chunk steps (per microbatch, the longest sequence's chunks; tree
    mode: the rounds of the forest's minimum-call plan) and parameters."""
    from harts.plan.work import chain_pairs
    from harts.sim.flops import WorkKind, step_work
    from harts.tree.prefix import prefix_hosts

    lengths = np.asarray([len(t) for t in trajectories], dtype=np.int64)
    if mode == "tree":
        w = step_work(forest, "tree", chunk_size)
        pairs, steps = w.attn_pairs, sum(r.max_chunks for r in w.kda_rounds)
    else:
        seqs = []
        for b in partition:
            b = list(b)
            if mode == "prefix-merged":
                host = prefix_hosts([trajectories[j].tokens for j in b])
                b = [b[i] for i in range(len(b)) if host[i] == i]
            seqs.append(lengths[b])
        pairs = sum(chain_pairs(x) for x in seqs)
        steps = sum(int(-(-x.max() // chunk_size)) for x in seqs)
    return {WorkKind.TOKENS: rows, WorkKind.ATTENTION_PAIRS: pairs, WorkKind.KDA_TOKENS: rows + replay,
            WorkKind.KDA_CHUNK_STEPS: steps, WorkKind.PARAMETERS: parameters}


def step_benchmark(trajectories, *, model: str | torch.nn.Module = "tiny-h200", dtype: torch.dtype = torch.bfloat16,
                   microbatch_tokens: int = 131072, steps: int = 2, warmup: int = 1,
                   device: str = "cuda", baselines=("packed",), tree: bool = True, seed: int = 0,
                   kernels=None, op_seconds: str = "auto", hardware: str = "h200",
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`baselines`: which of `BASELINES` to time beside the tree step ("packed": the
    trajectory-expanded trainer, result key "expanded"; a trajectory longer than
    `microbatch_tokens` makes it the expanded-ffd plan, whose chains of windows keep every
    microbatch within the budget; "prefix-merged": its prefix-merged variant, key
    "prefix_merged"). `kernels`: every mode's KernelConfig
    (default: `KernelConfig.from_env()`); each mode's result records it and what its ops
    ran ("kernels"). `op_seconds`: where the baseline's per-op times that weight the ideal
    come from: "profile" (one more step of the baseline under torch.profiler, kernel time
    by `kernel_kind`), "simulated" (the simulator's per-op prices on `hardware`, with its
    own work counts: what CPU runs use), "auto" (profile on CUDA, else simulated).
    `progress`: called with a line as each mode's model is built, warmed up and timed
    (the seconds so far), so a long run shows where it is."""
    from harts.config.kernels import KernelConfig
    from harts.config.models import get_model_config
    from harts.config.param_counts import parameter_counts
    from harts.exec.factory import chained_expanded_plan, make_trainer
    from harts.exec.model.model import build_model
    from harts.sim.flops import (
        flop_ratio,
        ideal_speedup,
        simulated_op_seconds,
        step_work,
        work_counts,
    )
    from harts.tree import build_forest

    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; known: {', '.join(BASELINES)}")
    if op_seconds not in ("auto", "profile", "simulated"):
        raise ValueError(f"op_seconds must be auto, profile or simulated; got {op_seconds!r}")
    if op_seconds == "auto":
        op_seconds = "profile" if str(device).startswith("cuda") and torch.cuda.is_available() else "simulated"
    # a registered name (weights from `seed`), or a model whose weights each mode copies
    source = model if isinstance(model, torch.nn.Module) else None
    cfg = source.config if source is not None else get_model_config(model)
    kernels = kernels if kernels is not None else KernelConfig.from_env()
    kinds = {"packed": "expanded", "prefix-merged": "prefix-merged", "tree": "tree"}  # make_trainer's
    modes = list(baselines) + (["tree"] if tree else [])
    out: dict[str, Any] = {"model": cfg.name, "dtype": str(dtype).removeprefix("torch."),
                           "microbatch_tokens": microbatch_tokens, "trajectories": len(trajectories),
                           "baselines": {}}
    forest = build_forest(trajectories)
    # a trajectory longer than the budget: the packed baseline runs its chain of windows
    chained = chained_expanded_plan(trajectories, microbatch_tokens, cfg.chunk_size, forest) \
        if "packed" in baselines else None
    params = parameter_counts(cfg).total
    work: dict[str, dict] = {}
    profiles: dict[str, dict] = {}
    began = time.perf_counter()

    def say(line: str) -> None:
        if progress is not None:
            progress(f"{line} ({time.perf_counter() - began:.0f} s)")

    for mode in modes:
        key = _MODE_KEY.get(mode, mode)
        say(f"{mode}: building the model")
        if source is None:
            net = build_model(cfg, seed=seed, dtype=dtype, device=device, recompute=True)
        else:
            net = copy.deepcopy(source).to(device=device, dtype=dtype)
            net.recompute = True
        if mode == "packed" and chained is not None:
            trainer = make_trainer("plan", net, chained, kernels=kernels)
        else:
            trainer = make_trainer(kinds[mode], net, kernels=kernels)
        for i in range(warmup):
            say(f"{mode}: warm-up step {i + 1}/{warmup}")
            trainer.step(trajectories, microbatch_tokens)
        sync_cuda()
        torch.cuda.reset_peak_memory_stats()
        inline = []
        for i in range(steps):
            say(f"{mode}: timed step {i + 1}/{steps}, data side inline")
            sync_cuda()
            t0 = time.perf_counter()
            res = trainer.step(trajectories, microbatch_tokens)
            sync_cuda()
            inline.append(time.perf_counter() - t0)
        say(f"{mode}: {steps} timed steps, data side prepared ahead (inline median {statistics.median(inline):.2f} s)")
        times, prep = prefetched_steps(trainer, trajectories, microbatch_tokens, steps)
        out[key] = {
            "seconds": statistics.median(times), "all_seconds": times,
            "inline_seconds": statistics.median(inline), "all_inline_seconds": inline,
            "prepare_seconds": statistics.median(prep),
            "peak_bytes": int(torch.cuda.max_memory_allocated()),
            "microbatches": len(res.microbatches), "rows": res.executed_rows,
            "largest_microbatch_rows": max((m["rows"] for m in res.layout), default=0),
            "tokens_per_second": res.tokens / statistics.median(times), "loss": res.losses["loss"],
            "kernels": trainer.kernels_used(),
        }
        replay = 0
        if mode == "tree":
            out[key]["kda_rounds"] = max(m["kda_rounds"] for m in res.layout)
            out[key]["replay_tokens"] = replay = sum(m["replay_tokens"] for m in res.layout)
        partition = res.microbatches
        if mode == "packed" and chained is not None:
            # the work of a chain is its trajectory's: each row once, causal attention over it
            long = {j for j, t in enumerate(trajectories) if len(t.tokens) > microbatch_tokens}
            partition = [[j] for j in sorted(long)] + [b for b in ([j for j in m if j not in long]
                                                                 for m in res.microbatches) if b]
        work[mode] = measured_work(mode, trajectories, forest, res.executed_rows, replay, partition,
                                   cfg.chunk_size, params)
        if mode != "tree" and op_seconds == "profile":
            say(f"{mode}: one profiled step (the ideal's per-op times)")
            profiles[mode] = profile_kernel_seconds(trainer, trajectories, microbatch_tokens)
        say(f"{mode}: step {statistics.median(times):.2f} s")
        out["expanded_tokens"] = res.tokens
        del trainer, net, res
        gc.collect()
        torch.cuda.empty_cache()
    out["compact_tokens"] = forest.compact_tokens
    out["compression"] = forest.expanded_tokens / forest.compact_tokens
    if "tree" in out:
        replay = out["tree"]["replay_tokens"]
        # token ratio and FLOP ratio summarise the work; neither bounds the speedup (nor
        # does the ideal below, which prices the tree's work at the baseline's per-unit times)
        out["token_ratio"] = out["expanded_tokens"] / (out["tree"]["rows"] + replay)
        fl = flop_ratio(forest, cfg)
        out["flop_ratio"] = fl.pop("flop_ratio")
        out["flop_ratio_parts"] = fl
        for mode in baselines:
            key = _MODE_KEY[mode]
            base = out[key]
            if op_seconds == "profile":
                ideal = ideal_speedup(kind_seconds(profiles[mode]), work[mode], work["tree"])
            else:
                sim_mode = "expanded" if mode == "packed" else mode
                from harts.sim.hardware import load_hardware

                hw = load_hardware(hardware)
                bw, tw = step_work(forest, sim_mode, cfg.chunk_size), step_work(forest, "tree", cfg.chunk_size)
                ideal = ideal_speedup(simulated_op_seconds(cfg, bw, hw), work_counts(cfg, bw), work_counts(cfg, tw))
            speedup = base["seconds"] / out["tree"]["seconds"]
            out["baselines"][mode] = {
                "speedup": speedup, "speedup_inline": base["inline_seconds"] / out["tree"]["inline_seconds"],
                "ideal": ideal.ideal, "of_ideal": speedup / ideal.ideal, "ideal_parts": ideal.to_dict(),
                "op_seconds": op_seconds if op_seconds == "profile" else f"simulated ({hardware})",
                "rows": base["rows"], "token_ratio": base["rows"] / (out["tree"]["rows"] + replay),
                "work": {k.value: v for k, v in work[mode].items()},
            }
        out["tree"]["work"] = {k.value: v for k, v in work["tree"].items()}
        first = out["baselines"][baselines[0]] if baselines else None
        if first is not None:
            # headline fields: the first baseline's (packed unless only prefix-merged ran)
            out.update(speedup=first["speedup"], speedup_inline=first["speedup_inline"], ideal=first["ideal"],
                       of_ideal=first["of_ideal"], baseline=baselines[0])
            out["tree_peak_bytes"] = out["tree"]["peak_bytes"]
            out[f"{_MODE_KEY[baselines[0]]}_peak_bytes"] = out[_MODE_KEY[baselines[0]]]["peak_bytes"]
    return out
