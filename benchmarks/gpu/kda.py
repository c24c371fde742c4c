"""KDA kernels on the GPU: HARTS's tree-path chunk KDA against fla's chunk_kda, and the launch
configurations of the two state kernels at a tree's round shapes.

    python3 benchmarks/gpu/kda.py [ops] [fwdh] [dhu] [--out DIR]

`ops`: fla chunk_kda against the tree path's replay call (every chunk-boundary state, and a
sparse request) on the same packed 32k tokens in 16 and 64 sequences, forward+backward
(run it without --no-autotune: both sides autotune). `fwdh` (not by default): fla's forward
state kernel at explicit BV x warps x stages (tree attention's `fwd_h` choice) on 1-3 long
sequences and 16 packed ones, against fla's own launch. `dhu` (not by default): the
injected-gradient state backward (`bwd_dhu_inject`) at value blocks 64/32/16 against fla's
`chunk_gated_delta_rule_bwd_dhu`. Correctness against float64: tests/cuda/test_kda.py.
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
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu  # noqa: E402
from fla.ops.utils import prepare_chunk_offsets  # noqa: E402

from benchmarks.gpu.common import Section, kernel_config, rel, run_suite, time_cuda  # noqa: E402
from harts.bench.ops import kda_op_benchmark  # noqa: E402
from harts.config.kernels import KernelConfig  # noqa: E402
from harts.exec.ops.kda.dhu import bwd_dhu_inject  # noqa: E402
from harts.exec.ops.kda.fla import _fla, _fwd_h, fwd_h_config  # noqa: E402
from harts.exec.ops.record import KernelRecord  # noqa: E402


def sec_ops(args):
    """fla chunk_kda vs the tree path's replay call (all boundary states, and a sparse
    request) on the same packed tokens, forward+backward, with autotuning (both sides), on
    the library's default KernelConfig (`kda_op_benchmark` takes none)."""
    out = {"kernel_config": KernelConfig().to_dict()}
    for n in (16, 64):
        r, _ = kda_op_benchmark(T=32768, num_seqs=n)
        out[f"kda_T32768_N{n}"] = r
        print(f"[kda ops] N={n}: fla {r['fla_fwdbwd_s']*1e3:.2f} ms ours {r['ours_fwdbwd_s']*1e3:.2f} "
              f"sparse {r['ours_sparse_fwdbwd_s']*1e3:.2f} -> {r['ours_over_fla_per_token']:.3f}x / "
              f"{r['ours_sparse_over_fla_per_token']:.3f}x", flush=True)
        torch.cuda.empty_cache()
    return out


def sec_fwdh(args):
    """fla's forward state kernel (chunk_gated_delta_rule_fwd_kernel_h_blockdim64, fp32
    state history as the tree path writes it) at the shapes of a tree's rounds (1-3 long
    sequences) and of packed batches (16), with fla's own launch (the first config under
    --no-autotune) and explicit configs BV x warps x stages through `harts.exec.ops.kda.fla._fwd_h`
    (KernelConfig.kda_fwd_h); outputs compared with fla's launch (16 heads, K = V = 128, bf16,
    chunk 64). A launch fla does not take falls back to fla's own for that call: its
    "fallbacks" say so."""
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
            kernels, record = kernel_config(args.kernels, kda_fwd_h=c), KernelRecord()

            def run():
                return _fwd_h(f, kg, w, u, gk, h0, cu, offs, NT, B, h_dtype=torch.float32,  # noqa: B023
                              with_final=True, kernels=kernels, record=record)  # noqa: B023

            try:
                o = run()
                if ref is None:
                    ref = o
                err = max(rel(a, r) for a, r in zip(o, ref, strict=True))
                res[c] = {"ms": 1e3 * time_cuda(run, repeats=10), "rel_vs_fla": err,
                          "fallbacks": record.to_dict()["fallbacks"]}
            except Exception as e:  # noqa: BLE001
                res[c] = {"error": f"{type(e).__name__}: {e}"[:300]}
        out["x".join(map(str, lens)) if len(set(lens)) > 1 else f"{len(lens)}x{lens[0]}"] = res
        print(f"[kda fwdh] {lens}: {res}", flush=True)
    return out


def sec_dhu(args):
    """The injected-gradient state backward (`bwd_dhu_inject`) at the shapes of a tree's
    replay rounds (1-3 long sequences: one program per value block x sequence x head, so
    few sequences leave SMs idle) and of packed batches (16 sequences), with value blocks
    of 64 / 32 / 16, next to fla's `chunk_gated_delta_rule_bwd_dhu` on the same inputs
    (no injection; 16 heads, K = V = 128, bf16, chunk 64)."""
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
        print(f"[kda dhu] {lens}: {res}", flush=True)
    return out



def sum_ops(out):
    return [(k, f"fla {r['fla_fwdbwd_s'] * 1e3:.2f} ms, ours {r['ours_fwdbwd_s'] * 1e3:.2f} ms "
                f"({r['ours_over_fla_per_token']:.3f}x per token), sparse {r['ours_sparse_over_fla_per_token']:.3f}x")
            for k, r in out.items() if isinstance(r, dict) and "fla_fwdbwd_s" in r]


def sum_sweep(out):
    rows = []
    for k, res in out.items():
        if not isinstance(res, dict):
            continue
        timed = {c: r["ms"] for c, r in res.items() if isinstance(r, dict) and "ms" in r}
        if timed:
            best = min(timed, key=timed.get)
            rows.append((k, f"best {best} {timed[best]:.2f} ms" + (f", fla {timed['fla']:.2f} ms" if "fla" in timed else "")))
        elif "bv16_ms" in res:
            rows.append((k, ", ".join(f"{c} {res[c]:.2f}" for c in ("bv64_ms", "bv32_ms", "bv16_ms", "fla_ms") if c in res)))
    return rows


SECTIONS = [
    Section("ops", sec_ops, "fla chunk_kda vs the tree path's replay call, fwd+bwd at 16/64 sequences", sum_ops),
    Section("fwdh", sec_fwdh, "forward state kernel launch configs at round shapes", sum_sweep, default=False),
    Section("dhu", sec_dhu, "injected-gradient state backward by value block vs fla", sum_sweep, default=False),
]


if __name__ == "__main__":
    sys.exit(run_suite("kda", SECTIONS, __doc__))
