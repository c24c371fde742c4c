"""The short conv of a KDA layer on a tree (window 4 over each row's ancestors) on the GPU:
the fused Triton kernels against the gather-form reference, and the backward's tiles.

    python3 benchmarks/gpu/conv.py [conv] [tiles] [--out DIR]

Inputs: swe-treestep-1's tree (82k rows) x 2048 channels (q/k/v: 16 x 128), bf16, with bias.
`conv`: forward, backward and forward+backward seconds of both forms, the fused output and
gradients against the reference in fp32, and whether the fused backward's bits repeat.
`tiles` (not by default): the fused backward under tile overrides (the `conv_bwd_tiles`
kernel choice: BD, BT_g, NSUB, warps_g, BT_dx, warps_dx), against the default's gradients.
Accuracy as a test: tests/cuda/test_conv.py.
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

from benchmarks.gpu.common import Section, kernel_config, rel, run_suite, time_cuda  # noqa: E402
from harts.exec.ops.conv import short_conv, window_from_parents  # noqa: E402
from harts.exec.ops.conv.triton import short_conv_fused  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402


def _conv_inputs():
    """A KDA layer's short conv on swe-treestep-1's tree (82k rows x 2048 channels, window
    4, bf16): (window, x, weight, bias, dy), the leaves requiring grad."""
    f = generate(preset("swe-treestep-1")).forest()
    win = window_from_parents(torch.as_tensor(f.row_parent), 4).cuda()
    T, D = f.num_rows, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(D, 4, device="cuda", generator=g) * 0.3).bfloat16().requires_grad_()
    b = (torch.randn(D, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    return win, x, w, b, dy


def sec_conv(args):
    """The short conv of a KDA layer (q/k/v: 16 x 128 channels, window 4) on 82k rows of a
    real tree layout, bf16, forward+backward: gather-form reference vs the fused Triton
    kernels (the default on CUDA); the fused output and every gradient against the
    reference in fp32; the fused backward run twice (bit-identical: no atomics). The fused
    backward's tiles: the suite's KernelConfig.conv_bwd_tiles (None: the default)."""
    win, x, w, b, dy = _conv_inputs()
    T, D = x.shape
    tiles = args.kernels.conv_bwd_tiles
    out = {"rows": T, "channels": D, "conv_bwd_tiles": None if tiles is None else list(tiles)}

    def fused(*a, **kw):
        return short_conv_fused(*a, bwd_tiles=tiles, **kw)

    for name, fn in (("reference", short_conv), ("fused", fused)):
        with torch.no_grad():
            out[f"{name}_fwd_s"] = time_cuda(lambda fn=fn: fn(x, w, b, window_TW=win), repeats=10)
        out[f"{name}_fwdbwd_s"] = time_cuda(lambda fn=fn: fn(x, w, b, window_TW=win).backward(dy), repeats=10)
        y = fn(x, w, b, window_TW=win)
        out[f"{name}_bwd_s"] = time_cuda(lambda y=y: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
                                         repeats=10)
    leaves = [t.detach().float().requires_grad_() for t in (x, w, b)]
    ref_y = short_conv(*leaves, window_TW=win)
    ref = [ref_y.detach(), *torch.autograd.grad(ref_y, leaves, dy.float())]
    y = fused(x, w, b, window_TW=win)
    got = [y.detach(), *torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)]
    again = torch.autograd.grad(y, (x, w, b), dy)
    for name, a, r in zip(("y", "dx", "dw", "db"), got, ref, strict=True):
        out[f"fused_vs_fp32_reference_rel_{name}"] = rel(a, r)
    out["fused_backward_rerun_bit_identical"] = all(torch.equal(a, c) for a, c in zip(got[1:], again, strict=True))
    print(f"[conv] {out}", flush=True)
    return out


def sec_tiles(args):
    """The fused conv's backward (82k tree rows x 2048 channels, window 4, bf16, with bias)
    under tile overrides (`conv_bwd_tiles` = BD, BT_g, NSUB, warps_g, BT_dx, warps_dx):
    ms per backward, and dx / dW against the default's (dx's per-row order does not depend
    on the tiles: equal bits expected)."""
    win, x, w, b, dy = _conv_inputs()
    T, D = x.shape
    configs = ["default", "128,32,8,8,32,4", "128,64,4,8,32,4", "128,16,16,4,32,4", "128,16,16,2,32,4",
               "64,32,8,4,32,4", "256,32,8,8,32,4", "128,32,16,4,32,4", "128,32,4,4,32,4", "64,64,8,8,32,4",
               "128,32,8,4,64,8", "128,32,8,4,16,4", "128,32,8,4,32,8", "128,32,8,4,32,2", "64,32,8,4,64,4",
               "256,32,8,4,32,8", "64,16,16,2,16,2"]
    out = {"rows": T, "channels": D}
    ref = None
    for c in configs:
        try:
            # "default": KernelConfig's default (None), the measured tiles of ops.conv.triton
            tiles = kernel_config(args.kernels, conv_bwd_tiles=c).conv_bwd_tiles
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
        print(f"[conv tiles] {c}: {res}", flush=True)
    return out



def sum_conv(out):
    return [("reference", f"fwd+bwd {out['reference_fwdbwd_s'] * 1e3:.2f} ms"),
            ("fused", f"fwd+bwd {out['fused_fwdbwd_s'] * 1e3:.2f} ms "
                      f"({out['reference_fwdbwd_s'] / out['fused_fwdbwd_s']:.2f}x), dx rel "
                      f"{out['fused_vs_fp32_reference_rel_dx']:.2e}, rerun bits "
                      f"{'equal' if out['fused_backward_rerun_bit_identical'] else 'DIFFER'}")]


def sum_tiles(out):
    timed = {c: r["bwd_ms"] for c, r in out.items() if isinstance(r, dict) and "bwd_ms" in r}
    best = min(timed, key=timed.get)
    return [("default", f"{timed.get('default', float('nan')):.2f} ms"), ("best", f"{best} {timed[best]:.2f} ms")]


SECTIONS = [
    Section("conv", sec_conv, "fused vs gather-form short conv: time, fp32 accuracy, rerun bits", sum_conv),
    Section("tiles", sec_tiles, "fused backward under tile overrides", sum_tiles, default=False),
]


if __name__ == "__main__":
    sys.exit(run_suite("conv", SECTIONS, __doc__))
