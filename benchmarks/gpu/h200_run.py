"""Device script: GPU correctness checks, per-op kernels, update-step benchmark, bf16 fidelity.

    python benchmarks/gpu/h200_run.py SECTION... --out DIR

Sections: env, kda, flex, verify, ops, step, fidelity, profile, moe, flexsweep, conv, calib,
attnprobe, attnsplit (HARTS_TREE_ATTENTION=cudnn|varlen|flex picks the tree attention of step/profile/fidelity)
(HARTS_CONV=reference runs step/profile with the gather-form short conv). Each writes DIR/<section>.json and
never stops the others (an exception is recorded in its JSON). Run `kda flex verify`
with TRITON_F32_DEFAULT=ieee (float32 dots in Triton kernels as true fp32, as the
float32 equivalence tolerance assumes); the speed sections run with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

OUT = Path(".")


def save(name: str, obj) -> None:
    (OUT / f"{name}.json").write_text(json.dumps(obj, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def parents_from_ends(end_np: np.ndarray) -> np.ndarray:
    """Local parents from DFS subtree ends: each row's nearest earlier row whose subtree covers it."""
    parent = np.full(end_np.size, -1, np.int64)
    stack: list[int] = []
    for r in range(end_np.size):
        while stack and end_np[stack[-1]] < r:
            stack.pop()
        parent[r] = stack[-1] if stack else -1
        stack.append(r)
    return parent


def ends_from_parents(par: np.ndarray) -> np.ndarray:
    """The last row of each row's subtree (DFS order), from the parents (inverse of
    `parents_from_ends`)."""
    end = np.arange(par.size, dtype=np.int64)
    for r in range(par.size - 1, 0, -1):
        p = par[r]
        if p >= 0 and end[r] > end[p]:
            end[p] = end[r]
    return end


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("inf")


def sec_env():
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(0), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT")}
    import fla

    out["fla"] = fla.__version__
    return out


def sec_kda():
    from harts.exec.ops.kda import chunk_kda as ref_kda
    from harts.exec.ops.kda.fla import chunk_kda_fast, fwd_h_config

    out = {}
    dev = "cuda"
    torch.manual_seed(0)
    lens = [64, 200, 128, 37, 320, 130]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
    T, N, H, K, V = int(cu[-1]), len(lens), 2, 64, 64
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.nn.functional.normalize(torch.randn(T, H, K, device=dev), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(T, H, K, device=dev), dim=-1)
        v = torch.randn(T, H, V, device=dev)
        g = -torch.rand(T, H, K, device=dev) * 0.3
        beta = torch.rand(T, H, device=dev)
        h0 = torch.randn(N, H, K, V, device=dev) * 0.1
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)] + [h0.clone().requires_grad_()]
        ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
        do = torch.randn(T, H, V, device=dev)
        dht = torch.randn(N, H, K, V, device=dev)
        for states in (False, True):
            r = ref_kda(*ref_leaves[:5], initial_state=ref_leaves[5], cu_seqlens=cu.to(dev), output_chunk_states=states)
            f = chunk_kda_fast(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu, output_chunk_states=states)
            outs_r, outs_f, cots = [r.o, r.final_state], [f.o, f.final_state], [do, dht]
            if states:
                ds = torch.randn_like(r.chunk_states)
                outs_r.append(r.chunk_states)
                outs_f.append(f.chunk_states)
                cots.append(ds)
            gr = torch.autograd.grad(outs_r, ref_leaves, [c.to(o.dtype) for c, o in zip(cots, outs_r, strict=True)])
            gf = torch.autograd.grad(outs_f, leaves, [c.to(o.dtype) for c, o in zip(cots, outs_f, strict=True)])
            key = f"{str(dtype)[6:]}_{'chunk_states' if states else 'plain'}"
            out[key] = {"o": rel(f.o, r.o), "final": rel(f.final_state, r.final_state),
                        **({"chunk_states": rel(f.chunk_states, r.chunk_states),
                            "offsets_equal": bool(torch.equal(f.chunk_state_offsets.cpu(), r.chunk_state_offsets.cpu()))} if states else {}),
                        **{f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), gf, gr, strict=True)}}
        # a plain call (no states handed on) of few sequences runs HARTS's own path
        # (fwd_h_config); against fla's chunk_kda itself: output, final state, every gradient
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        f = chunk_kda_fast(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu)
        fl = [x.detach().clone().requires_grad_() for x in leaves]
        o_fla, final_fla = fla_chunk_kda(*(x[None] for x in fl[:5]), scale=K**-0.5, initial_state=fl[5],
                                         output_final_state=True, cu_seqlens=cu.to(dev))
        gf = torch.autograd.grad([f.o, f.final_state], leaves, [do.to(f.o.dtype), dht])
        gl = torch.autograd.grad([o_fla[0], final_fla], fl, [do.to(o_fla.dtype), dht])
        out[f"{str(dtype)[6:]}_plain_vs_fla"] = {
            "own_path": bool(fwd_h_config(N, H, V, torch.cuda.get_device_properties(0).multi_processor_count)),
            "o_equal": bool(torch.equal(f.o, o_fla[0])), "final_equal": bool(torch.equal(f.final_state, final_fla)),
            "o": rel(f.o, o_fla[0]), "final": rel(f.final_state, final_fla),
            **{f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), gf, gl, strict=True)},
            **{f"d{n}_equal": bool(torch.equal(a, b)) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), gf, gl,
                                                                          strict=True)}}
        # bit test: split at a chunk boundary via the handed-off state == unsplit
        seq = [x.detach()[:320] for x in leaves[:5]]
        full = chunk_kda_fast(*seq, cu_seqlens=torch.tensor([0, 320]), output_chunk_states=True)
        first = chunk_kda_fast(*(x[:130] for x in seq), cu_seqlens=torch.tensor([0, 130]), output_chunk_states=True)
        s128 = first.chunk_states[1:2]
        second = chunk_kda_fast(*(x[128:] for x in seq), initial_state=s128, cu_seqlens=torch.tensor([0, 192]))
        plain = chunk_kda_fast(*seq, cu_seqlens=torch.tensor([0, 320]))
        out[f"{str(dtype)[6:]}_bit"] = {
            "split_equals_unsplit": bool(torch.equal(second.o, full.o[128:])),
            "split_max_abs": float((second.o.float() - full.o[128:].float()).abs().max()),
            "states_path_equals_fla": bool(torch.equal(full.o, plain.o)),
            "final_equal": bool(torch.equal(second.final_state, full.final_state)),
        }
    return out


