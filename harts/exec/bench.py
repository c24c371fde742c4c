"""Update-step and per-op benchmarks on a CUDA device (the library behind `harts bench`).

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

Per-op benchmarks (`op_benchmarks`): fla's chunk_kda vs our replay path (boundary states
out, their gradients in; all of them, and a sparse request of a few as a tree round makes)
on the same packed tokens, and FlexAttention over a DFS ancestor
mask vs dense causal SDPA, each per token / per attended pair, forward+backward; rows also
go out in the simulator's profile schema (`harts.sim.profile/v1`).
"""

from __future__ import annotations

import copy
import datetime as _dt
import gc
import importlib.metadata as _md
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from harts.config.models import ModelConfig

_ROOT = Path(__file__).resolve().parents[2]


PACKAGES = ("torch", "triton", "fla-core", "nvidia-cudnn-frontend", "numpy", "einops", "transformers", "ortools")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - a copy of the tree without .git has no revision
        return None


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            out[name] = None
    if out.get("fla-core") is None:  # a wheel installed with --target has no dist-info lookup path
        try:
            import fla

            out["fla-core"] = fla.__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def device_info() -> dict[str, Any]:
    """The GPU, CUDA and cuDNN the run saw (None fields on a machine without CUDA)."""
    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(0), sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), count=torch.cuda.device_count())
    try:
        import cudnn

        info["cudnn_frontend_backend"] = cudnn.backend_version()
    except Exception:  # noqa: BLE001 - the frontend is optional
        pass
    return info


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """Where a result comes from: git revision (and whether the tree had local changes),
    the exact command, package versions, Python, device and the UTC date (the GPU suites'
    `run_suite` adds the suite's options and its kernel config). `HARTS_GIT_REV` in the
    environment names the revision instead of git: a copy of the tree on another machine
    may carry git metadata that is not its own."""
    from harts.config.env import git_revision_override

    named = git_revision_override()
    status = None if named else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_revision": named or _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *(sys.argv if argv is None else argv)]),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "device": device_info(),
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_cuda(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of fn() with CUDA events."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def prefetched_steps(trainer, trajectories, microbatch_tokens: int, steps: int) -> tuple[list[float], list[float]]:
    """Steady-state step times of `harts.exec.trainer.run_steps` with prefetch: a background
    thread prepares step i+1's partition and layouts (`trainer.prepare`: host numpy work and
    async copies) while step i runs, as a data loader would. Each time runs from the end of
    one step to the end of the next, so any wait for the preparation (and any slowdown of
    kernel launches by the thread) is counted; the first step, whose preparation nothing
    overlaps, is not timed. Returns (step seconds, preparation seconds), `steps` of each."""
    from harts.exec.trainer import run_steps

    prep_seconds = []
    prepare = trainer.prepare

    def timed_prepare(*a, **kw):
        p = prepare(*a, **kw)
        prep_seconds.append(p.seconds)
        return p

    trainer.prepare = timed_prepare
    times, last = [], None
    try:
        for _ in run_steps(trainer, [trajectories] * (steps + 1), microbatch_tokens, prefetch=True):
            _sync()
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
    finally:
        del trainer.prepare
    return times, prep_seconds[1:]


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
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.step(trajectories, microbatch_tokens, prepared=prepared)
        _sync()
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
    from harts.sim.flops import WorkKind, step_work
    from harts.sim.work import chain_pairs
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
    trajectory-expanded trainer, result key "expanded"; "prefix-merged": its
    prefix-merged variant, key "prefix_merged"). `kernels`: every mode's KernelConfig
    (default: `KernelConfig.from_env()`); each mode's result records it and what its ops
    ran ("kernels"). `op_seconds`: where the baseline's per-op times that weight the ideal
    come from: "profile" (one more step of the baseline under torch.profiler, kernel time
    by `kernel_kind`), "simulated" (the simulator's per-op prices on `hardware`, with its
    own work counts: what CPU runs use), "auto" (profile on CUDA, else simulated).
    `progress`: called with a line as each mode's model is built, warmed up and timed
    (the seconds so far), so a long run shows where it is."""
    from harts.config.kernels import KernelConfig
    from harts.config.models import get_model_config, parameter_counts
    from harts.exec.model.model import build_model
    from harts.exec.prefix_trainer import PrefixMergedTrainer
    from harts.exec.trainer import ExpandedTrainer
    from harts.exec.tree_trainer import TreeTrainer
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
    trainers = {"packed": ExpandedTrainer, "prefix-merged": PrefixMergedTrainer, "tree": TreeTrainer}
    modes = list(baselines) + (["tree"] if tree else [])
    out: dict[str, Any] = {"model": cfg.name, "dtype": str(dtype).removeprefix("torch."),
                           "microbatch_tokens": microbatch_tokens, "trajectories": len(trajectories),
                           "baselines": {}}
    forest = build_forest(trajectories)
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
        trainer = trainers[mode](net, kernels=kernels)
        for i in range(warmup):
            say(f"{mode}: warm-up step {i + 1}/{warmup}")
            trainer.step(trajectories, microbatch_tokens)
        _sync()
        torch.cuda.reset_peak_memory_stats()
        inline = []
        for i in range(steps):
            say(f"{mode}: timed step {i + 1}/{steps}, data side inline")
            _sync()
            t0 = time.perf_counter()
            res = trainer.step(trajectories, microbatch_tokens)
            _sync()
            inline.append(time.perf_counter() - t0)
        say(f"{mode}: {steps} timed steps, data side prepared ahead (inline median {statistics.median(inline):.2f} s)")
        times, prep = prefetched_steps(trainer, trajectories, microbatch_tokens, steps)
        out[key] = {
            "seconds": statistics.median(times), "all_seconds": times,
            "inline_seconds": statistics.median(inline), "all_inline_seconds": inline,
            "prepare_seconds": statistics.median(prep),
            "peak_bytes": int(torch.cuda.max_memory_allocated()),
            "microbatches": len(res.microbatches), "rows": res.executed_rows,
            "tokens_per_second": res.tokens / statistics.median(times), "loss": res.losses["loss"],
            "kernels": trainer.kernels_used(),
        }
        replay = 0
        if mode == "tree":
            out[key]["kda_rounds"] = max(m["kda_rounds"] for m in res.layout)
            out[key]["replay_tokens"] = replay = sum(m["replay_tokens"] for m in res.layout)
        work[mode] = measured_work(mode, trajectories, forest, res.executed_rows, replay, res.microbatches,
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


# measured activation bytes per computed row of tiny-h200 at 131,072 rows (267 KB, the
# windows section of docs/BENCHMARKS.md) over the simulator's estimate for it (138 KB)
MEASURED_OVER_SIMULATED_ACTIVATIONS = 1.93


def memory_plan(model: str | ModelConfig, microbatch_tokens: int, param_bytes: int = 2,
                lm_head_chunk_elements: int | None = None) -> dict[str, float]:
    """Planned peak bytes of one update step on one GPU: weights, gradients and AdamW's two
    moments in the parameters' dtype (`param_bytes` each), activations of a
    recomputing microbatch (the simulator's per-row estimate scaled by the measured
    ratio `MEASURED_OVER_SIMULATED_ACTIVATIONS`), and the LM head's largest logits
    workspace (three float32 [chunk, vocab] tensors in the chunked head, three
    [rows, vocab] without it). An estimate to plan the budget with, not a measurement."""
    from harts.config.models import get_model_config, parameter_counts
    from harts.exec.loss import DEFAULT_LM_HEAD_CHUNK_ELEMENTS
    from harts.sim.ops import StageCounter
    from harts.sim.parallel import default_parallel, stage_layers

    cfg = get_model_config(model) if isinstance(model, str) else model
    counter = StageCounter(cfg, default_parallel(cfg, 1), stage_layers(cfg, 1)[0], 8, True)
    params = parameter_counts(cfg).total
    static = params * param_bytes * 4  # weights, gradients, exp_avg, exp_avg_sq
    per_row = (counter.activation_bytes_per_token() + counter.recompute_working_bytes_per_token())
    activations = per_row * MEASURED_OVER_SIMULATED_ACTIVATIONS * microbatch_tokens
    chunk = DEFAULT_LM_HEAD_CHUNK_ELEMENTS if lm_head_chunk_elements is None else lm_head_chunk_elements
    logits = 3 * 4 * min(chunk, microbatch_tokens * cfg.vocab_size)
    return {"parameters": float(params), "static_bytes": float(static), "activation_bytes": activations,
            "lm_head_bytes": float(logits), "total_bytes": static + activations + logits,
            "unchunked_lm_head_bytes": float(3 * 4 * microbatch_tokens * cfg.vocab_size)}


def largest_fitting_budget(model: str | ModelConfig, capacity_bytes: float, param_bytes: int = 2) -> int:
    """The largest microbatch token budget (a multiple of 4096) whose `memory_plan` fits
    `capacity_bytes`; 0 if even the weights and optimizer state do not."""
    lo, hi = 0, 1 << 22
    while hi - lo > 4096:
        mid = (lo + hi) // 2 // 4096 * 4096
        if memory_plan(model, mid, param_bytes)["total_bytes"] <= capacity_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def _kda_inputs(T: int, H: int, K: int, V: int, dtype, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, K, device=device, dtype=dtype, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, device=device, generator=gen), dim=-1).to(dtype)
    v = torch.randn(T, H, V, device=device, dtype=dtype, generator=gen)
    g = (-torch.rand(T, H, K, device=device, generator=gen) * 0.2).to(dtype)
    beta = torch.rand(T, H, device=device, generator=gen).to(dtype)
    q = torch.nn.functional.normalize(q.float(), dim=-1).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def kda_op_benchmark(T: int = 32768, num_seqs: int = 16, H: int = 16, K: int = 128, V: int = 128,
                     dtype=torch.bfloat16, device: str = "cuda", num_states: int | None = None,
                     chunk_size: int = 64) -> tuple[dict, list[dict]]:
    """fla chunk_kda vs the replay path (boundary states out + their gradients in), the
    latter twice: returning all M boundary states (`ours_*`), and returning `num_states` of
    them (default: one per sequence) at random chunk boundaries (`ours_sparse_*`), the
    request a tree round makes (the states later rounds and consumers start from)."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from harts.exec.ops.kda.fla import chunk_kda_fast

    xs = _kda_inputs(T, H, K, V, dtype, device)
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, T), num_seqs - 1, replace=False))
    cu_host = torch.as_tensor(np.concatenate([[0], cuts, [T]]), dtype=torch.int64)
    cu = cu_host.to(device)
    do = torch.randn(T, H, V, device=device, dtype=dtype)
    num_boundary = int(((cu_host[1:] - cu_host[:-1]) // chunk_size).sum())
    num_states = num_seqs if num_states is None else num_states
    sparse_index = np.sort(rng.choice(num_boundary, min(num_states, num_boundary), replace=False))

    def fla_fwd():
        return fla_chunk_kda(*(x[None] for x in xs), cu_seqlens=cu, cu_seqlens_cpu=cu_host, output_final_state=True,
                             chunk_size=chunk_size)

    def fla_fb():
        o, ht = fla_fwd()
        torch.autograd.backward([o[0], ht], [do, torch.ones_like(ht)])

    def replay(index):
        def fwd():
            return chunk_kda_fast(*xs, cu_seqlens=cu_host, output_chunk_states=True, chunk_state_index=index,
                                  chunk_size=chunk_size)

        dstates = {}

        def fwdbwd():
            out = fwd()
            if "s" not in dstates:
                dstates["s"] = torch.randn_like(out.chunk_states)
            torch.autograd.backward([out.o, out.chunk_states], [do, dstates["s"]])

        return fwd, fwdbwd

    ours_fwd, ours_fb = replay(None)
    sparse_fwd, sparse_fb = replay(sparse_index)
    res = {}
    with torch.no_grad():
        res["fla_fwd_s"] = time_cuda(fla_fwd)
        res["ours_fwd_s"] = time_cuda(ours_fwd)
        res["ours_sparse_fwd_s"] = time_cuda(sparse_fwd)
    res["fla_fwdbwd_s"] = time_cuda(fla_fb)
    res["ours_fwdbwd_s"] = time_cuda(ours_fb)
    res["ours_sparse_fwdbwd_s"] = time_cuda(sparse_fb)
    res.update(tokens=T, num_seqs=num_seqs, heads=H, head_k_dim=K, head_v_dim=V, dtype=str(dtype),
               chunk_size=chunk_size, boundary_states=num_boundary, sparse_states=int(sparse_index.size))
    for who in ("fla", "ours", "ours_sparse"):
        res[f"{who}_tokens_per_s"] = T / res[f"{who}_fwdbwd_s"]
    res["ours_over_fla_per_token"] = res["ours_fwdbwd_s"] / res["fla_fwdbwd_s"]
    res["ours_sparse_over_fla_per_token"] = res["ours_sparse_fwdbwd_s"] / res["fla_fwdbwd_s"]
    max_chunks = int(((cu_host[1:] - cu_host[:-1] + chunk_size - 1) // chunk_size).max())
    prof = []
    for who in ("fla", "ours", "ours_sparse"):
        base = dict(op="kda_chunk", tokens=T, heads=H, head_k_dim=K, head_v_dim=V, max_chunks=max_chunks,
                    impl=who)
        prof.append({**base, "phase": "fwd", "seconds": res[f"{who}_fwd_s"]})
        prof.append({**base, "phase": "bwd", "seconds": res[f"{who}_fwdbwd_s"] - res[f"{who}_fwd_s"]})
    return res, prof


def attention_op_benchmark(row_end: np.ndarray, H: int = 16, qk: int = 192, vd: int = 128,
                           dtype=torch.bfloat16, device: str = "cuda") -> tuple[dict, list[dict]]:
    """FlexAttention over the DFS mask of `row_end` vs causal SDPA at the same length."""
    from harts.exec.ops.attention.causal import causal_attention
    from harts.exec.ops.attention.flex import attended_pairs, tree_attention, tree_block_mask

    R = int(row_end.size)
    end = torch.as_tensor(row_end, device=device)
    q, k = (torch.randn(R, H, qk, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(R, H, vd, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(R, H, vd, device=device, dtype=dtype)
    t0 = time.perf_counter()
    bm = tree_block_mask(end)
    _sync()
    mask_s = time.perf_counter() - t0
    scale = qk**-0.5

    def flex_fwd():
        return tree_attention(q, k, v, scale, bm)

    def flex_fb():
        flex_fwd().backward(do)

    def sdpa_fwd():
        # values zero-padded to the qk dim, so the flash kernel runs (as PackedContext does)
        return causal_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale)

    def sdpa_fb():
        sdpa_fwd().backward(do.transpose(0, 1))

    res = {"rows": R, "heads": H, "qk_dim": qk, "v_dim": vd, "block_mask_build_s": mask_s}
    with torch.no_grad():
        res["flex_fwd_s"] = time_cuda(flex_fwd)
        res["sdpa_fwd_s"] = time_cuda(sdpa_fwd)
    res["flex_fwdbwd_s"] = time_cuda(flex_fb)
    res["flex_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    res["sdpa_fwdbwd_s"] = time_cuda(sdpa_fb)
    pairs = attended_pairs(end)
    causal = R * (R + 1) // 2
    res.update(tree_pairs=pairs, causal_pairs=causal, density=pairs / (R * R))
    res["flex_over_sdpa_per_pair"] = (res["flex_fwdbwd_s"] / pairs) / (res["sdpa_fwdbwd_s"] / causal)
    prof = []
    for op, who, p in (("attention_tree", "flex", pairs), ("attention_causal", "sdpa", causal)):
        base = dict(op=op, pairs=p, heads=H, qk_dim=qk, v_dim=vd, impl=who)
        prof.append({**base, "phase": "fwd", "seconds": res[f"{who}_fwd_s"]})
        prof.append({**base, "phase": "bwd", "seconds": res[f"{who}_fwdbwd_s"] - res[f"{who}_fwd_s"]})
    return res, prof


def gemm_profile(shapes=((32768, 1536, 4096), (32768, 4096, 1536), (8192, 1536, 512), (65536, 1536, 32768)),
                 dtype=torch.bfloat16, device: str = "cuda") -> list[dict]:
    rows = []
    for m, kk, n in shapes:
        a = torch.randn(m, kk, device=device, dtype=dtype)
        b = torch.randn(kk, n, device=device, dtype=dtype)
        s = time_cuda(lambda a=a, b=b: a @ b)
        rows.append(dict(op="gemm", phase="fwd", seconds=s, m=m, k=kk, n=n, tflops=2 * m * kk * n / s / 1e12))
    return rows
