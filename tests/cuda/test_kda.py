"""KDA on the GPU: HARTS's fast chunk KDA (`chunk_kda_fast`, fla's kernels plus the replay
path's own state kernels) against the float32 reference, and its bit-identity claims."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fla.ops.kda import chunk_kda as fla_chunk_kda

from harts.config.kernels import KernelConfig
from harts.exec.ops.kda import chunk_kda as ref_kda
from harts.exec.ops.kda.fla import chunk_kda_fast, fwd_h_config
from tests.cuda.conftest import TOL_BF16, TOL_F32, assert_rel

pytestmark = pytest.mark.cuda

LENS = [64, 200, 128, 37, 320, 130]  # partial chunks, a sequence shorter than one chunk
H, K, V = 2, 64, 64
NAMES = ("q", "k", "v", "g", "beta", "h0")


def _inputs(dtype):
    torch.manual_seed(0)
    dev = "cuda"
    T, N = sum(LENS), len(LENS)
    q = torch.nn.functional.normalize(torch.randn(T, H, K, device=dev), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, device=dev), dim=-1)
    v = torch.randn(T, H, V, device=dev)
    g = -torch.rand(T, H, K, device=dev) * 0.3
    beta = torch.rand(T, H, device=dev)
    h0 = torch.randn(N, H, K, V, device=dev) * 0.1
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)] + [h0.clone().requires_grad_()]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(LENS)]), dtype=torch.int64)
    do = torch.randn(T, H, V, device=dev)
    dht = torch.randn(N, H, K, V, device=dev)
    return leaves, cu, do, dht


@pytest.mark.parametrize("states", [False, True], ids=["plain", "chunk_states"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fast_kda_matches_reference(dtype, states):
    leaves, cu, do, dht = _inputs(dtype)
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    r = ref_kda(*ref_leaves[:5], initial_state=ref_leaves[5], cu_seqlens=cu.cuda(), output_chunk_states=states)
    f = chunk_kda_fast(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu, output_chunk_states=states)
    outs_r, outs_f, cots = [r.o, r.final_state], [f.o, f.final_state], [do, dht]
    if states:
        assert torch.equal(f.chunk_state_offsets.cpu(), r.chunk_state_offsets.cpu())
        ds = torch.randn_like(r.chunk_states)
        outs_r.append(r.chunk_states)
        outs_f.append(f.chunk_states)
        cots.append(ds)
    gr = torch.autograd.grad(outs_r, ref_leaves, [c.to(o.dtype) for c, o in zip(cots, outs_r, strict=True)])
    gf = torch.autograd.grad(outs_f, leaves, [c.to(o.dtype) for c, o in zip(cots, outs_f, strict=True)])
    tol = TOL_F32 if dtype == torch.float32 else TOL_BF16
    assert_rel("o", f.o, r.o, tol)
    assert_rel("final_state", f.final_state, r.final_state, tol)
    if states:
        assert_rel("chunk_states", f.chunk_states, r.chunk_states, tol)
    for name, a, b in zip(NAMES, gf, gr, strict=True):
        assert_rel(f"d{name}", a, b, tol)


@pytest.mark.parametrize("launch", ["auto", "fla"], ids=["own_fwd_h", "fla_fwd_h"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plain_call_gives_fla_bits(dtype, launch):
    # a plain call (no states handed on) runs HARTS's states path with nothing selected:
    # with few sequences at `fwd_h_config`'s launch ("auto"), with many at fla's own (as
    # "fla" forces here); its outputs and gradients are fla's chunk_kda's bits either way
    leaves, cu, do, dht = _inputs(dtype)
    kernels = KernelConfig(kda_fwd_h=launch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (fwd_h_config(len(LENS), H, V, sms, kernels) is not None) == (launch == "auto")
    f = chunk_kda_fast(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu, kernels=kernels)
    fl = [x.detach().clone().requires_grad_() for x in leaves]
    o_fla, final_fla = fla_chunk_kda(*(x[None] for x in fl[:5]), scale=K**-0.5, initial_state=fl[5],
                                     output_final_state=True, cu_seqlens=cu.cuda())
    gf = torch.autograd.grad([f.o, f.final_state], leaves, [do.to(f.o.dtype), dht])
    gl = torch.autograd.grad([o_fla[0], final_fla], fl, [do.to(o_fla.dtype), dht])
    assert torch.equal(f.o, o_fla[0])
    assert torch.equal(f.final_state, final_fla)
    for name, a, b in zip(NAMES, gf, gl, strict=True):
        assert torch.equal(a, b), f"d{name} differs from fla's"


@pytest.mark.parametrize("states", [False, True], ids=["plain", "chunk_states"])
def test_call_with_new_cu_seqlens_does_not_synchronise(states):
    # a microbatch's first KDA call sees cu_seqlens objects no earlier call saw; neither its
    # forward nor its backward may wait for the device (a host copy of cu_seqlens given)
    leaves, cu, do, dht = _inputs(torch.bfloat16)
    chunk_kda_fast(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu,
                   output_chunk_states=states).o.sum().backward()  # compiles and tunes the kernels
    torch.cuda.synchronize()
    fresh_host = cu.clone()
    fresh = fresh_host.pin_memory().cuda(non_blocking=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        f = chunk_kda_fast(*leaves[:5], initial_state=leaves[5], cu_seqlens=fresh, cu_seqlens_cpu=fresh_host,
                           output_chunk_states=states)
        torch.autograd.backward([f.o, f.final_state], [do.to(f.o.dtype), dht])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_at_chunk_boundary_continues_bit_identically(dtype):
    leaves, _, _, _ = _inputs(dtype)
    seq = [x.detach()[:320] for x in leaves[:5]]
    with torch.no_grad():
        full = chunk_kda_fast(*seq, cu_seqlens=torch.tensor([0, 320]), output_chunk_states=True)
        first = chunk_kda_fast(*(x[:130] for x in seq), cu_seqlens=torch.tensor([0, 130]), output_chunk_states=True)
        s128 = first.chunk_states[1:2]  # the state after the first 128 rows (chunk 64: two chunks)
        second = chunk_kda_fast(*(x[128:] for x in seq), initial_state=s128, cu_seqlens=torch.tensor([0, 192]))
        plain = chunk_kda_fast(*seq, cu_seqlens=torch.tensor([0, 320]))
    assert torch.equal(second.o, full.o[128:])
    assert torch.equal(second.final_state, full.final_state)
    assert torch.equal(full.o, plain.o)  # the states path computes the plain path's output bits


def test_state_backward_fits_float32_at_the_models_head_size():
    # K = V = 128 (the models' KDA heads): in float32 the state backward's default launch
    # needs more shared memory than an H100 has, and must fall back to one that fits
    from harts.exec.ops.kda.dhu import bwd_dhu_inject, bwd_dhu_reference

    torch.manual_seed(5)
    lens, Hh, Kk, Vv, B = [300, 64, 130], 2, 128, 128, 64
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64, device="cuda")
    nt = [(n + B - 1) // B for n in lens]
    offs = torch.tensor(np.concatenate([[0], np.cumsum(nt)]), dtype=torch.int64, device="cuda")
    T, NT = sum(lens), sum(nt)
    q, k, w = (torch.nn.functional.normalize(torch.randn(1, T, Hh, Kk, device="cuda"), dim=-1) for _ in range(3))
    gk = -torch.rand(1, T, Hh, Kk, device="cuda") * 3
    do, dv = (torch.randn(1, T, Hh, Vv, device="cuda") for _ in range(2))
    ext_idx = torch.full((NT,), -1, dtype=torch.int64, device="cuda")
    ext_idx[torch.tensor([1, NT - 1])] = torch.arange(2, device="cuda")
    ext = torch.randn(2, Hh, Kk, Vv, device="cuda")
    for bv in (None, 16):
        got = bwd_dhu_inject(q, k, w, gk, do, dv, ext, ext_idx, cu, offs, NT, Kk**-0.5, block_v=bv)
        want = bwd_dhu_reference(q, k, w, gk, do, dv, ext, ext_idx, cu, Kk**-0.5)
        for name, a, b in zip(("dh", "dh0", "dv2"), got, want, strict=True):
            assert_rel(name, a, b, TOL_F32)