def sec_flex():
    import torch.nn.functional as F

    from harts.exec.ops.attention.flex import tree_attention, tree_block_mask
    from harts.tree import build_forest
    from harts.tree.workload import generate_trajectories

    out = {}
    f = build_forest(generate_trajectories("small-treestep"))
    R = f.num_rows
    end = torch.as_tensor(f.row_end, device="cuda")
    idx = torch.arange(R, device="cuda")
    dense = (idx[None, :] <= idx[:, None]) & (idx[:, None] <= end[None, :])
    for dtype in (torch.float32, torch.bfloat16):
        H = 4
        q, k = (torch.randn(R, H, 192, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        v = torch.randn(R, H, 128, device="cuda", dtype=dtype, requires_grad=True)
        do = torch.randn(R, H, 128, device="cuda", dtype=dtype)
        bm = tree_block_mask(end)
        o = tree_attention(q, k, v, 0.07, bm)
        g = torch.autograd.grad(o, (q, k, v), do)
        qf, kf, vf = (x.detach().double().requires_grad_() for x in (q, k, v))
        orf = F.scaled_dot_product_attention(qf.transpose(0, 1), kf.transpose(0, 1), vf.transpose(0, 1),
                                             attn_mask=dense, scale=0.07).transpose(0, 1)
        gr = torch.autograd.grad(orf, (qf, kf, vf), do.double())
        out[str(dtype)[6:]] = {"rows": R, "o": rel(o, orf), **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", g, gr, strict=True)}}
        if dtype == torch.bfloat16:
            from harts.exec.ops.attention.varlen import flash_varlen, path_attention, segments_of

            seg = segments_of(f.row_parent)
            ov = path_attention(q, k, v, 0.07, seg, kernel=flash_varlen)
            gv = torch.autograd.grad(ov, (q, k, v), do)
            out["varlen_bfloat16"] = {"rows": R, "segments": seg.num_segments, "o": rel(ov, orf),
                                      **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", gv, gr, strict=True)}}
            # a subset of query rows (consumer with context rows)
            ql = np.sort(np.random.default_rng(0).choice(R, R // 2, replace=False))
            segs = segments_of(f.row_parent, ql)
            qs = q.detach()[ql].clone().requires_grad_()
            os_ = path_attention(qs, k, v, 0.07, segs, kernel=flash_varlen)
            dsub = (idx[None, :] <= torch.as_tensor(ql, device="cuda")[:, None]) & (torch.as_tensor(ql, device="cuda")[:, None] <= end[None, :])
            qsf = qs.detach().double()
            ors = F.scaled_dot_product_attention(qsf.transpose(0, 1), kf.detach().transpose(0, 1), vf.detach().transpose(0, 1),
                                                 attn_mask=dsub, scale=0.07).transpose(0, 1)
            out["varlen_bfloat16_subset"] = {"o": rel(os_, ors)}
    return out


def sec_verify():
    from harts.exec.backend import chunk_kda
    from harts.tree import build_forest
    from harts.tree.workload import generate_trajectories
    from harts.verify.equivalence import _CaptureKDA, verify_step

    out = {}
    for wl, mb in (("tiny-treestep", 1 << 20), ("small-treestep", 4096)):
        trajs = generate_trajectories(wl, seed=1)
        t0 = time.perf_counter()
        rep = verify_step(trajs, dtype=torch.float32, device="cuda", microbatch_tokens=mb, seed=2)
        rep["seconds"] = time.perf_counter() - t0
        # KDA layer, GPU path on both sides: tree rounds vs the per-trajectory packed call
        from harts.exec.model.model import build_model
        from harts.exec.tree import TreeContext

        model = build_model("tiny-cpu", seed=2, dtype=torch.float32, device="cuda")
        forest = build_forest(trajs)
        cap = _CaptureKDA(TreeContext(forest, device="cuda"))
        with torch.no_grad():
            model(torch.from_numpy(forest.token_ids).cuda(), cap)
            q, k, v, g, beta, scale = cap.captured
            rows = torch.from_numpy(forest.traj_rows).cuda()
            cu = torch.from_numpy(forest.traj_offsets)
            o_exp = chunk_kda(q[rows], k[rows], v[rows], g[rows], beta[rows], scale=scale, cu_seqlens=cu,
                              output_final_state=False).o
            gpu_layer = {}
            for mode in ("replay", "node"):
                o_tree = TreeContext(forest, kda_mode=mode, device="cuda").kda(0, q, k, v, g, beta, scale)[rows]
                gpu_layer[mode] = {"bit_identical": bool(torch.equal(o_tree, o_exp)),
                                   "max_abs_err": float((o_tree - o_exp).abs().max())}
        rep["kda_layer_gpu_both_sides"] = gpu_layer
        out[wl] = rep
    return out


def sec_attn():
    from harts.exec.bench import attention_op_benchmark
    from harts.tree.workload import generate, preset

    f = generate(preset("swe-treestep-1")).forest()
    R = 32768
    end = np.minimum(f.row_end[:R], R - 1)
    r, p = attention_op_benchmark(end)
    save("attn_profile", {"schema": "harts.sim.profile/v1", "device": torch.cuda.get_device_name(0),
                          "source": "benchmarks/gpu/h200_run.py attn", "measurements": p})
    return r


def sec_ops():
    from harts.exec.bench import attention_op_benchmark, gemm_profile, kda_op_benchmark
    from harts.tree.workload import generate, preset

    out, prof = {}, []
    # a real tree layout: the first 32k compact rows of swe-treestep-1 (DFS order, its own subtree ends)
    f = generate(preset("swe-treestep-1")).forest()
    R = 32768
    end = np.minimum(f.row_end[:R], R - 1)
    torch.cuda.reset_peak_memory_stats()
    try:
        r, p = attention_op_benchmark(end)
        out["attention_swe_treestep_32k"] = r
        prof += p
    except Exception as err:  # noqa: BLE001
        out["attention_swe_treestep_32k"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
    torch.cuda.empty_cache()
    for n in (16, 64):
        r, p = kda_op_benchmark(T=32768, num_seqs=n)
        out[f"kda_T32768_N{n}"] = r
        prof += p
        torch.cuda.empty_cache()
    prof += gemm_profile()
    out["gemm"] = [x for x in prof if x["op"] == "gemm"]
    save("h200_profile", {"schema": "harts.sim.profile/v1", "device": torch.cuda.get_device_name(0),
                          "source": "benchmarks/gpu/h200_run.py ops", "measurements": prof})
    return out


STEP_WORKLOADS = {
    # the generator's SWE calibration, one prompt group (one GPU)
    "treestep": ("swe-treestep-1", {}),
    # stepwise at full SWE shape is 8.6M expanded tokens: too long an expanded step for one
    # GPU; 1 rollout at a 24k context cap (385k expanded tokens) keeps a stepwise group's shape
    "stepwise": ("swe-stepwise-1", {"rollouts_per_group": 1, "max_context": 24576}),
}


def sec_step(args):
    from harts.config.models import get_model_config
    from harts.exec.bench import step_benchmark
    from harts.tree.workload import generate, preset

    vocab = get_model_config(args.model).vocab_size
    runs = []
    for scheme in args.schemes:
        name, over = STEP_WORKLOADS[scheme]
        trajs = generate(preset(name, vocab_size=vocab, **over)).trajectories()
        r = step_benchmark(trajs, model=args.model, microbatch_tokens=args.microbatch_tokens,
                           steps=args.steps, warmup=1)
        r.update(scheme=scheme, workload=name, overrides=over)
        runs.append(r)
        save("step", runs)
        print(f"[step] {scheme}: speedup {r.get('speedup'):.2f}x limit {r['flop_limit']:.2f}x (tokens {r['token_limit']:.2f}x) "
              f"exp {r['expanded']['seconds']:.2f}s tree {r['tree']['seconds']:.2f}s "
              f"peak exp {r['expanded_peak_bytes']/2**30:.1f} GiB tree {r['tree_peak_bytes']/2**30:.1f} GiB", flush=True)
    return runs


def sec_fidelity(args):
    from harts.config.kernels import KernelConfig
    from harts.exec.ops.attention import tree as tree_attention
    from harts.tree.workload import generate, preset
    from harts.verify.fidelity import fidelity

    trajs = generate(preset("small-treestep", vocab_size=32768, seed=3)).trajectories()
    kernels = KernelConfig.from_env()
    out = fidelity(trajs, model=args.model, dtype=torch.bfloat16, device="cuda", microbatch_tokens=1 << 16,
                   kernels=kernels)
    out["kernels"] = kernels.to_dict()
    # which attention each mode ran (the tree's graph path needs its self-checks to pass)
    out["tree_attention"] = kernels.tree_attention if kernels.tree_attention != "auto" else (
        "graph" if any(v is not None for v in tree_attention._GRAPH_STATE.values()) else "per-segment (no graph kernels)")
    out["expanded_attention"] = "graph" if kernels.baseline_attention == "graph" else "torch cuDNN SDPA per sequence"
    return out


def sec_divergence(args):
    """Where the tree's bits part from the expanded baseline's, op by op (bf16, the fidelity
    section's workload and microbatches): expanded vs tree replay, and tree replay vs no replay."""
    import dataclasses

    from harts.config.models import get_model_config
    from harts.exec.model.model import build_model
    from harts.exec.tree_trainer import TreeTrainer
    from harts.tree.workload import generate, preset
    from harts.verify.divergence import compare_runs, format_table

    trajs = generate(preset("small-treestep", vocab_size=32768, seed=3)).trajectories()
    out = {}
    # the model's RMSNorms in bf16 (as measured so far) / in float32; the two tree-vs-expanded
    # comparisons first, each saved as it lands (a time limit keeps what is done)
    runs = ((False, "expanded", "replay"), (True, "expanded", "replay"), (False, "replay", "node"),
            (False, "expanded", "expanded"))
    for norm32, a, b in runs[:1] if os.environ.get("HARTS_DIVERGENCE_QUICK") else runs:
        cfg = dataclasses.replace(get_model_config(args.model), norm_float32=norm32)
        net = build_model(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
        partition = TreeTrainer(net).partition(trajs, 1 << 16)
        t0 = time.perf_counter()
        rep = compare_runs(net, trajs, partition, a, b)
        print(f"[norm_float32={norm32}] ({time.perf_counter() - t0:.1f}s) " + format_table(rep), flush=True)
        out[f"{b}_vs_{a}" + ("_norm32" if norm32 else "")] = rep
        save("divergence", out)
        del net
    return out


def _warm_trainers(args, out: dict):
    """(mode, trainer, trajectories) for tree then expanded mode on the first --schemes
    entry's workload (default treestep), each trainer on a fresh tiny model after one
    warm-up step; records the workload in `out` and frees each model after its turn."""
    from harts.config.models import get_model_config
    from harts.exec.model.model import build_model
    from harts.exec.trainer import ExpandedTrainer
    from harts.exec.tree_trainer import TreeTrainer
    from harts.tree.workload import generate, preset

    name, over = STEP_WORKLOADS[args.schemes[0]]
    out.update(workload=name, overrides=over)
    trajs = generate(preset(name, vocab_size=get_model_config(args.model).vocab_size, **over)).trajectories()
    for mode in ("tree", "expanded"):
        net = build_model(get_model_config(args.model), seed=0, dtype=torch.bfloat16, device="cuda", recompute=True)
        trainer = (TreeTrainer if mode == "tree" else ExpandedTrainer)(net)
        trainer.step(trajs, args.microbatch_tokens)
        torch.cuda.synchronize()
        yield mode, trainer, trajs
        del trainer, net
        torch.cuda.empty_cache()


def sec_profile(args):
    """Where a step's time goes: one tree and one expanded update under torch.profiler
    (after a warm-up step), CUDA kernel time summed by kernel name, plus wall time and the
    GPU-busy share (kernel time / wall: far below 1 means the host is the bottleneck)."""
    from torch.profiler import ProfilerActivity, profile

    out = {"scheme": args.schemes[0]}
    for mode, trainer, trajs in _warm_trainers(args, out):
        prepared = trainer.prepare(trajs, args.microbatch_tokens)  # the data side ahead, as the step bench
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            t0 = time.perf_counter()
            trainer.step(trajs, args.microbatch_tokens, prepared=prepared)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        agg = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                a = agg.setdefault(e.name, [0.0, 0])
                a[0] += e.device_time / 1e6
                a[1] += 1
        busy = sum(v[0] for v in agg.values())
        # every kernel (sorted): with only the top 40 the tail (0.11 s tree / 0.32 s
        # expanded in the fourth session) lands in sim_vs_h200's "other" category, GEMMs included
        top = sorted(agg.items(), key=lambda kv: -kv[1][0])
        out[mode] = {"wall_s": wall, "kernel_s": busy, "busy_share": busy / wall,
                     "top": [{"kernel": k[:160], "seconds": v[0], "calls": v[1]} for k, v in top]}
        print(f"[profile] {mode}: wall {wall:.2f}s kernels {busy:.2f}s", flush=True)
        for k, v in top[:25]:
            print(f"   {v[0]*1e3:9.1f} ms {v[1]:6d}  {k[:110]}", flush=True)
        ops = [(e.key, e.input_shapes, e.self_device_time_total / 1e6, e.count)
               for e in prof.key_averages(group_by_input_shape=True)]
        ops = sorted(ops, key=lambda r: -r[2])[:40]
        out[mode]["top_ops"] = [{"op": a, "shapes": str(b)[:200], "seconds": c, "calls": d} for a, b, c, d in ops]
        for a, b, c, d in ops[:25]:
            print(f"   op {c*1e3:9.1f} ms {d:6d}  {a} {str(b)[:120]}", flush=True)
        del trainer  # so that the generator's cleanup frees the model before the next mode
    return out


def _site_of(e) -> str:
    """The innermost harts/ Python frame above a profiler event (the python tracer's frames
    are parent events named 'path(line): function'), else the autograd node running it."""
    p = e.cpu_parent
    while p is not None:
        if "harts/" in p.name and "(" in p.name:
            return p.name.split("harts/", 1)[-1]
        if p.name.startswith("autograd::engine::evaluate_function"):  # a built-in backward node
            return "autograd " + p.name.split(": ", 1)[-1]
        p = p.cpu_parent
    return "-"


def op_sites(events, attr: str) -> dict:
    """{(aten op, site): [seconds, calls]} of each op's self time `attr` (microseconds)."""
    agg: dict[tuple[str, str], list] = {}
    for e in events:
        t = getattr(e, attr, 0.0)
        if t <= 0 or not e.name.startswith("aten::"):
            continue
        a = agg.setdefault((e.name, _site_of(e)), [0.0, 0])
        a[0] += t / 1e6
        a[1] += 1
    return agg


def sec_opsites(args):
    """Which ops and which Python call sites spend a step's device time: one tree and one
    expanded update (data side prepared ahead, after a warm-up step) under torch.profiler
    with stacks; each op's *self* device time (the kernels it launches itself) summed by
    (op, innermost harts/ frame; "autograd" for backward nodes, which run without one).
    The copies, gathers and scatters the tree adds are what this is for."""
    from torch.profiler import ProfilerActivity, profile

    out = {"scheme": args.schemes[0]}
    for mode, trainer, trajs in _warm_trainers(args, out):
        prepared = trainer.prepare(trajs, args.microbatch_tokens)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            trainer.step(trajs, args.microbatch_tokens, prepared=prepared)
            torch.cuda.synchronize()
        agg = op_sites(prof.events(), "self_device_time_total")
        top = sorted(agg.items(), key=lambda kv: -kv[1][0])[:80]
        out[mode] = [{"op": k[0], "site": k[1][:160], "seconds": v[0], "calls": v[1]} for k, v in top]
        print(f"[opsites] {mode}: {sum(v[0] for v in agg.values()):.3f} s of self device time", flush=True)
        for k, v in top[:40]:
            print(f"   {v[0]*1e3:8.1f} ms {v[1]:5d}  {k[0][:40]:40s} {k[1][:90]}", flush=True)
        del trainer
    return out


def _gap_attribution(trace_path: str, min_gap_us: float = 10.0, top: int = 25) -> dict:
    """GPU idle gaps of a chrome trace (kernel end -> next kernel start, >= min_gap_us),
    each attributed to the innermost aten op the host was running at the gap's middle
    ("-": host Python between ops) and to the kernel that ended the gap."""
    import bisect

    ev = json.load(open(trace_path))["traceEvents"]
    kern = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in ev
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    ops = sorted((e for e in ev if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    op_ts = [e["ts"] for e in ops]
    gaps, end = [], None
    for a, b, name in kern:
        if end is not None and a - end >= min_gap_us:
            gaps.append((end, a, name))
        end = b if end is None else max(end, b)
    by_op, by_next = {}, {}
    for a, b, name in gaps:
        mid = (a + b) / 2
        j = bisect.bisect_right(op_ts, mid)
        best = None
        for e in ops[max(0, j - 300):j]:
            if e["ts"] + e.get("dur", 0) >= mid and (best is None or e.get("dur", 0) < best.get("dur", 0)):
                best = e
        for d, k in ((by_op, best["name"][:120] if best else "-"), (by_next, name[:120])):
            x = d.setdefault(k, [0.0, 0])
            x[0] += (b - a) / 1e6
            x[1] += 1
    span = (kern[-1][1] - kern[0][0]) / 1e6 if kern else 0.0
    busy = sum(b - a for a, b, _ in kern) / 1e6

    def fmt(d):
        return [{"where": k, "seconds": v[0], "gaps": v[1]} for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]]

    return {"span_s": span, "kernel_s": busy, "gap_s": sum(b - a for a, b, _ in gaps) / 1e6, "gaps": len(gaps),
            "by_op": fmt(by_op), "by_next_kernel": fmt(by_next)}


def sec_syncs(args):
    """Why the GPU idles in a step (tree and expanded, the first --schemes entry): every synchronising
    CUDA call of one step with the Python stack that made it (torch's sync debug mode), and
    the step's GPU idle gaps attributed to the host op running during them and the kernel
    ending them (under the profiler host times are inflated: read the shares)."""
    import traceback as tb
    import warnings

    from torch.profiler import ProfilerActivity, profile

    out = {"scheme": args.schemes[0]}
    for mode, trainer, trajs in _warm_trainers(args, out):
        sites = {}
        orig = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None, sites=sites):
            frames = [f for f in tb.extract_stack()[:-1] if ("harts/" in f.filename or "/fla/" in f.filename)]
            where = " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/work/')[-1]}:{f.lineno}"
                                for f in frames[-3:][::-1]) or f"{filename}:{lineno}"
            x = sites.setdefault(where, [0, str(message)[:80]])
            x[0] += 1

        warnings.showwarning = record
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    prepared = trainer.prepare(trajs, args.microbatch_tokens)
                    n_prep = sum(v[0] for v in sites.values())
                    trainer.step(trajs, args.microbatch_tokens, prepared=prepared)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
        finally:
            warnings.showwarning = orig
        torch.cuda.synchronize()
        total = sum(v[0] for v in sites.values())
        res = {"syncs_in_step": total - n_prep, "syncs_in_prepare": n_prep,
               "sites": [{"where": k, "count": v[0], "message": v[1]} for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])[:40]]}
        print(f"[syncs] {mode}: {total - n_prep} syncs in the step, {n_prep} in prepare", flush=True)
        for r in res["sites"][:20]:
            print(f"   {r['count']:5d}  {r['where']}", flush=True)
        for label, use_prepared in (("prefetched", True), ("inline", False)):
            prepared = trainer.prepare(trajs, args.microbatch_tokens) if use_prepared else None
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                trainer.step(trajs, args.microbatch_tokens, prepared=prepared)
                torch.cuda.synchronize()
            path = f"/tmp/trace_{mode}_{label}.json"
            prof.export_chrome_trace(path)
            res[f"gaps_{label}"] = g = _gap_attribution(path)
            print(f"[gaps] {mode} {label}: span {g['span_s']:.3f}s kernels {g['kernel_s']:.3f}s gaps {g['gap_s']:.3f}s "
                  f"in {g['gaps']}", flush=True)
            for r in g["by_op"][:12]:
                print(f"   op {r['seconds']*1e3:8.1f} ms {r['gaps']:5d}  {r['where']}", flush=True)
            for r in g["by_next_kernel"][:10]:
                print(f"   next {r['seconds']*1e3:8.1f} ms {r['gaps']:5d}  {r['where']}", flush=True)
        out[mode] = res
        del trainer  # so that the generator's cleanup frees the model before the next mode
    return out


def sec_kdaops():
    """fla chunk_kda vs the tree path's replay call (all boundary states, and a sparse
    request) on the same packed tokens, forward+backward, with autotuning (both sides)."""
    from harts.exec.bench import kda_op_benchmark

    out = {}
    for n in (16, 64):
        r, _ = kda_op_benchmark(T=32768, num_seqs=n)
        out[f"kda_T32768_N{n}"] = r
        print(f"[kdaops] N={n}: fla {r['fla_fwdbwd_s']*1e3:.2f} ms ours {r['ours_fwdbwd_s']*1e3:.2f} "
              f"sparse {r['ours_sparse_fwdbwd_s']*1e3:.2f} -> {r['ours_over_fla_per_token']:.3f}x / "
              f"{r['ours_sparse_over_fla_per_token']:.3f}x", flush=True)
        torch.cuda.empty_cache()
    return out


def sec_moe():
    """One MoE layer of tiny-h200 (D 1536, 64 experts top-8, F 512) forward+backward on
    82k rows: the per-expert loop vs grouped_mm; plus the grouped output vs the loop."""
    from harts.exec.bench import time_cuda
    from harts.exec.model.moe import experts_grouped, experts_loop

    T, D, E, k, F_ = 81920, 1536, 64, 8, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    scores = torch.randn(T, E, device="cuda", generator=g)
    top_s, top_i = torch.topk(scores.sigmoid(), k, dim=-1)
    top_w = (top_s / top_s.sum(-1, keepdim=True)).bfloat16().requires_grad_()
    ws = [(torch.randn(*shp, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
          for shp in ((E, F_, D), (E, F_, D), (E, D, F_))]
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    out = {"rows": T}
    for name, fn in (("loop", experts_loop), ("grouped", experts_grouped)):
        with torch.no_grad():
            out[f"{name}_fwd_s"] = time_cuda(lambda fn=fn: fn(x, top_i, top_w, *ws), repeats=5, warmup=2)
        out[f"{name}_fwdbwd_s"] = time_cuda(lambda fn=fn: fn(x, top_i, top_w, *ws).backward(dy), repeats=5, warmup=2)
    flops = 2 * T * k * D * F_ * 3
    out["grouped_fwd_tflops"] = flops / out["grouped_fwd_s"] / 1e12
    out["grouped_fwdbwd_tflops"] = 3 * flops / out["grouped_fwdbwd_s"] / 1e12
    with torch.no_grad():
        ref = experts_loop(x.float(), top_i, top_w.float(), *(w.float() for w in ws))
        out["grouped_vs_fp32_loop_rel"] = rel(experts_grouped(x, top_i, top_w, *ws), ref)
        out["loop_bf16_vs_fp32_loop_rel"] = rel(experts_loop(x, top_i, top_w, *ws), ref)
    return out


FLEX_VARIANTS = {
    # measured 2026-11-29 (docs/LOG.md): forward BLOCK_M 128 / BLOCK_N 64 / 8 warps is 19%
    # faster; no backward config that fits shared memory beats the default at qk 192
    "default": None,
    "f128x64w8s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3},
}


def sec_flexsweep(args):
    """FlexAttention kernel options on the issue's shape (32k rows, 16 heads, qk 192 / v 128)
    over two real tree layouts (a chain-like and a bushy one), each vs causal SDPA per
    attended pair. Each variant compiles its own kernels; a failing one is recorded."""
    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention.causal import causal_attention
    from harts.exec.ops.attention.flex import attended_pairs, tree_attention, tree_block_mask
    from harts.tree.workload import generate, preset

    R, H, qk, vd = 32768, 16, 192, 128
    layouts = {}
    f = generate(preset("swe-treestep-1")).forest()
    layouts["treestep_first32k"] = np.minimum(f.row_end[:R], R - 1)
    # a bushier layout: the first 32k rows of a small-tree workload (many groups, short rows)
    f2 = generate(preset("small-treestep")).forest()
    ends, off = [], 0
    while off < R:
        ends.append(f2.row_end + off)
        off += f2.num_rows
    layouts["small_treestep_tiled"] = np.minimum(np.concatenate(ends)[:R], R - 1)
    q, k = (torch.randn(R, H, qk, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(R, H, vd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(R, H, vd, device="cuda", dtype=torch.bfloat16)
    scale = qk ** -0.5
    out = {}
    sdpa = time_cuda(lambda: causal_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale)
                     .backward(do.transpose(0, 1)), repeats=10)
    causal = R * (R + 1) // 2
    out["sdpa_fwdbwd_s"] = sdpa
    for lname, end_np in layouts.items():
        end = torch.as_tensor(end_np, device="cuda")
        bm = tree_block_mask(end)
        pairs = attended_pairs(end)
        res = {"pairs": pairs, "density": pairs / R / R}
        from harts.exec.ops.attention.varlen import flash_varlen, path_attention, segments_of

        seg = segments_of(parents_from_ends(end_np))
        keys = torch.as_tensor(seg.key_rows, device="cuda")
        t = time_cuda(lambda seg=seg, keys=keys: path_attention(q, k, v, scale, seg, kernel=flash_varlen,
                                                                key_rows=keys).backward(do), repeats=10)
        with torch.no_grad():
            tf = time_cuda(lambda seg=seg, keys=keys: path_attention(q, k, v, scale, seg, kernel=flash_varlen,
                                                                     key_rows=keys), repeats=10)
        res["varlen"] = {"fwdbwd_s": t, "fwd_s": tf, "segments": seg.num_segments, "gathered_keys": int(seg.key_rows.size),
                         "per_pair_vs_sdpa": (t / pairs) / (sdpa / causal)}
        print(f"[flexsweep] {lname} varlen: {res['varlen']}", flush=True)
        for vname, opts in FLEX_VARIANTS.items():
            try:
                t = time_cuda(lambda opts=opts, bm=bm: tree_attention(q, k, v, scale, bm, kernel_options=opts).backward(do),
                              repeats=10)
                with torch.no_grad():
                    tf = time_cuda(lambda opts=opts, bm=bm: tree_attention(q, k, v, scale, bm, kernel_options=opts),
                                   repeats=10)
                res[vname] = {"fwdbwd_s": t, "fwd_s": tf, "per_pair_vs_sdpa": (t / pairs) / (sdpa / causal)}
            except Exception as err:  # noqa: BLE001
                res[vname] = {"error": f"{type(err).__name__}: {err}"[:500]}
            print(f"[flexsweep] {lname} {vname}: {res[vname]}", flush=True)
        out[lname] = res
    return out


def _conv_inputs():
    """A KDA layer's short conv on swe-treestep-1's tree (82k rows x 2048 channels, window
    4, bf16): (window, x, weight, bias, dy), the leaves requiring grad."""
    from harts.exec.ops.conv import window_from_parents
    from harts.tree.workload import generate, preset

    f = generate(preset("swe-treestep-1")).forest()
    win = window_from_parents(torch.as_tensor(f.row_parent), 4).cuda()
    T, D = f.num_rows, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(D, 4, device="cuda", generator=g) * 0.3).bfloat16().requires_grad_()
    b = (torch.randn(D, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    return win, x, w, b, dy


def sec_conv():
    """The short conv of a KDA layer (q/k/v: 16 x 128 channels, window 4) on 82k rows of a
    real tree layout, bf16, forward+backward: gather-form reference vs the fused Triton
    kernels (the default on CUDA); the fused output and every gradient against the
    reference in fp32; the fused backward run twice (bit-identical: no atomics)."""
    from harts.exec.bench import time_cuda
    from harts.exec.ops.conv import short_conv
    from harts.exec.ops.conv.triton import short_conv_fused

    win, x, w, b, dy = _conv_inputs()
    T, D = x.shape
    out = {"rows": T, "channels": D}
    for name, fn in (("reference", short_conv), ("fused", short_conv_fused)):
        with torch.no_grad():
            out[f"{name}_fwd_s"] = time_cuda(lambda fn=fn: fn(x, w, b, window_TW=win), repeats=10)
        out[f"{name}_fwdbwd_s"] = time_cuda(lambda fn=fn: fn(x, w, b, window_TW=win).backward(dy), repeats=10)
        y = fn(x, w, b, window_TW=win)
        out[f"{name}_bwd_s"] = time_cuda(lambda y=y: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
                                         repeats=10)
    leaves = [t.detach().float().requires_grad_() for t in (x, w, b)]
    ref_y = short_conv(*leaves, window_TW=win)
    ref = [ref_y.detach(), *torch.autograd.grad(ref_y, leaves, dy.float())]
    y = short_conv_fused(x, w, b, window_TW=win)
    got = [y.detach(), *torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)]
    again = torch.autograd.grad(y, (x, w, b), dy)
    for name, a, r in zip(("y", "dx", "dw", "db"), got, ref, strict=True):
        out[f"fused_vs_fp32_reference_rel_{name}"] = rel(a, r)
    out["fused_backward_rerun_bit_identical"] = all(torch.equal(a, c) for a, c in zip(got[1:], again, strict=True))
    print(f"[conv] {out}", flush=True)
    return out


def sec_convtiles():
    """The fused conv's backward (82k tree rows x 2048 channels, window 4, bf16, with bias)
    under tile overrides (HARTS_CONV_BWD_TILES = BD, BT_g, NSUB, warps_g, BT_dx, warps_dx):
    ms per backward, and dx / dW against the default's (dx's per-row order does not depend
    on the tiles: equal bits expected)."""
    from harts.config.kernels import parse_ints
    from harts.exec.bench import time_cuda
    from harts.exec.ops.conv.triton import short_conv_fused

    win, x, w, b, dy = _conv_inputs()
    T, D = x.shape
    configs = ["default", "128,32,8,8,32,4", "128,64,4,8,32,4", "128,16,16,4,32,4", "128,16,16,2,32,4",
               "64,32,8,4,32,4", "256,32,8,8,32,4", "128,32,16,4,32,4", "128,32,4,4,32,4", "64,64,8,8,32,4",
               "128,32,8,4,64,8", "128,32,8,4,16,4", "128,32,8,4,32,8", "128,32,8,4,32,2", "64,32,8,4,64,4",
               "256,32,8,4,32,8", "64,16,16,2,16,2"]
    out = {"rows": T, "channels": D}
    ref = None
    for c in configs:
        tiles = None if c == "default" else parse_ints(c, 6, "conv_bwd_tiles")
        try:
            y = short_conv_fused(x, w, b, window_TW=win, bwd_tiles=tiles)
            grads = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
            if ref is None:
                ref = grads
            res = {"bwd_ms": 1e3 * time_cuda(lambda y=y: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
                                             repeats=10),
                   "dx_equal": bool(torch.equal(grads[0], ref[0])), "dw_rel": rel(grads[1], ref[1])}
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}"[:300]}
        out[c] = res
        print(f"[convtiles] {c}: {res}", flush=True)
    return out


def sec_fwdhbv():
    """fla's forward state kernel (chunk_gated_delta_rule_fwd_kernel_h_blockdim64, fp32
    state history as the tree path writes it) at the shapes of a tree's rounds (1-3 long
    sequences) and of packed batches (16), with fla's own launch (the first config under
    --no-autotune) and explicit configs BV x warps x stages through `harts.exec.ops.kda.fla._fwd_h`
    (HARTS_FWD_H); outputs compared with fla's launch (16 heads, K = V = 128, bf16, chunk 64)."""
    from fla.ops.utils import prepare_chunk_offsets

    from harts.config.kernels import KernelConfig
    from harts.exec.bench import time_cuda
    from harts.exec.ops.kda.fla import _fla, _fwd_h, fwd_h_config

    f = _fla()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"sms": sms}
    H, K, V, B = 16, 128, 128, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    configs = ["fla"] + [f"{bv},{nw},{ns}" for bv in (16, 32, 64) for nw in (2, 4) for ns in (2, 3)]
    for lens in ([38727], [32524, 10020], [26845, 9078, 672], [2048] * 16):
        T = sum(lens)
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], device="cuda", dtype=torch.int64)
        offs = prepare_chunk_offsets(cu, B)
        NT = int(offs[-1])
        mk = lambda *shape: (torch.randn(*shape, device="cuda", generator=g) * 0.1).bfloat16()  # noqa: E731
        kg, w, u = mk(1, T, H, K), mk(1, T, H, K), mk(1, T, H, V)
        gk = -(torch.rand(1, T, H, K, device="cuda", generator=g) * 0.02).cumsum(1).float()
        h0 = torch.randn(len(lens), H, K, V, device="cuda", generator=g) * 0.1
        res = {"tokens": T, "sequences": len(lens), "default_rule": str(fwd_h_config(len(lens), H, V, sms))}
        ref = None
        for c in configs:
            kernels = KernelConfig(kda_fwd_h=c)
            run = lambda: _fwd_h(f, kg, w, u, gk, h0, cu, offs, NT, B, h_dtype=torch.float32,  # noqa: E731, B023
                                 with_final=True, kernels=kernels)  # noqa: B023
            try:
                o = run()
                if ref is None:
                    ref = o
                err = max(rel(a, r) for a, r in zip(o, ref, strict=True))
                res[c] = {"ms": 1e3 * time_cuda(run, repeats=10), "rel_vs_fla": err}
            except Exception as e:  # noqa: BLE001
                res[c] = {"error": f"{type(e).__name__}: {e}"[:300]}
        out["x".join(map(str, lens)) if len(set(lens)) > 1 else f"{len(lens)}x{lens[0]}"] = res
        print(f"[fwdhbv] {lens}: {res}", flush=True)
    return out


def sec_attnprobe():
    """Attention entry points at the issue's shape (32k rows, 16 heads, qk 192 / v 128,
    causal, bf16, forward+backward): SDPA under each backend with values at their own dim
    and zero-padded to the qk dim; torch's varlen flash on one sequence (padded values, as
    the tree path runs it) and with unpadded values; and whether cuDNN over jagged nested
    tensors aligns causal masks bottom-right when a sequence has fewer queries than keys
    (what the tree path needs), checked against the dense reference on a small case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention.varlen import flash_varlen, reference_varlen

    R, H, qk, vd = 32768, 16, 192, 128
    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, H, R, qk, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(1, H, R, vd, device="cuda", generator=g).bfloat16().requires_grad_()
    do = torch.randn(1, H, R, vd, device="cuda", generator=g).bfloat16()
    scale = qk ** -0.5
    out = {"shape": {"rows": R, "heads": H, "qk": qk, "v": vd}}

    def sdpa(pad):
        vv = F.pad(v, (0, qk - vd)) if pad else v
        return F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=scale)[..., :vd]

    ref = None
    for bname in ("default", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        for pad in (False, True):
            key = f"sdpa_{bname.lower()}_{'padded' if pad else 'v128'}"
            try:
                ctx = sdpa_kernel(getattr(SDPBackend, bname)) if bname != "default" else torch.enable_grad()
                with ctx:
                    with torch.no_grad():
                        o = sdpa(pad)
                        if ref is None:
                            ref = o.float()
                        err = rel(o, ref)
                        fwd = time_cuda(lambda pad=pad: sdpa(pad), repeats=5)
                    fb = time_cuda(lambda pad=pad: sdpa(pad).backward(do), repeats=5)
                out[key] = {"fwd_s": fwd, "fwdbwd_s": fb, "rel_vs_first": err}
            except Exception as err:  # noqa: BLE001
                out[key] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print(f"[attnprobe] {key}: {out[key]}", flush=True)
    qt, kt, vt = (x[0].transpose(0, 1).detach().requires_grad_() for x in (q, k, v))
    dot = do[0].transpose(0, 1)
    cu = np.array([0, R], np.int64)
    for pad in (True, False):
        key = f"varlen_flash_{'padded' if pad else 'v128'}"
        try:
            def fn(pad=pad):
                vv = F.pad(vt, (0, qk - vd)) if pad else vt
                return flash_varlen(qt, kt, vv, cu, cu, R, R, scale)[..., :vd]
            with torch.no_grad():
                fwd = time_cuda(fn, repeats=5)
            fb = time_cuda(lambda: fn().backward(dot), repeats=5)
            out[key] = {"fwd_s": fwd, "fwdbwd_s": fb}
        except Exception as err:  # noqa: BLE001
            out[key] = {"error": f"{type(err).__name__}: {err}"[:300]}
        print(f"[attnprobe] {key}: {out[key]}", flush=True)
    # cuDNN over jagged nested tensors: fewer queries than keys per sequence
    try:
        n, m = [5, 70, 33], [9, 130, 33]
        qs = [torch.randn(a, H, qk, device="cuda", dtype=torch.bfloat16) for a in n]
        ks = [torch.randn(b, H, qk, device="cuda", dtype=torch.bfloat16) for b in m]
        vs = [torch.randn(b, H, vd, device="cuda", dtype=torch.bfloat16) for b in m]
        cq, ck = np.r_[0, np.cumsum(n)], np.r_[0, np.cumsum(m)]
        want = reference_varlen(torch.cat(qs).double(), torch.cat(ks).double(), torch.cat(vs).double(), cq, ck,
                                max(n), max(m), scale)
        res = {}
        for bname in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                nq, nk, nv = (torch.nested.nested_tensor(list(x), layout=torch.jagged).transpose(1, 2)
                              for x in (qs, ks, vs))
                with sdpa_kernel(getattr(SDPBackend, bname)):
                    o = F.scaled_dot_product_attention(nq, nk, nv, is_causal=True, scale=scale)
                got = torch.cat(list(o.transpose(1, 2).unbind()))
                res[bname] = {"rel_vs_bottom_right": rel(got, want)}
            except Exception as err:  # noqa: BLE001
                res[bname] = {"error": f"{type(err).__name__}: {err}"[:300]}
        out["jagged_causal_alignment"] = res
    except Exception as err:  # noqa: BLE001
        out["jagged_causal_alignment"] = {"error": f"{type(err).__name__}: {err}"[:300]}
    print(f"[attnprobe] jagged: {out['jagged_causal_alignment']}", flush=True)
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    out["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    for op in ("_cudnn_attention_forward", "_cudnn_attention_backward", "_flash_attention_forward",
               "_flash_attention_backward"):
        try:
            out[f"schema_{op}"] = str(getattr(torch.ops.aten, op).default._schema)
        except Exception as err:  # noqa: BLE001
            out[f"schema_{op}"] = f"{type(err).__name__}: {err}"[:200]
    return out


def _attention_bench(f, H: int, qk: int, vd: int, scale: float):
    """Inputs of the tree-attention speed sections: bf16 q, k, v (3 x 32k rows, grads on) and
    dO, causal cuDNN SDPA's forward+backward seconds on 32k rows (the issue's baseline) and
    per attended pair, and three layouts (parents): the first 32k rows of forest `f` (one
    chain), all of `f`, and small-treestep tiled to 32k rows (bushy)."""
    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention.causal import causal_attention
    from harts.tree.workload import generate, preset

    R32 = 32768
    qkv = [torch.randn(R32 * 3, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for d in (qk, qk, vd)]
    do = torch.randn(R32 * 3, H, vd, device="cuda", dtype=torch.bfloat16)
    hf = [x[:R32].detach().transpose(0, 1).requires_grad_() for x in qkv]
    sdpa = time_cuda(lambda: causal_attention(*hf, scale).backward(do[:R32].transpose(0, 1)), repeats=10)
    layouts = {"treestep_first32k": parents_from_ends(np.minimum(f.row_end[:R32], R32 - 1)),
               "swe_treestep_1_all": f.row_parent}
    f2 = generate(preset("small-treestep")).forest()
    ends, off = [], 0
    while off < R32:
        ends.append(f2.row_end + off)
        off += f2.num_rows
    layouts["small_treestep_tiled"] = parents_from_ends(np.minimum(np.concatenate(ends)[:R32], R32 - 1))
    return qkv, do, sdpa, sdpa / (R32 * (R32 + 1) // 2), layouts


def _layout_case(par: np.ndarray, qkv, device="cuda"):
    """One attention layout's pieces for the speed sections: (rows, query segments, their
    split, its device index, gathered key rows, attended pairs, fresh leaf q/k/v of the
    layout's rows)."""
    from harts.exec.ops.attention.split import device_index, split_segments
    from harts.exec.ops.attention.varlen import segments_of

    seg = segments_of(par)
    sp = split_segments(seg, True)
    ins = [x[:par.size].detach().requires_grad_() for x in qkv]
    return (int(par.size), seg, sp, device_index(sp, device), torch.as_tensor(seg.key_rows, device=device),
            seg.attended_pairs, ins)


def sec_attnsplit():
    """The cuDNN split tree attention (harts.exec.ops.attention.split): its self-check, bf16
    accuracy against float64 on a real layout (all rows and a query subset) next to the
    varlen flash path, and forward+backward time on three layouts at 16 heads, qk 192 / v
    128, per attended pair against causal cuDNN SDPA on 32k rows (the issue's baseline)."""
    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention.split import (
        cudnn_kernel,
        split_attention,
        split_segments,
    )
    from harts.exec.ops.attention.varlen import (
        flash_varlen,
        path_attention,
        reference_varlen,
        segments_of,
    )
    from harts.tree.workload import generate, preset

    out = {}
    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    kern = cudnn_kernel(qk, vd)
    out["self_check"] = {"kernel": kern.name, "lse_layout": getattr(kern, "lse_layout", None)}
    print(f"[attnsplit] self-check ok: {out['self_check']}", flush=True)
    f = generate(preset("swe-treestep-1")).forest()

    # accuracy: the first 6000 rows of swe-treestep-1 cut into a forked layout
    R = 6000
    parent = np.where(f.row_parent[:R] < R, f.row_parent[:R], -1)
    g = torch.Generator(device="cuda").manual_seed(0)
    # "subset": a consumer's queries, the rows from R/2 on (their ancestors above are context)
    for qname, q_local in (("all", None), ("subset", np.arange(R // 2, R))):
        seg = segments_of(parent, q_local)
        nq = R if q_local is None else q_local.size
        q = torch.randn(nq, 4, qk, device="cuda", generator=g)
        k = torch.randn(R, 4, qk, device="cuda", generator=g)
        v = torch.randn(R, 4, vd, device="cuda", generator=g)
        do = torch.randn(nq, 4, vd, device="cuda", generator=g)
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        o_ref = path_attention(*ref_in, scale, seg, kernel=reference_varlen)
        ref = [o_ref.detach()] + list(torch.autograd.grad(o_ref, ref_in, do.double()))
        res = {}
        sp = split_segments(seg, q_local is None)
        for name, fn in (("cudnn_split", lambda a, b, c, sp=sp: split_attention(a, b, c, scale, sp, kernel=kern)),
                         ("varlen_flash", lambda a, b, c, seg=seg: path_attention(a, b, c, scale, seg,
                                                                                  kernel=flash_varlen))):
            ins = [x.bfloat16().requires_grad_() for x in (q, k, v)]
            o = fn(*ins)
            got = [o.detach()] + list(torch.autograd.grad(o, ins, do.bfloat16()))
            res[name] = {n: rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref, strict=True)}
        out[f"accuracy_{qname}"] = res
        print(f"[attnsplit] accuracy {qname}: {res}", flush=True)
    # speed
    qkv, do, sdpa, per_pair_sdpa, layouts = _attention_bench(f, H, qk, vd, scale)
    out["sdpa_causal_32k_fwdbwd_s"] = sdpa
    for lname, par in layouts.items():
        R_, seg, sp, idx, keys, pairs, ins = _layout_case(par, qkv)
        res = {"rows": R_, "pairs": pairs, "segments": seg.num_segments, "gathered_keys_varlen": int(seg.key_rows.size),
               "gathered_keys_split": int(sp.anc_rows.size)}
        def split_fn(ins=ins, sp=sp, idx=idx):
            return split_attention(*ins, scale, sp, kernel=kern, idx=idx)

        def varlen_fn(ins=ins, seg=seg, keys=keys):
            return path_attention(*ins, scale, seg, kernel=flash_varlen, key_rows=keys)

        for name, fn in (("cudnn_split", split_fn), ("varlen_flash", varlen_fn)):
            try:
                with torch.no_grad():
                    fwd = time_cuda(fn, repeats=5)
                fb = time_cuda(lambda fn=fn, dR=do[:R_]: fn().backward(dR), repeats=5)
                res[name] = {"fwd_s": fwd, "fwdbwd_s": fb, "per_pair_vs_sdpa": fb / pairs / per_pair_sdpa}
            except Exception as err:  # noqa: BLE001
                res[name] = {"error": f"{type(err).__name__}: {err}"[:400]}
        out[lname] = res
        print(f"[attnsplit] {lname}: {res}", flush=True)
    return out


def sec_attngraph():
    """Tree attention on cuDNN's graph API (`harts.exec.ops.attention.cudnn_graph`, one call for all
    segments each way): the kernels' self-checks (top-left for the split, bottom-right for
    the whole-path layout), bf16 accuracy against float64 on a forked 6000-row layout, and
    forward+backward per attended pair against causal cuDNN SDPA on 32k rows on the three
    layouts of `attnsplit`, next to the per-segment dense split (the current default) and
    varlen flash. Graph builds are counted and kept out of the timings (warm-up)."""
    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention import cudnn_graph
    from harts.exec.ops.attention.split import (
        cudnn_kernel,
        split_attention,
        split_segments,
    )
    from harts.exec.ops.attention.varlen import (
        flash_varlen,
        path_attention,
        reference_varlen,
        segments_of,
    )
    from harts.tree.workload import generate, preset

    out = {"frontend": None}
    try:
        import cudnn

        out["frontend"] = {"version": getattr(cudnn, "__version__", "?"), "backend": cudnn.backend_version()}
    except Exception as err:  # noqa: BLE001
        out["frontend"] = f"{type(err).__name__}: {err}"[:300]
    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    kerns = {"dense": cudnn_kernel(qk, vd)}
    for variant in ("graph", "graph-nondet"):
        try:
            kerns[variant] = cudnn_kernel(qk, vd, variant)
            out[f"self_check_{variant}"] = {"ok": True, "name": kerns[variant].name, "factor": kerns[variant].factor}
        except Exception as err:  # noqa: BLE001
            out[f"self_check_{variant}"] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:600],
                                            "traceback": traceback.format_exc()[-1500:]}
        print(f"[attngraph] self-check {variant}: {out[f'self_check_{variant}']}", flush=True)
    br = None
    try:
        br = cudnn_graph.check_bottom_right(cudnn_graph.setup(qk, vd, bottom_right=True), qk, vd)
        out["self_check_bottom_right"] = {"ok": True, "name": br.name}
    except Exception as err:  # noqa: BLE001
        out["self_check_bottom_right"] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:600],
                                          "traceback": traceback.format_exc()[-1500:]}
    print(f"[attngraph] self-check bottom-right: {out['self_check_bottom_right']}", flush=True)
    f = generate(preset("swe-treestep-1")).forest()
    # accuracy on a forked 6000-row layout, all rows as queries
    R = 6000
    parent = np.where(f.row_parent[:R] < R, f.row_parent[:R], -1)
    seg = segments_of(parent)
    sp = split_segments(seg, True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(R, 4, qk, device="cuda", generator=g)
    k = torch.randn(R, 4, qk, device="cuda", generator=g)
    v = torch.randn(R, 4, vd, device="cuda", generator=g)
    do = torch.randn(R, 4, vd, device="cuda", generator=g)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    o_ref = path_attention(*ref_in, scale, seg, kernel=reference_varlen)
    ref = [o_ref.detach()] + list(torch.autograd.grad(o_ref, ref_in, do.double()))
    fns = {n: (lambda a, b, c, kk=kk: split_attention(a, b, c, scale, sp, kernel=kk)) for n, kk in kerns.items()}
    if br is not None:
        fns["graph_path"] = lambda a, b, c: path_attention(a, b, c, scale, seg, kernel=cudnn_graph.varlen_fn(br))
    acc = {}
    for name, fn in fns.items():
        ins = [x.bfloat16().requires_grad_() for x in (q, k, v)]
        o = fn(*ins)
        got = [o.detach()] + list(torch.autograd.grad(o, ins, do.bfloat16()))
        acc[name] = {n: rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref, strict=True)}
        if name == "graph":  # run-to-run: a second run's bits
            o2 = fn(*ins)
            got2 = [o2.detach()] + list(torch.autograd.grad(o2, ins, do.bfloat16()))
            acc[name]["rerun_identical"] = all(torch.equal(a, b) for a, b in zip(got, got2, strict=True))
    out["accuracy_all"] = acc
    print(f"[attngraph] accuracy: {acc}", flush=True)
    # speed
    qkv, dO, sdpa, per_pair_sdpa, layouts = _attention_bench(f, H, qk, vd, scale)
    out["sdpa_causal_32k_fwdbwd_s"] = sdpa
    for lname, par in layouts.items():
        R_, seg, sp, idx, keys, pairs, ins = _layout_case(par, qkv)
        res = {"rows": R_, "pairs": pairs, "segments": seg.num_segments, "max_q": seg.max_q}
        fns = {f"split_{n_}": (lambda kk=kk, ins=ins, sp=sp, idx=idx: split_attention(*ins, scale, sp, kernel=kk, idx=idx))
               for n_, kk in kerns.items()}
        fns["varlen_flash"] = lambda ins=ins, seg=seg, keys=keys: path_attention(*ins, scale, seg, kernel=flash_varlen,
                                                                                  key_rows=keys)
        if br is not None:
            fns["graph_path"] = lambda ins=ins, seg=seg, keys=keys: path_attention(
                *ins, scale, seg, kernel=cudnn_graph.varlen_fn(br), key_rows=keys)
        for name, fn in fns.items():
            try:
                fn().backward(dO[:R_])  # warm-up: builds this layout's graphs
                torch.cuda.synchronize()
                with torch.no_grad():
                    fwd = time_cuda(fn, repeats=5)
                fb = time_cuda(lambda fn=fn, dR=dO[:R_]: fn().backward(dR), repeats=5)
                t0 = time.perf_counter()
                fn().backward(dO[:R_])
                host = time.perf_counter() - t0  # launch time (the GPU may still be running)
                torch.cuda.synchronize()
                res[name] = {"fwd_s": fwd, "fwdbwd_s": fb, "per_pair_vs_sdpa": fb / pairs / per_pair_sdpa,
                             "host_s": host}
            except Exception as err:  # noqa: BLE001
                res[name] = {"error": f"{type(err).__name__}: {err}"[:400]}
        res["graph_builds"] = {n_: getattr(getattr(kk, "cache", None), "builds", None) for n_, kk in kerns.items()}
        out[lname] = res
        print(f"[attngraph] {lname}: {res}", flush=True)
    return out


def sec_attnbits():
    """Can the tree's attention give the expanded baseline's bits? small-treestep (12k tree
    rows, 16 trajectories, 38k expanded rows), bf16, 16 heads, qk 192 / v 128: each tree
    row's output against the output of the same (trajectory, position) in the expanded
    runs, per tree path x expanded path: fraction of bit-identical rows and the largest
    difference. Tree paths: the per-segment dense cuDNN split (the default), the split on
    cuDNN graphs, one bottom-right graph call over gathered root-to-row paths; expanded:
    torch's cuDNN SDPA per trajectory (the baseline) and one top-left graph call over all
    trajectories. Then the bottom-right graph path's speed without the deterministic flag."""
    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention import cudnn_graph
    from harts.exec.ops.attention.causal import causal_attention
    from harts.exec.ops.attention.split import (
        cudnn_kernel,
        device_index,
        split_attention,
        split_segments,
    )
    from harts.exec.ops.attention.varlen import path_attention, segments_of
    from harts.tree.workload import generate, preset

    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    f = generate(preset("small-treestep")).forest()
    par = f.row_parent
    L = par.size
    isparent = np.zeros(L, bool)
    isparent[par[par >= 0]] = True
    paths = []
    for leaf in np.flatnonzero(~isparent):
        p, r = [], int(leaf)
        while r >= 0:
            p.append(r)
            r = int(par[r])
        paths.append(np.array(p[::-1], np.int64))
    exp_rows = torch.as_tensor(np.concatenate(paths), device="cuda")
    cu_e = np.r_[0, np.cumsum([p.size for p in paths])].astype(np.int64)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(L, H, qk, device="cuda", generator=g).bfloat16() for _ in range(2))
    v = torch.randn(L, H, vd, device="cuda", generator=g).bfloat16()
    out = {"tree_rows": L, "trajectories": len(paths), "expanded_rows": int(cu_e[-1])}
    qe, ke, ve = (x.index_select(0, exp_rows) for x in (q, k, v))
    exp = {}
    br = cudnn_graph.check_bottom_right(cudnn_graph.setup(qk, vd, bottom_right=True, deterministic=False), qk, vd)
    with torch.no_grad():
        exp["sdpa_per_trajectory"] = torch.cat([causal_attention(*(x[a:b].transpose(0, 1) for x in (qe, ke, ve)),
                                                                 scale).transpose(0, 1)
                                                for a, b in zip(cu_e[:-1], cu_e[1:], strict=True)])
        kern_tl = cudnn_kernel(qk, vd, "graph-nondet")
        exp["graph_one_call"] = kern_tl.fwd(qe, ke, ve, cu_e, cu_e, int(np.diff(cu_e).max()),
                                            int(np.diff(cu_e).max()), True, scale)[0]
        seg = segments_of(par)
        sp = split_segments(seg, True)
        idx = device_index(sp, "cuda")
        tree = {"split_dense": split_attention(q, k, v, scale, sp, kernel=cudnn_kernel(qk, vd), idx=idx),
                "split_graph": split_attention(q, k, v, scale, sp, kernel=kern_tl, idx=idx),
                "graph_path": path_attention(q, k, v, scale, seg, kernel=cudnn_graph.varlen_fn(br))}
    for tn, t in tree.items():
        te = t.index_select(0, exp_rows)
        for en, e in exp.items():
            same = (te == e).flatten(1).all(1)
            out[f"{tn}_vs_{en}"] = {"rows_identical": float(same.float().mean()),
                                    "max_abs_diff": float((te.float() - e.float()).abs().max())}
    same = (exp["graph_one_call"] == exp["sdpa_per_trajectory"]).flatten(1).all(1)
    out["expanded_graph_vs_sdpa"] = {"rows_identical": float(same.float().mean())}
    print(f"[attnbits] {out}", flush=True)
    # the bottom-right path without the deterministic flag, on the attention layouts
    fsw = generate(preset("swe-treestep-1")).forest()
    qkv, dO, sdpa, per_pair_sdpa, layouts = _attention_bench(fsw, H, qk, vd, scale)
    for lname, lpar in layouts.items():
        R_, seg, _, _, keys, pairs, ins = _layout_case(lpar, qkv)
        def fn(ins=ins, seg=seg, keys=keys):
            return path_attention(*ins, scale, seg, kernel=cudnn_graph.varlen_fn(br), key_rows=keys)
        try:
            fn().backward(dO[:R_])
            with torch.no_grad():
                fwd = time_cuda(fn, repeats=5)
            fb = time_cuda(lambda fn=fn, dR=dO[:R_]: fn().backward(dR), repeats=5)
            out[f"graph_path_nondet_{lname}"] = {"fwd_s": fwd, "fwdbwd_s": fb, "per_pair_vs_sdpa": fb / pairs / per_pair_sdpa,
                                                 "fwd_per_pair_vs_sdpa_fwdbwd": fwd / pairs / per_pair_sdpa}
        except Exception as err:  # noqa: BLE001
            out[f"graph_path_nondet_{lname}"] = {"error": f"{type(err).__name__}: {err}"[:400]}
        print(f"[attnbits] {lname}: {out[f'graph_path_nondet_{lname}']}", flush=True)
    # where the bushy layout's time goes: the graph split's forward+backward by kernel
    lpar = layouts["small_treestep_tiled"]
    seg = segments_of(lpar)
    sp = split_segments(seg, True)
    idx = device_index(sp, "cuda")
    ins = [x[:lpar.size].detach().requires_grad_() for x in qkv]
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("split_graph", lambda: split_attention(*ins, scale, sp, kernel=kern_tl, idx=idx)),
                     ("graph_path", lambda: path_attention(*ins, scale, seg, kernel=cudnn_graph.varlen_fn(br)))):
        fn().backward(dO[:lpar.size])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn().backward(dO[:lpar.size])
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / 3e3, e.count // 3) for e in prof.key_averages()),
                      key=lambda r: -r[1])[:14]
        out[f"bushy_profile_{name}"] = [{"kernel": k_[:90], "ms": round(t, 3), "calls": c} for k_, t, c in rows]
        print(f"[attnbits] bushy profile {name}: {out[f'bushy_profile_{name}']}", flush=True)
    return out


