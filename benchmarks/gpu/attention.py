"""Tree attention timed per attended pair against causal cuDNN SDPA, and the cuDNN graph
kernels' build cost.

    python3 benchmarks/gpu/attention.py [pairs] [graphbuild] [--layouts NAME...] [--out DIR]

`pairs`: bf16, 16 heads, qk 192 / v 128 (MLA's shape), forward+backward seconds of the
tree attention the backend picks (`FastTreeAttention`) and of the per-segment dense cuDNN
split, on five layouts: the first 32k rows of swe-treestep-1 (one chain), all of
swe-treestep-1 (82k rows), small-treestep tiled to 32k rows (bushy), and swe-treestep-32's
sparsest (27% density; FlexAttention too) and median 32k-row trees, and the baselines'
branching-4 tree (`benchmarks/gpu/baselines.py` bushy: 16 leaves, turns of a few hundred
tokens) whole and its first 32k rows; each as its cost per
attended pair over causal SDPA's on 32k rows (1.0 = as cheap per pair as the dense causal
kernel). `graphbuild` (not run by default): first-call and cached seconds of the cuDNN graph
kernel at 3-64 sequences. The kernels' accuracy against float64 is tests/cuda/test_attention.py.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:  # run as a script: this folder would
    sys.path[0] = _ROOT  # the repository root, not this folder, first on the path
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu.common import (  # noqa: E402
    Section,
    ends_from_parents,
    kernel_config,
    parents_from_ends,
    run_suite,
    time_cuda,
)
from harts.config.kernels import KernelConfig  # noqa: E402
from harts.exec.ops.attention import cudnn_graph  # noqa: E402
from harts.exec.ops.attention.causal import causal_attention  # noqa: E402
from harts.exec.ops.attention.kernel import _case  # noqa: E402
from harts.exec.ops.attention.split import device_index, split_segments  # noqa: E402
from harts.exec.ops.attention.tree import FastTreeAttention  # noqa: E402
from harts.exec.ops.attention.varlen import segments_of  # noqa: E402
from harts.exec.ops.record import KernelRecord  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402


def _attention_bench(f, H: int, qk: int, vd: int, scale: float, kernels: KernelConfig, rows: int = 3 * 32768):
    """Inputs of the tree-attention speed sections: bf16 q, k, v (3 x 32k rows, grads on) and
    dO, causal cuDNN SDPA's forward+backward seconds on 32k rows (the per-pair baseline;
    `kernels` with baseline_attention cudnn) and
    per attended pair, and three layouts (parents): the first 32k rows of forest `f` (one
    chain), all of `f`, and small-treestep tiled to 32k rows (bushy)."""
    R32 = 32768
    qkv = [torch.randn(rows, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for d in (qk, qk, vd)]
    do = torch.randn(rows, H, vd, device="cuda", dtype=torch.bfloat16)
    hf = [x[:R32].detach().transpose(0, 1).requires_grad_() for x in qkv]
    cudnn = kernel_config(kernels, baseline_attention="cudnn")
    sdpa = time_cuda(lambda: causal_attention(*hf, scale, cudnn).backward(do[:R32].transpose(0, 1)), repeats=10)
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
    seg = segments_of(par)
    sp = split_segments(seg, True)
    ins = [x[:par.size].detach().requires_grad_() for x in qkv]
    return (int(par.size), seg, sp, device_index(sp, device), torch.as_tensor(seg.key_rows, device=device),
            seg.attended_pairs, ins)


def _swe32_windows(R: int = 32768) -> dict:
    """The first R rows (a DFS prefix: itself a tree layout) of each swe-treestep-32 tree
    that has R rows, by density (attended pairs / R^2; causal = 0.5): the sparsest (tree 10:
    0.266, the attention target's "27% density" tree mask) and the median one. The Flash presets cap
    contexts at 32k, so these are the generator's own 32k-row trees, not tuned layouts."""
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


def _time_tree_attention(par, ins, dO, scale: float, kernels: KernelConfig, pairs: int, per_pair_sdpa: float,
                         qk: int, vd: int) -> dict:
    """Forward and forward+backward seconds of `FastTreeAttention` on one layout (all rows
    query) on `kernels` (its tree_attention), and per attended pair against causal SDPA,
    with what the calls ran; an error is recorded, not raised."""
    R_ = par.size
    end = torch.as_tensor(ends_from_parents(par), device="cuda")  # Flex's block mask reads it
    q_local = torch.arange(R_, device="cuda")
    record = KernelRecord()
    try:
        att = FastTreeAttention(q_local, end, parent_L=par, kernels=kernels, record=record)
        fn = lambda: att(*ins, scale)  # noqa: E731
        fn().backward(dO[:R_])
        torch.cuda.synchronize()
        with torch.no_grad():
            fwd = time_cuda(fn, repeats=5)
        fb = time_cuda(lambda: fn().backward(dO[:R_]), repeats=5)
        return {"impl": str(att.impl(torch.bfloat16, qk, vd)), "fwd_s": fwd, "fwdbwd_s": fb,
                "per_pair_vs_sdpa": fb / pairs / per_pair_sdpa, "tree_attention": kernels.tree_attention.value,
                **record.to_dict()}
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"[:400], "traceback": traceback.format_exc()[-1200:],
                "tree_attention": kernels.tree_attention.value, **record.to_dict()}


