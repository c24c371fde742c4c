"""Per-op benchmarks on a CUDA device: fla's chunk_kda vs our replay path (boundary states
out, their gradients in; all of them, and a sparse request of a few as a tree round makes)
on the same packed tokens (`kda_op_benchmark`), FlexAttention over a DFS ancestor mask vs
dense causal SDPA (`attention_op_benchmark`), each per token / per attended pair,
forward+backward, and GEMM times (`gemm_profile`); rows also go out in the simulator's
profile schema (`harts.sim.profile/v1`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from harts.bench.timing import sync_cuda, time_cuda


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
    sync_cuda()
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