def _time_tree_attention(par, ins, dO, scale: float, env: str, pairs: int, per_pair_sdpa: float, qk: int,
                         vd: int) -> dict:
    """Forward and forward+backward seconds of `FastTreeAttention` on one layout (all rows
    query) with HARTS_TREE_ATTENTION=env ("" = the default), and per attended pair against
    causal SDPA; an error is recorded, not raised."""
    from harts.config.kernels import KernelConfig
    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention.tree import FastTreeAttention

    R_ = par.size
    end = torch.as_tensor(ends_from_parents(par), device="cuda")  # Flex's block mask reads it
    q_local = torch.arange(R_, device="cuda")
    try:
        att = FastTreeAttention(q_local, end, parent_L=par, kernels=KernelConfig(tree_attention=env or "auto"))
        fn = lambda: att(*ins, scale)  # noqa: E731
        fn().backward(dO[:R_])
        torch.cuda.synchronize()
        with torch.no_grad():
            fwd = time_cuda(fn, repeats=5)
        fb = time_cuda(lambda: fn().backward(dO[:R_]), repeats=5)
        return {"impl": str(att.impl(torch.bfloat16, qk, vd)), "fwd_s": fwd, "fwdbwd_s": fb,
                "per_pair_vs_sdpa": fb / pairs / per_pair_sdpa}
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"[:400], "traceback": traceback.format_exc()[-1200:]}