def sec_pairs(args):
    """The tree step's attention as the backend picks it (`FastTreeAttention`: with the cuDNN
    frontend, forward one bottom-right graph call over root-to-row paths, backward the split
    with the dense per-segment kernel on long segments and the graph's on short ones) against
    the per-segment dense cuDNN split (tree attention "cudnn"), on the three attention layouts
    and swe-treestep-32's sparsest (27% density: with FlexAttention too, the easy path the
    target compares with) and median 32k windows, forward+backward per attended pair against causal cuDNN SDPA."""
    H, qk, vd = 16, 192, 128
    scale = qk ** -0.5
    from benchmarks.gpu.baselines import workload
    from harts.config.models import get_model_config
    from harts.tree import build_forest

    f = generate(preset("swe-treestep-1")).forest()
    bushy = build_forest(workload("bushy", get_model_config("tiny-h200").vocab_size))
    qkv, dO, sdpa, per_pair_sdpa, layouts = _attention_bench(f, H, qk, vd, scale, args.kernels,
                                                             rows=max(3 * 32768, f.num_rows, bushy.num_rows))
    layouts.update({n: p for n, (p, _) in _swe32_windows(32768).items()})
    layouts["branching4_all"] = bushy.row_parent
    layouts["branching4_first32k"] = parents_from_ends(np.minimum(bushy.row_end[:32768], 32768 - 1))
    if args.layouts:
        unknown = sorted(set(args.layouts) - set(layouts))
        if unknown:
            raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(layouts)}")
        layouts = {n: p for n, p in layouts.items() if n in args.layouts}
    out = {"sdpa_causal_32k_fwdbwd_s": sdpa, "kernel_config": args.kernels.to_dict()}
    for lname, par in layouts.items():
        R_, seg, _, _, _, pairs, ins = _layout_case(par, qkv)
        res = {"rows": R_, "pairs": pairs, "density": pairs / R_ ** 2, "segments": seg.num_segments}
        variants = (("cudnn_split", "cudnn"), ("graph_hybrid", "graph"), ("flex", "flex"))
        for name, choice in variants[:3 if lname == "swe32_sparsest" else 2]:
            res[name] = _time_tree_attention(par, ins, dO, scale, kernel_config(args.kernels, tree_attention=choice),
                                             pairs, per_pair_sdpa, qk, vd)
        out[lname] = res
        print(f"[pairs] {lname}: {res}", flush=True)
    return out


def sec_graphbuild(args):
    """What the graph kernels cost when layouts change: first-call (graph build) and cached
    times of the forward and backward at several sequence counts. (Zero-length sequences
    against the float64 reference: tests/cuda/test_attention.py.)"""
    qk, vd = 192, 128
    scale = qk ** -0.5
    out = {"build": {}}
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
    return out


def sum_pairs(out):
    rows = [("sdpa causal 32k", f"{out['sdpa_causal_32k_fwdbwd_s'] * 1e3:.2f} ms fwd+bwd")]
    for lname, res in out.items():
        if not isinstance(res, dict) or "pairs" not in res:
            continue
        cells = [f"density {res['density']:.3f}"]
        for name in ("graph_hybrid", "cudnn_split", "flex"):
            r = res.get(name)
            if r is not None:
                cells.append(f"{name} " + (f"{r['per_pair_vs_sdpa']:.3f}x" if "per_pair_vs_sdpa" in r else "error"))
        rows.append((lname, ", ".join(cells)))
    return rows


def sum_graphbuild(out):
    return [(f"B={b}", f"first {r['first']['fwd_s'] + r['first']['bwd_s']:.3f} s, "
                       f"cached {r['cached']['fwd_s'] + r['cached']['bwd_s']:.4f} s") for b, r in out["build"].items()]


def add_args(ap) -> None:
    ap.add_argument("--layouts", nargs="+", metavar="NAME", help="pairs: only these layouts (default all)")


SECTIONS = [
    Section("pairs", sec_pairs, "tree attention per attended pair vs causal SDPA on seven layouts", sum_pairs),
    Section("graphbuild", sec_graphbuild, "cuDNN graph build vs cached call by sequence count", sum_graphbuild,
            default=False),
]


if __name__ == "__main__":
    sys.exit(run_suite("attention", SECTIONS, __doc__, add_args))
