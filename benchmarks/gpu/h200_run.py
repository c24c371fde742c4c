"""Device script: GPU correctness checks, per-op kernels, update-step benchmark, bf16 fidelity.

    python benchmarks/gpu/h200_run.py SECTION... --out DIR

Sections: env, kda, flex, verify, ops, step, fidelity. Each writes DIR/<section>.json and
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
    from harts.exec.gpu.kda import chunk_kda_fast
    from harts.exec.ops.kda import chunk_kda as ref_kda

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

    from harts.exec.gpu.attention import tree_attention, tree_block_mask
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
    from harts.exec.gpu.bench import attention_op_benchmark
    from harts.tree.workload import generate, preset

    f = generate(preset("swe-treestep-1")).forest()
    R = 32768
    end = np.minimum(f.row_end[:R], R - 1)
    r, p = attention_op_benchmark(end)
    save("attn_profile", {"schema": "harts.sim.profile/v1", "device": torch.cuda.get_device_name(0),
                          "source": "benchmarks/gpu/h200_run.py attn", "measurements": p})
    return r


def sec_ops():
    from harts.exec.gpu.bench import attention_op_benchmark, gemm_profile, kda_op_benchmark
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
    from harts.exec.gpu.bench import step_benchmark
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
        print(f"[step] {scheme}: speedup {r.get('speedup'):.2f}x limit {r['flop_limit']:.2f}x "
              f"exp {r['expanded']['seconds']:.2f}s tree {r['tree']['seconds']:.2f}s "
              f"peak exp {r['expanded_peak_bytes']/2**30:.1f} GiB tree {r['tree_peak_bytes']/2**30:.1f} GiB", flush=True)
    return runs


def sec_fidelity(args):
    from harts.tree.workload import generate, preset
    from harts.verify.fidelity import fidelity

    trajs = generate(preset("small-treestep", vocab_size=32768, seed=3)).trajectories()
    return fidelity(trajs, model=args.model, dtype=torch.bfloat16, device="cuda", microbatch_tokens=1 << 16)


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
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    fns = {"attn": sec_attn, "env": sec_env, "kda": sec_kda, "flex": sec_flex, "verify": sec_verify, "ops": sec_ops,
           "step": lambda: sec_step(args), "fidelity": lambda: sec_fidelity(args)}
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