def sec_attnhybrid():
    """The tree step's attention as the backend picks it (`FastTreeAttention`: with the cuDNN
    frontend, forward one bottom-right graph call over root-to-row paths, backward the split
    with the dense per-segment kernel on long segments and the graph's on short ones) against
    the former default (HARTS_TREE_ATTENTION=cudnn: the per-segment dense split), on the
    three attention layouts and swe-treestep-32's sparsest (27% density: with FlexAttention
    too, the issue's easy path) and median 32k windows, forward+backward per attended pair
    against causal cuDNN SDPA."""
    from harts.tree.workload import generate, preset

    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    f = generate(preset("swe-treestep-1")).forest()
    qkv, dO, sdpa, per_pair_sdpa, layouts = _attention_bench(f, H, qk, vd, scale)
    layouts.update({n: p for n, (p, _) in _swe32_windows(32768).items()})
    out = {"sdpa_causal_32k_fwdbwd_s": sdpa}
    for lname, par in layouts.items():
        R_, seg, _, _, _, pairs, ins = _layout_case(par, qkv)
        res = {"rows": R_, "pairs": pairs, "density": pairs / R_ ** 2, "segments": seg.num_segments}
        variants = (("cudnn_split", "cudnn"), ("graph_hybrid", "graph"), ("flex", "flex"))
        for name, env in variants[:3 if lname == "swe32_sparsest" else 2]:
            res[name] = _time_tree_attention(par, ins, dO, scale, env, pairs, per_pair_sdpa, qk, vd)
        out[lname] = res
        print(f"[attnhybrid] {lname}: {res}", flush=True)
    return out


