"""Profile rows for the simulator's calibration (`harts sim fit`, schema harts.sim.profile/v1).

    python3 benchmarks/gpu/calib.py [calib] [ops] [attn] [--varlen-tree] [--out DIR]

`calib`: GEMMs of tiny-h200's shapes at 3 sizes, causal SDPA and the tree attention at 3
lengths (8 heads, as the model's MLA; the backend's default path on the first T rows of
swe-treestep-1, or the varlen flash path with --varlen-tree), fla chunk_kda at 3 token
counts, device copies, one fused AdamW step over tiny-h200's parameters; written to
DIR/calib_profile.json. `ops` (not by default): the attention and KDA op benchmarks at
MLA's and KDA's shapes (16 heads, qk 192 / v 128; 16 x 128) plus GEMMs, to DIR/h200_profile.json. `attn` (not by default): the attention
op benchmark alone, to DIR/attn_profile.json. Each profile carries its provenance.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:  # run as a script: this folder would
    sys.path[0] = _ROOT  # the repository root, not this folder, first on the path
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu.common import Section, ctx, run_suite, time_cuda  # noqa: E402
from harts.bench.ops import (  # noqa: E402
    attention_op_benchmark,
    gemm_profile,
    kda_op_benchmark,
)
from harts.config.kernels import KernelConfig  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.exec.model.model import build_model  # noqa: E402
from harts.exec.ops.attention.causal import causal_attention  # noqa: E402
from harts.exec.ops.attention.tree import FastTreeAttention  # noqa: E402
from harts.exec.ops.attention.varlen import flash_varlen, path_attention, segments_of  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402


def sec_calib(kernels: KernelConfig, varlen_tree: bool = False):
    """Profile rows at several sizes for `harts sim fit` (schema harts.sim.profile/v1): GEMMs
    of tiny-h200's shapes, causal SDPA and the tree attention at 3 lengths (8 heads, as
    the model's MLA; the backend's default path on the first T rows of swe-treestep-1, or
    the varlen path with varlen_tree, as
    benchmarks/results/calibration/2026-11-29-9006abf-calib_profile.json measured), fla chunk_kda at 3
    token counts, device copies, and one fused AdamW step over tiny-h200's parameters.
    The attentions run on `kernels` (the suite's KernelConfig, recorded in the provenance).
    Written to calib_profile.json."""
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
        rows += fwd_bwd_rows(lambda hf=heads_first: causal_attention(*hf, qk ** -0.5, kernels), dout.transpose(0, 1),
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
            fa = FastTreeAttention(torch.arange(R, device="cuda"), torch.as_tensor(end, device="cuda"), parent,
                                   kernels=kernels)
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
    ctx().save_raw("calib_profile", {"schema": "harts.sim.profile/v1", "device": torch.cuda.get_device_name(0),
                           "source": "benchmarks/gpu/calib.py calib", "measurements": rows})
    return {"rows": len(rows), "kernel_config": kernels.to_dict()}


def sec_ops(args):

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
    ctx().save_raw("h200_profile", {"schema": "harts.sim.profile/v1", "device": torch.cuda.get_device_name(0),
                          "source": "benchmarks/gpu/calib.py ops", "measurements": prof})
    return out


def sec_attn(args):

    f = generate(preset("swe-treestep-1")).forest()
    R = 32768
    end = np.minimum(f.row_end[:R], R - 1)
    r, p = attention_op_benchmark(end)
    ctx().save_raw("attn_profile", {"schema": "harts.sim.profile/v1", "device": torch.cuda.get_device_name(0),
                          "source": "benchmarks/gpu/calib.py attn", "measurements": p})
    return r



def sum_calib(out):
    return [("rows", str(out["rows"]))]


def sum_ops(out):
    return [(k, "error" if isinstance(v, dict) and "error" in v else "ok") for k, v in out.items() if k != "gemm"]


SECTIONS = [
    Section("calib", lambda args: sec_calib(args.kernels, args.varlen_tree), "per-op profile rows at several sizes", sum_calib),
    Section("ops", sec_ops, "attention/KDA/GEMM op benchmarks at MLA's and KDA's shapes", sum_ops, default=False),
    Section("attn", sec_attn, "the attention op benchmark alone", None, default=False),
]


def add_args(ap) -> None:
    ap.add_argument("--varlen-tree", action="store_true", help="calib: time the varlen flash tree path")


if __name__ == "__main__":
    sys.exit(run_suite("calib", SECTIONS, __doc__, add_args))
