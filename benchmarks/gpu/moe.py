"""One MoE layer of tiny-h200 on the GPU: the per-expert loop against grouped_mm.

    python3 benchmarks/gpu/moe.py [moe] [--out DIR]

D 1536, 64 experts top-8, F 512, 82k rows, bf16, forward and forward+backward seconds of
both, the grouped form's TFLOP/s, and both against an fp32 loop (relative error).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:  # run as a script: this folder would
    sys.path[0] = _ROOT  # the repository root, not this folder, first on the path
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks.gpu.common import Section, rel, run_suite, time_cuda  # noqa: E402
from harts.exec.ops.moe import experts_loop  # noqa: E402
from harts.exec.ops.moe.grouped import experts_grouped  # noqa: E402


def sec_moe(args):
    """One MoE layer of tiny-h200 (D 1536, 64 experts top-8, F 512) forward+backward on
    82k rows: the per-expert loop vs grouped_mm; plus the grouped output vs the loop."""
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



def summary(out):
    return [(n, f"fwd {out[f'{n}_fwd_s'] * 1e3:.2f} ms, fwd+bwd {out[f'{n}_fwdbwd_s'] * 1e3:.2f} ms")
            for n in ("loop", "grouped")] + [("grouped vs fp32", f"{out['grouped_vs_fp32_loop_rel']:.2e}")]


SECTIONS = [Section("moe", sec_moe, "per-expert loop vs grouped_mm, fwd and fwd+bwd", summary)]


if __name__ == "__main__":
    sys.exit(run_suite("moe", SECTIONS, __doc__))