def _swe32_windows(R: int = 32768) -> dict:
    """The first R rows (a DFS prefix: itself a tree layout) of each swe-treestep-32 tree
    that has R rows, by density (attended pairs / R^2; causal = 0.5): the sparsest (tree 10:
    0.266, the issue's "27% density" tree mask) and the median one. The Flash presets cap
    contexts at 32k, so these are the generator's own 32k-row trees, not tuned layouts."""
    from harts.tree.workload import generate, preset

    f = generate(preset("swe-treestep-32")).forest()
    par, end = f.row_parent, f.row_end
    rows = []
    for r in np.flatnonzero(par < 0):
        if r + R > f.num_rows:
            continue
        e = np.minimum(end[r:r + R] - r, R - 1)
        rows.append((float((e - np.arange(R) + 1).sum()) / R ** 2, int(r), e))
    rows.sort(key=lambda x: x[0])
    pick = {"swe32_sparsest": rows[0], "swe32_median": rows[len(rows) // 2]}
    return {n: (parents_from_ends(e), d) for n, (d, _, e) in pick.items()}


def sec_attnplans():
    """The bushy layout's gap and the issue's 27%-density case. (1) causal cuDNN SDPA on 32k
    rows by kernel (its tile shapes); (2) per attended pair against it, forward+backward:
    the default tree attention and FlexAttention (the issue's easy path) on the bushy
    layout and on two swe-treestep-32 windows (the sparsest: 27% density; the median);
    (3) every cuDNN plan (heuristics A, B, fallback) of the default path's three graphs on
    the bushy layout and the 27% window (bottom-right forward over paths; the split
    backward's causal own-segment part and non-causal ancestor part): name, workspace,
    time, difference from the heuristic's choice; and the engines' knobs."""
    from torch.profiler import ProfilerActivity, profile

    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention import cudnn_graph
    from harts.exec.ops.attention.causal import causal_attention
    from harts.exec.ops.attention.tree import graph_kernels
    from harts.tree.workload import generate, preset

    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    f = generate(preset("swe-treestep-1")).forest()
    qkv, dO, sdpa, per_pair_sdpa, layouts = _attention_bench(f, H, qk, vd, scale)
    out = {"sdpa_causal_32k_fwdbwd_s": sdpa}
    R32 = 32768
    hf = [x[:R32].detach().transpose(0, 1).requires_grad_() for x in qkv]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            causal_attention(*hf, scale).backward(dO[:R32].transpose(0, 1))
        torch.cuda.synchronize()
    out["sdpa_kernels"] = [{"kernel": e.key[:110], "ms": round(e.device_time_total / 2e3, 3), "calls": e.count // 2}
                           for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]]
    print(f"[attnplans] sdpa kernels: {out['sdpa_kernels']}", flush=True)
    cases = {"bushy": (layouts["small_treestep_tiled"], None)}
    cases.update(_swe32_windows(R32))
    fwd_k, split_k = graph_kernels(qk, vd)
    for lname, (par, _) in cases.items():
        R_, seg, sp, idx, keys, pairs, ins = _layout_case(par, qkv)
        res = {"rows": R_, "pairs": pairs, "density": pairs / R_ ** 2, "segments": seg.num_segments,
               "gathered_keys": int(seg.key_rows.size)}
        for name, env in (("default", ""), ("flex", "flex"))[:2 if lname == "swe32_sparsest" else 1]:
            res[name] = _time_tree_attention(par, ins, dO, scale, env, pairs, per_pair_sdpa, qk, vd)
        print(f"[attnplans] {lname}: {res}", flush=True)
        # the default path's graphs, every plan
        plans = {}
        timer = lambda fn: time_cuda(fn, repeats=5, warmup=2)  # noqa: E731
        try:
            with torch.no_grad():
                q, k, v = (x.detach() for x in ins)
                do = dO[:R_]
                kg, vg = k.index_select(0, keys), v.index_select(0, keys)
                o, lse, _ = fwd_k.fwd(q, kg, vg, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, True, scale)
                calls = {"fwd_path": fwd_k.fwd_call(q, kg, vg, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, True, scale,
                                                    all_plans=True)}
                if sp.max_q <= 8192:
                    calls["bwd_own"] = split_k.bwd_call(do, q, k, v, o, lse, None, sp.cu_q, sp.cu_q, sp.max_q,
                                                        sp.max_q, True, scale, all_plans=True)
                if sp.has_ancestors and sp.max_qa <= 8192 and sp.max_ka <= 8192:
                    qa, anc = idx["qa"], idx["anc"]
                    calls["bwd_anc"] = split_k.bwd_call(do.index_select(0, qa), q.index_select(0, qa),
                                                        k.index_select(0, anc), v.index_select(0, anc),
                                                        o.index_select(0, qa), lse.index_select(0, qa), None,
                                                        sp.cu_qa, sp.cu_ka, sp.max_qa, sp.max_ka, False, scale,
                                                        all_plans=True)
                for cname, call in calls.items():
                    plans[cname] = cudnn_graph.plan_table(call, timer)
                    print(f"[attnplans] {lname} {cname}: {plans[cname]}", flush=True)
                    if lname == "bushy":
                        g = call.graph
                        try:
                            plans[f"{cname}_engines"] = {e: str(g.get_knobs_for_engine(e))[:1500]
                                                         for e in range(int(g.get_engine_count()))}
                        except Exception as err:  # noqa: BLE001
                            plans[f"{cname}_engines"] = f"{type(err).__name__}: {err}"[:300]
                        print(f"[attnplans] {cname} engines: {plans[f'{cname}_engines']}", flush=True)
                del calls
        except Exception as err:  # noqa: BLE001
            plans["error"] = f"{type(err).__name__}: {err}"[:400]
            plans["traceback"] = traceback.format_exc()[-1500:]
            print(f"[attnplans] {lname} plans: {plans['error']}", flush=True)
        res["plans"] = plans
        out[lname] = res
        torch.cuda.empty_cache()
    return out


def sec_attnpieces():
    """The split backward with part A grouped by key piece (`split_attention.piece_segments`)
    against by query segment (the default), on the bushy layout, swe-treestep-32's sparsest
    32k window (27% density) and its median one: forward+backward per attended pair against
    causal cuDNN SDPA, for part-B x part-A kernel pairs (graph deterministic where its
    workspace, B*H*Sq*Sk*2 bytes, allows; graph non-deterministic; torch's dense cuDNN per
    sequence), the peak memory over the inputs, and a check of each backward against the
    default's gradients (relative difference). Forward: the default bottom-right graph call."""
    from harts.config.kernels import KernelConfig
    from harts.exec.ops.attention.tree import graph_kernels

    GRAPH_BACKWARD_MAX_ROWS = KernelConfig().graph_backward_max_rows
    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention import cudnn_graph
    from harts.exec.ops.attention.split import (
        cudnn_kernel,
        device_index,
        path_split_attention,
        piece_segments,
    )
    from harts.tree.workload import generate, preset

    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    f = generate(preset("swe-treestep-1")).forest()
    qkv, dO, sdpa, per_pair_sdpa, layouts = _attention_bench(f, H, qk, vd, scale)
    out = {"sdpa_causal_32k_fwdbwd_s": sdpa}
    fwd_k, det = graph_kernels(qk, vd)
    kern = {"det": det, "nondet": cudnn_kernel(qk, vd, "graph-nondet"), "dense": cudnn_kernel(qk, vd)}

    def ws_gib(B, nq, nk):  # the deterministic graph backward's workspace
        return cudnn_graph.bucket_batch(B) * H * cudnn_graph.bucket_len(nq) * cudnn_graph.bucket_len(nk) * 2 / 2 ** 30

    cases = {"bushy": layouts["small_treestep_tiled"], "swe1_all": layouts["swe_treestep_1_all"]}
    cases.update({n: p for n, (p, _) in _swe32_windows(32768).items()})
    for lname, par in cases.items():
        R_, seg, spq, idxq, keys, pairs, ins = _layout_case(par, qkv)
        spp = piece_segments(seg, True)
        idxp = device_index(spp, "cuda")
        dR = dO[:R_]
        res = {"rows": R_, "pairs": pairs, "density": pairs / R_ ** 2, "segments": seg.num_segments}
        for nm, sp in (("query", spq), ("piece", spp)):
            res[f"{nm}_split"] = {"pieces": int(sp.cu_qa.size - 1), "qa_rows": int(sp.qa_index.size),
                                  "anc_rows": int(sp.anc_rows.size), "max_qa": sp.max_qa, "max_ka": sp.max_ka,
                                  "ws_det_A_gib": ws_gib(sp.cu_qa.size - 1, sp.max_qa, sp.max_ka)}
        wsB = ws_gib(seg.num_segments, seg.max_q, seg.max_q)
        b_default = "det" if seg.max_q <= GRAPH_BACKWARD_MAX_ROWS else "dense"
        combos = [("query", b_default, b_default), ("piece", b_default, b_default), ("piece", b_default, "nondet"),
                  ("piece", b_default, "dense"), ("piece", "nondet", "nondet"), ("query", "nondet", "nondet"),
                  ("piece", "dense", "dense")]
        ref = None
        for split, kb, ka in combos:
            name = f"{split}_{kb}_{ka}"
            sp, idx = (spq, idxq) if split == "query" else (spp, idxp)
            if (kb == "det" and wsB > 20) or (ka == "det" and res[f"{split}_split"]["ws_det_A_gib"] > 20):
                res[name] = {"skipped": "deterministic workspace over 20 GiB"}
                continue
            try:
                fn = lambda sp=sp, idx=idx, kb=kb, ka=ka, ins=ins, seg=seg, keys=keys: path_split_attention(  # noqa: E731
                    *ins, scale, seg, sp, fwd_k, (kern[kb], kern[ka]), key_rows=keys, idx=idx)
                for x in ins:
                    x.grad = None
                fn().backward(dR)
                grads = [x.grad.detach().clone() for x in ins]
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn().backward(dR)
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                fb = time_cuda(lambda fn=fn, dR=dR: fn().backward(dR), repeats=5)
                row = {"fwdbwd_s": fb, "per_pair_vs_sdpa": fb / pairs / per_pair_sdpa, "peak_over_inputs_gib": peak}
                if ref is None:
                    ref = grads
                else:
                    row["grad_rel_diff_vs_first"] = [rel(a, b) for a, b in zip(grads, ref, strict=True)]
                res[name] = row
            except Exception as err:  # noqa: BLE001
                res[name] = {"error": f"{type(err).__name__}: {err}"[:400]}
            print(f"[attnpieces] {lname} {name}: {res[name]}", flush=True)
            torch.cuda.empty_cache()
        for x in ins:
            x.grad = None
        out[lname] = res
        print(f"[attnpieces] {lname}: {res}", flush=True)
    return out


def sec_attndet():
    """The graph path's backward with part A by key piece (the default) against by query
    segment: bf16 gradients against float64 (the same decomposition's reference kernels,
    on the GPU) on small-treestep (12k rows, 16 heads, qk 192 / v 128), each kernel pair the
    backend picks; then run-to-run bit identity of the gradients (two runs, same inputs)
    for torch's causal SDPA on 32k rows (the baseline), the default tree attention on the
    bushy layout and on the 27% window, and each split kernel alone."""
    from harts.exec.ops.attention.causal import causal_attention
    from harts.exec.ops.attention.split import (
        REFERENCE,
        REFERENCE_BOTTOM_RIGHT,
        cudnn_kernel,
        device_index,
        path_split_attention,
        piece_segments,
        split_segments,
    )
    from harts.exec.ops.attention.tree import FastTreeAttention, graph_kernels, split_part_kernel
    from harts.tree.workload import generate, preset

    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    out = {"accuracy": {}, "bit_identical_reruns": {}}
    par = generate(preset("small-treestep")).forest().row_parent
    from harts.exec.ops.attention.varlen import segments_of

    seg = segments_of(par)
    L = par.size
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, do = (torch.randn(L, H, d, device="cuda", generator=g) for d in (qk, qk, vd))
    v = torch.randn(L, H, vd, device="cuda", generator=g)
    keys = torch.as_tensor(seg.key_rows, device="cuda")
    fwd_k, det = graph_kernels(qk, vd)

    def grads(x3, sp, fk, kern, dout):
        ins = [x.detach().requires_grad_() for x in x3]
        o = path_split_attention(*ins, scale, seg, sp, fk, kern, key_rows=keys, idx=device_index(sp, "cuda"))
        return torch.autograd.grad(o, ins, dout)

    for name, split in (("query", split_segments), ("piece", piece_segments)):
        sp = split(seg, True)
        ref = grads([x.double() for x in (q, k, v)], sp, REFERENCE_BOTTOM_RIGHT, REFERENCE, do.double())
        picks = {"default": (split_part_kernel(qk, vd, H, L, seg.num_segments, sp.max_q, sp.max_q),
                             split_part_kernel(qk, vd, H, int(sp.qa_index.size), int(sp.cu_qa.size - 1), sp.max_qa,
                                               sp.max_ka)),
                 "dense": cudnn_kernel(qk, vd), "nondet": cudnn_kernel(qk, vd, "graph-nondet"), "det": det}
        for kn, kern in picks.items():
            try:
                got = grads([x.bfloat16() for x in (q, k, v)], sp, fwd_k, kern, do.bfloat16())
                out["accuracy"][f"{name}_{kn}"] = {n_: rel(a, b) for n_, a, b in zip(("dq", "dk", "dv"), got, ref,
                                                                                      strict=True)}
                if kn == "default":
                    out["accuracy"][f"{name}_{kn}"]["kernels"] = [getattr(x, "name", type(x).__name__) for x in kern]
            except Exception as err:  # noqa: BLE001
                out["accuracy"][f"{name}_{kn}"] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print(f"[attndet] accuracy {name}_{kn}: {out['accuracy'][f'{name}_{kn}']}", flush=True)
        del ref
    # run-to-run bit identity of the gradients
    fsw = generate(preset("swe-treestep-1")).forest()
    qkv, dO, _, _, layouts = _attention_bench(fsw, H, qk, vd, scale)

    def same_twice(fn):
        a = [t.clone() for t in fn()]
        b = fn()
        return all(bool(torch.equal(x, y)) for x, y in zip(a, b, strict=True))

    R32 = 32768
    hf = [x[:R32].detach().transpose(0, 1) for x in qkv]

    def sdpa_grads():
        ins = [x.requires_grad_() for x in (t.detach() for t in hf)]
        return torch.autograd.grad(causal_attention(*ins, scale), ins, dO[:R32].transpose(0, 1))

    out["bit_identical_reruns"]["torch_sdpa_causal_32k"] = same_twice(sdpa_grads)
    cases = {"bushy": layouts["small_treestep_tiled"], "swe32_sparsest": _swe32_windows(R32)["swe32_sparsest"][0]}
    for lname, lpar in cases.items():
        R_ = lpar.size
        att = FastTreeAttention(torch.arange(R_, device="cuda"), torch.as_tensor(ends_from_parents(lpar), device="cuda"),
                                parent_L=lpar)

        def tree_grads(att=att, R_=R_):
            ins = [x[:R_].detach().requires_grad_() for x in qkv]
            return torch.autograd.grad(att(*ins, scale), ins, dO[:R_])

        out["bit_identical_reruns"][f"tree_default_{lname}"] = same_twice(tree_grads)
        segl = segments_of(lpar)
        sp = piece_segments(segl, True)
        keysl = torch.as_tensor(segl.key_rows, device="cuda")
        for kn, kern in (("dense", cudnn_kernel(qk, vd)), ("nondet", cudnn_kernel(qk, vd, "graph-nondet"))):
            def part_grads(kern=kern, R_=R_, segl=segl, sp=sp, keysl=keysl):
                ins = [x[:R_].detach().requires_grad_() for x in qkv]
                o = path_split_attention(*ins, scale, segl, sp, fwd_k, kern, key_rows=keysl,
                                         idx=device_index(sp, "cuda"))
                return torch.autograd.grad(o, ins, dO[:R_])

            out["bit_identical_reruns"][f"piece_{kn}_{lname}"] = same_twice(part_grads)
        print(f"[attndet] reruns: {out['bit_identical_reruns']}", flush=True)
    return out


def sec_graphbuild():
    """What the graph kernels cost when layouts change, and whether padding a batch with
    empty sequences is safe (the way to bucket B): first-call (graph build) and cached
    times of the forward and backward at several sequence counts, then zero-length
    sequences (causal, non-causal, bottom-right) against the float64 reference."""
    from harts.exec.ops.attention import cudnn_graph
    from harts.exec.ops.attention.kernel import REFERENCE, REFERENCE_BOTTOM_RIGHT, _case

    qk, vd = 192, 128
    scale = qk ** -0.5
    out = {"build": {}, "zero_length": {}}
    for B in (3, 17, 39, 64):
        kern = cudnn_graph.GraphKernel()
        n = [100 + 37 * i for i in range(B)]
        q, k, v, do, cu, _ = _case(qk, vd, n, n, 3)
        row = {}
        for rep in ("first", "cached"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o, lse, aux = kern.fwd(q, k, v, cu, cu, max(n), max(n), True, scale)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            kern.bwd(do, q, k, v, o, lse, aux, cu, cu, max(n), max(n), True, scale)
            torch.cuda.synchronize()
            row[rep] = {"fwd_s": t1 - t0, "bwd_s": time.perf_counter() - t1}
        row["graphs"] = kern.cache.builds
        out["build"][B] = row
        print(f"[graphbuild] B={B}: {row}", flush=True)
    for name, causal, br, nq, nk in (("causal", True, False, [5, 0, 40, 0, 0], [5, 0, 40, 0, 0]),
                                     ("rect", False, False, [5, 0, 30, 0], [9, 0, 41, 0]),
                                     ("bottom_right", True, True, [3, 0, 20, 0], [9, 0, 41, 0]),
                                     ("long_then_empty", True, False, [700, 0, 0, 0], [700, 0, 0, 0])):
        try:
            kern = cudnn_graph.GraphKernel(bottom_right=br)
            ref_k = REFERENCE_BOTTOM_RIGHT if br else REFERENCE
            q, k, v, do, cu_q, cu_k = _case(qk, vd, nq, nk, 4)
            wide = [x.double() for x in (q, k, v)]
            o_r, lse_r, _ = ref_k.fwd(*wide, cu_q, cu_k, max(nq), max(nk), causal, scale)
            ref = ref_k.bwd(do.double(), *wide, o_r, lse_r, None, cu_q, cu_k, max(nq), max(nk), causal, scale)
            o, lse, aux = kern.fwd(q, k, v, cu_q, cu_k, max(nq), max(nk), causal, scale)
            got = kern.bwd(do, q, k, v, o, lse, aux, cu_q, cu_k, max(nq), max(nk), causal, scale)
            torch.cuda.synchronize()
            out["zero_length"][name] = {n_: rel(a, b) for n_, a, b in zip(("o", "lse", "dq", "dk", "dv"),
                                                                       (o, lse, *got), (o_r, lse_r, *ref), strict=True)}
        except Exception as err:  # noqa: BLE001
            out["zero_length"][name] = {"error": f"{type(err).__name__}: {err}"[:400]}
        print(f"[graphbuild] zero-length {name}: {out['zero_length'][name]}", flush=True)
    return out


def sec_attnvar():
    """The cuDNN split tree attention on contiguous copies ("dense", the default) against
    strided views ("dense-strided"): both self-checked, bf16 accuracy against float64 on a
    forked layout, forward+backward per attended pair against causal cuDNN SDPA on 32k rows
    (16 heads, qk 192 / v 128), on the same three layouts as `attnsplit`; the kernels of one
    whole-tree forward+backward grouped by name (attention kernels vs the rest); and a probe
    of torch's ragged cuDNN entry with query sequences no longer than the head dim (its
    backward sizes dQ by the head dim, pytorch/pytorch#186142)."""
    import functools as ft

    from torch.profiler import ProfilerActivity, profile

    from harts.exec.bench import time_cuda
    from harts.exec.ops.attention.split import (
        REFERENCE,
        _case,
        _CuDNN,
        _read_lse,
        _write_lse,
        cudnn_kernel,
        split_attention,
        split_segments,
    )
    from harts.exec.ops.attention.varlen import path_attention, reference_varlen, segments_of
    from harts.tree.workload import generate, preset

    out = {}
    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    kerns = {}
    for variant in ("dense", "dense-strided"):
        try:
            kerns[variant] = cudnn_kernel(qk, vd, variant)
            out[f"self_check_{variant}"] = "ok"
        except Exception as err:  # noqa: BLE001
            out[f"self_check_{variant}"] = f"{type(err).__name__}: {err}"[:400]
    print(f"[attnvar] self-checks: {out}", flush=True)
    # ragged probe: short query sequences (<= qk rows), short and long keys
    probe = {}
    for name, causal, nq, nk in (("causal_le_d", True, [5, 100, 192], [5, 100, 192]),
                                 ("rect_short_q_long_k", False, [100, 192, 50], [3000, 2500, 900]),
                                 ("causal_gt_d", True, [300, 1000], [300, 1000])):
        try:
            k_ = _CuDNN()  # not cudnn_kernel("ragged"): its self-check runs the long cases
            k_.lse_from_native = ft.partial(_read_lse, layout="head_major", factor=1.0)
            k_.lse_to_native = ft.partial(_write_lse, layout="head_major", factor=1.0)
            k_.bias_arg = lambda q: None
            q, k, v, do, cu_q, cu_k = _case(qk, vd, nq, nk, 3)
            wide = [x.double() for x in (q, k, v)]
            o_ref, lse_ref, _ = REFERENCE.fwd(*wide, cu_q, cu_k, max(nq), max(nk), causal, scale)
            ref = REFERENCE.bwd(do.double(), *wide, o_ref, lse_ref, None, cu_q, cu_k, max(nq), max(nk), causal, scale)
            cq, ck = _CuDNN._cu(cu_q, "cuda"), _CuDNN._cu(cu_k, "cuda")
            native = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cq, ck, max(nq), max(nk), True, 0.0,
                                                             causal, False, scale=scale)[1]
            res = {"lse_shape": list(native.shape)}
            for layout in ("token_major", "head_major"):
                for factor in (1.0, float(np.log(2.0))):
                    if (_read_lse(native, layout, factor, q.shape[0], q.shape[1]).double() - lse_ref).abs().max() < 2e-2:
                        k_.lse_from_native = ft.partial(_read_lse, layout=layout, factor=factor)
                        k_.lse_to_native = ft.partial(_write_lse, layout=layout, factor=factor)
                        res["lse"] = f"{layout} {factor}"
            o, lse, aux = k_.fwd(q, k, v, cu_q, cu_k, max(nq), max(nk), causal, scale)
            grads = k_.bwd(do, q, k, v, o, lse, aux, cu_q, cu_k, max(nq), max(nk), causal, scale)
            torch.cuda.synchronize()
            res.update({n: rel(a, b) for n, a, b in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads),
                                                        (o_ref, lse_ref, *ref), strict=True)})
        except Exception as err:  # noqa: BLE001
            res = {"error": f"{type(err).__name__}: {err}"[:300]}
        probe[name] = res
        print(f"[attnvar] ragged probe {name}: {res}", flush=True)
        if "error" in res and "illegal" in res["error"].lower():
            break  # the context is gone after an illegal address
    out["ragged_probe"] = probe
    f = generate(preset("swe-treestep-1")).forest()
    # accuracy on a forked 6000-row layout, all rows as queries
    R = 6000
    parent = np.where(f.row_parent[:R] < R, f.row_parent[:R], -1)
    g = torch.Generator(device="cuda").manual_seed(0)
    seg = segments_of(parent)
    q = torch.randn(R, 4, qk, device="cuda", generator=g)
    k = torch.randn(R, 4, qk, device="cuda", generator=g)
    v = torch.randn(R, 4, vd, device="cuda", generator=g)
    do = torch.randn(R, 4, vd, device="cuda", generator=g)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    o_ref = path_attention(*ref_in, scale, seg, kernel=reference_varlen)
    ref = [o_ref.detach()] + list(torch.autograd.grad(o_ref, ref_in, do.double()))
    sp = split_segments(seg, True)
    for variant, kern in kerns.items():
        ins = [x.bfloat16().requires_grad_() for x in (q, k, v)]
        o = split_attention(*ins, scale, sp, kernel=kern)
        got = [o.detach()] + list(torch.autograd.grad(o, ins, do.bfloat16()))
        out[f"accuracy_{variant}"] = {n: rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref, strict=True)}
    print(f"[attnvar] accuracy: { {k_: v_ for k_, v_ in out.items() if k_.startswith('accuracy')} }", flush=True)
    qkv, dO, sdpa, per_pair_sdpa, layouts = _attention_bench(f, H, qk, vd, scale)
    out["sdpa_causal_32k_fwdbwd_s"] = sdpa
    for lname, par in layouts.items():
        _, seg, sp, idx, _, pairs, ins = _layout_case(par, qkv)
        res = {"rows": int(par.size), "pairs": pairs, "segments": seg.num_segments}
        for variant, kern in kerns.items():
            def fn(ins=ins, sp=sp, idx=idx, kern=kern):
                return split_attention(*ins, scale, sp, kernel=kern, idx=idx)
            try:
                with torch.no_grad():
                    fwd = time_cuda(fn, repeats=5)
                fb = time_cuda(lambda fn=fn, dR=dO[:par.size]: fn().backward(dR), repeats=5)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn().backward(dO[:par.size])
                host = time.perf_counter() - t0  # launch time on the host (no sync): ~fwdbwd_s if host-bound
                torch.cuda.synchronize()
                res[variant] = {"fwd_s": fwd, "fwdbwd_s": fb, "per_pair_vs_sdpa": fb / pairs / per_pair_sdpa,
                                "host_launch_s": host}
                if lname == "swe_treestep_1_all" or lname == "small_treestep_tiled":
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        fn().backward(dO[:par.size])
                        torch.cuda.synchronize()
                    groups: dict[str, float] = {}
                    for e in prof.key_averages():
                        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) / 1e6
                        if t <= 0:
                            continue
                        name = e.key.lower()
                        grp = ("attention" if any(w in name for w in ("cudnn", "sdpa", "fmha", "flash", "attn")) else
                               "copy/gather" if any(w in name for w in ("copy", "index", "gather", "cat", "scatter")) else
                               "other")
                        groups[grp] = groups.get(grp, 0.0) + t
                    res[variant]["kernel_seconds"] = groups
                    res[variant]["top_kernels"] = sorted(
                        ((e.key[:90], getattr(e, "device_time_total", 0.0) / 1e6) for e in prof.key_averages()),
                        key=lambda x: -x[1])[:12]
            except Exception as err:  # noqa: BLE001
                res[variant] = {"error": f"{type(err).__name__}: {err}"[:400]}
        out[lname] = res
        print(f"[attnvar] {lname}: { {k_: (v_ if not isinstance(v_, dict) else {a: b for a, b in v_.items() if a != 'top_kernels'}) for k_, v_ in res.items()} }", flush=True)
    return out


def sec_dhubv():
    """The injected-gradient state backward (`bwd_dhu_inject`) at the shapes of a tree's
    replay rounds (1-3 long sequences: one program per value block x sequence x head, so
    few sequences leave SMs idle) and of packed batches (16 sequences), with value blocks
    of 64 / 32 / 16, next to fla's `chunk_gated_delta_rule_bwd_dhu` on the same inputs
    (no injection; 16 heads, K = V = 128, bf16, chunk 64)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.utils import prepare_chunk_offsets

    from harts.exec.bench import time_cuda
    from harts.exec.ops.kda.dhu import bwd_dhu_inject

    out = {"sms": torch.cuda.get_device_properties(0).multi_processor_count}
    H, K, V, B = 16, 128, 128, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    for lens in ([38727], [32524, 10020], [26845, 9078, 672], [2048] * 16):
        T = sum(lens)
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], device="cuda", dtype=torch.int32)
        offs = prepare_chunk_offsets(cu.long(), B)
        NT = int(offs[-1])
        mk = lambda *shape: (torch.randn(*shape, device="cuda", generator=g) * 0.1).bfloat16()  # noqa: E731
        q, k, w = mk(1, T, H, K), mk(1, T, H, K), mk(1, T, H, K)
        gk = -torch.rand(1, T, H, K, device="cuda", generator=g) * 0.05
        do, dv = mk(1, T, H, V), mk(1, T, H, V)
        res = {"tokens": T, "sequences": len(lens)}
        ins = (q, k, w, gk, do, dv)
        h0 = torch.zeros(len(lens), H, K, V, device="cuda")
        for bv in (64, 32, 16):
            res[f"bv{bv}_ms"] = 1e3 * time_cuda(lambda bv=bv, a=ins, cu=cu, offs=offs, NT=NT: bwd_dhu_inject(
                *a, None, None, cu.long(), offs, NT, 0.1, chunk_size=B, block_v=bv), repeats=10)
        try:
            res["fla_ms"] = 1e3 * time_cuda(lambda a=ins, cu=cu, h0=h0: chunk_gated_delta_rule_bwd_dhu(
                q=a[0], k=a[1], w=a[2], gk=a[3], h0=h0, dht=None, do=a[4], dv=a[5],
                scale=0.1, cu_seqlens=cu.long(), chunk_size=B), repeats=10)
        except Exception as err:  # noqa: BLE001
            res["fla_error"] = f"{type(err).__name__}: {err}"[:300]
        out["x".join(map(str, lens)) if len(set(lens)) > 1 else f"{len(lens)}x{lens[0]}"] = res
        print(f"[dhubv] {lens}: {res}", flush=True)
    return out


def sec_calib(varlen_tree: bool = False):
    """Profile rows at several sizes for `harts sim fit` (schema harts.sim.profile/v1): GEMMs
    of tiny-h200's shapes, causal SDPA and the tree attention at 3 lengths (8 heads, as
    the model's MLA; the backend's default path on the first T rows of swe-treestep-1, or
    the varlen path with varlen_tree, as the third session measured), fla chunk_kda at 3
    token counts, device copies, and one fused AdamW step over tiny-h200's parameters.
    Written to calib_profile.json."""
    from harts.config.models import get_model_config
    from harts.exec.bench import gemm_profile, kda_op_benchmark, time_cuda
    from harts.exec.model.model import build_model
    from harts.exec.ops.attention.causal import causal_attention
    from harts.exec.ops.attention.tree import FastTreeAttention
    from harts.exec.ops.attention.varlen import flash_varlen, path_attention, segments_of
    from harts.tree.workload import generate, preset

    rows = []
    shapes = [(m, k, n) for m in (4096, 16384, 65536) for k, n in ((1536, 4096), (4096, 1536), (1536, 512),
                                                                      (512, 1536), (1536, 32768))]
    rows += gemm_profile(shapes)
    H, qk, vd = 8, 192, 128
    f = generate(preset("swe-treestep-1")).forest()

    def fwd_bwd_rows(fn, grad, base):
        with torch.no_grad():
            fwd = time_cuda(fn, repeats=5)
        fb = time_cuda(lambda: fn().backward(grad), repeats=5)
        return [{**base, "phase": "fwd", "seconds": fwd}, {**base, "phase": "bwd", "seconds": fb - fwd}]

    for T in (8192, 32768, 81920):
        qkv = [torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for d in (qk, qk, vd)]
        dout = torch.randn(T, H, vd, device="cuda", dtype=torch.bfloat16)
        heads_first = [x.transpose(0, 1) for x in qkv]
        rows += fwd_bwd_rows(lambda hf=heads_first: causal_attention(*hf, qk ** -0.5), dout.transpose(0, 1),
                             dict(op="attention_causal", pairs=T * (T + 1) // 2, heads=H, qk_dim=qk, v_dim=vd,
                                  impl="sdpa"))
        R = min(T, f.num_rows)
        parent = np.where(f.row_parent[:R] < R, f.row_parent[:R], -1)
        part = [x[:R].detach().requires_grad_() for x in qkv]
        end = np.minimum(f.row_end[:R], R - 1)
        pairs = int((end - np.arange(R) + 1).sum())
        if varlen_tree:
            seg = segments_of(parent)
            keys = torch.as_tensor(seg.key_rows, device="cuda")
            impl = "varlen"

            def fn(part=part, seg=seg, keys=keys):
                return path_attention(*part, qk ** -0.5, seg, kernel=flash_varlen, key_rows=keys)
        else:  # the path the step takes on this layout (backend default: cuDNN split on long segments)
            fa = FastTreeAttention(torch.arange(R, device="cuda"), torch.as_tensor(end, device="cuda"), parent)
            fa.prepare()
            impl = str(fa.impl(torch.bfloat16, qk, vd))

            def fn(part=part, fa=fa):
                return fa(*part, qk ** -0.5)
        rows += fwd_bwd_rows(fn, dout[:R], dict(op="attention_tree", pairs=pairs, heads=H, qk_dim=qk, v_dim=vd,
                                                impl=impl))
        del qkv, dout, heads_first, part
        torch.cuda.empty_cache()
    for T in (8192, 32768, 131072):
        _, prof = kda_op_benchmark(T=T, num_seqs=16)
        rows += [r for r in prof if r["impl"] == "fla"]
        torch.cuda.empty_cache()
    for n in (2**25, 2**28, 2**30):
        a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
        b = torch.empty_like(a)
        s = time_cuda(lambda a=a, b=b: b.copy_(a), repeats=10)
        rows.append(dict(op="elementwise", phase="fwd", seconds=s, bytes=2 * a.numel() * 2))
        del a, b
    net = build_model(get_model_config("tiny-h200"), seed=0, dtype=torch.bfloat16, device="cuda")
    params = [p for p in net.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
    s = time_cuda(opt.step, repeats=5)
    n_params = sum(p.numel() for p in params)
    rows.append(dict(op="optimizer", phase="step", seconds=s, bytes=n_params * 16, params=n_params))
    save("calib_profile", {"schema": "harts.sim.profile/v1", "device": torch.cuda.get_device_name(0),
                           "source": "benchmarks/gpu/h200_run.py calib", "measurements": rows})
    return {"rows": len(rows)}


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("sections", nargs="+")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="tiny-h200")
    ap.add_argument("--schemes", nargs="+", default=["treestep", "stepwise"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--microbatch-tokens", type=int, default=131072)
    ap.add_argument("--no-autotune", action="store_true",
                    help="take each Triton kernel's first config (correctness runs: saves minutes of tuning)")
    args = ap.parse_args()
    if args.no_autotune:
        import triton.runtime.autotuner as autotuner

        autotuner.Autotuner._bench = lambda self, *a, **kw: [0.0, 0.0, 0.0]
    import torch._dynamo

    # kernel-option variants and grad modes each compile FlexAttention once; past the
    # default limit (8) dynamo falls back to eager flex, which materialises dense scores
    torch._dynamo.config.recompile_limit = 64
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    fns = {"attn": sec_attn, "env": sec_env, "kda": sec_kda, "flex": sec_flex, "verify": sec_verify, "ops": sec_ops,
           "step": lambda: sec_step(args), "fidelity": lambda: sec_fidelity(args),
           "profile": lambda: sec_profile(args), "moe": sec_moe, "conv": sec_conv, "attnprobe": sec_attnprobe, "attnsplit": sec_attnsplit, "attnvar": sec_attnvar, "attngraph": sec_attngraph, "attnbits": sec_attnbits, "attnhybrid": sec_attnhybrid, "graphbuild": sec_graphbuild, "attnplans": sec_attnplans, "attnpieces": sec_attnpieces, "attndet": sec_attndet, "calib": sec_calib, "flexsweep": lambda: sec_flexsweep(args),
           "syncs": lambda: sec_syncs(args), "opsites": lambda: sec_opsites(args), "divergence": lambda: sec_divergence(args), "dhubv": sec_dhubv, "fwdhbv": sec_fwdhbv, "convtiles": sec_convtiles, "kdaops": sec_kdaops}
    for s in args.sections:
        t0 = time.perf_counter()
        try:
            res = fns[s]()
            status = "ok"
        except Exception as err:  # noqa: BLE001 - record and go on to the next section
            res = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
            status = "ERROR " + res["error"][:300]
        save(s, res)
        print(f"=== {s}: {status} ({time.perf_counter() - t0:.1f}s)", flush=True)
        if status == "ok" and s not in ("step",):
            print(json.dumps(res, default=str)[:1500], flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
