"""The boundary-state gradient kernel under TRITON_INTERPRET=1 against its PyTorch reference
(dense, sparse and no injection), and the chunk-grid bookkeeping of the replay path (state
selection, compact gradient injection) against the reference chunk_kda."""


from tests.exec.gpu import interpret_triton  # noqa: E402

interpret_triton()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from harts.config.kernels import KernelConfig  # noqa: E402
from harts.exec.ops.kda import chunk_kda  # noqa: E402
from harts.exec.ops.kda.dhu import bwd_dhu_inject, bwd_dhu_reference, value_block  # noqa: E402
from harts.exec.ops.kda.fla import (  # noqa: E402
    boundary_index,
    build_injection,
    fwd_h_config,
    state_gather,
)
from harts.testing import assert_close  # noqa: E402

B = 64


def _grid(lens):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
    nt = (torch.tensor(lens) + B - 1) // B
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), nt.cumsum(0)])
    return cu, offs, int(offs[-1])


def _problem(lens, H, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    cu, offs, NT = _grid(lens)
    T = int(cu[-1])
    q, k, w = (torch.randn(1, T, H, K, generator=g) for _ in range(3))
    gk = -torch.rand(1, T, H, K, generator=g) * 3
    do, dv = (torch.randn(1, T, H, V, generator=g) for _ in range(2))
    return (q, k, w, gk, do, dv), cu, offs, NT, g


def _injection(kind, NT, H, K, V, g):
    """(ext, ext_idx): none, every chunk (identity map), or a few chunks in shuffled rows."""
    if kind == "none":
        return None, None
    if kind == "dense":
        return torch.randn(NT, H, K, V, generator=g), torch.arange(NT)
    chunks = torch.randperm(NT, generator=g)[: max(1, NT // 3)]
    ext_idx = torch.full((NT,), -1, dtype=torch.int64)
    ext_idx[chunks] = torch.arange(chunks.numel())
    return torch.randn(chunks.numel(), H, K, V, generator=g), ext_idx


@pytest.mark.parametrize("lens,inject", [([70, 128, 37], "dense"), ([200], "none"), ([64, 1, 130], "sparse"),
                                         ([130, 256, 64, 5], "sparse")])
def test_dhu_kernel_matches_reference(lens, inject):
    H, K, V = 2, 32, 48
    ins, cu, offs, NT, g = _problem(lens, H, K, V, sum(lens))
    ext, ext_idx = _injection(inject, NT, H, K, V, g)
    dh, dh0, dv2 = (x.clone() for x in bwd_dhu_inject(*ins, ext, ext_idx, cu, offs, NT, 0.3))
    ref = bwd_dhu_reference(*ins, ext, ext_idx, cu, 0.3)
    for name, got, want in zip(("dh", "dh0", "dv2"), (dh, dh0, dv2), ref, strict=True):
        assert torch.isfinite(got).all()
        assert_close(name, got, want, 1e-5)


@pytest.mark.parametrize("block_v", [16, 32])
def test_dhu_kernel_matches_reference_at_narrow_value_blocks(block_v):
    """The value blocks chosen for rounds of few sequences (V = 48: a partial last block)."""
    H, K, V, lens = 2, 32, 48, [130, 70]
    ins, cu, offs, NT, g = _problem(lens, H, K, V, 7)
    ext, ext_idx = _injection("sparse", NT, H, K, V, g)
    got = [x.clone() for x in bwd_dhu_inject(*ins, ext, ext_idx, cu, offs, NT, 0.3, block_v=block_v)]
    for name, a, want in zip(("dh", "dh0", "dv2"), got, bwd_dhu_reference(*ins, ext, ext_idx, cu, 0.3), strict=True):
        assert_close(name, a, want, 1e-5)


def test_dhu_launch_that_does_not_fit_falls_back_to_fewer_stages(monkeypatch):
    """A launch Triton refuses for shared memory (float32 at K = 128 on an H100) is retried
    with fewer pipeline stages, then narrower value blocks; the values are the reference's,
    and a later call starts from the first launch that was not refused."""
    from triton.runtime.errors import OutOfResources

    from harts.exec.ops.kda import dhu

    real, tried = dhu._bwd_dhu_inject_kernel, []

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append((kw["BV"], kw.get("num_stages")))
                if kw.get("num_stages", 3) > 1:
                    raise OutOfResources(323584, 232448, "shared memory")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(dhu, "_bwd_dhu_inject_kernel", Refusing())
    monkeypatch.setattr(dhu, "_DOES_NOT_FIT", {})
    H, K, V, lens = 2, 32, 48, [130, 70]
    ins, cu, offs, NT, g = _problem(lens, H, K, V, 11)
    ext, ext_idx = _injection("sparse", NT, H, K, V, g)
    got = [x.clone() for x in bwd_dhu_inject(*ins, ext, ext_idx, cu, offs, NT, 0.3, block_v=32)]
    assert tried == [(32, None), (32, 2), (32, 1)]
    for name, a, want in zip(("dh", "dh0", "dv2"), got, bwd_dhu_reference(*ins, ext, ext_idx, cu, 0.3), strict=True):
        assert_close(name, a, want, 1e-5)
    tried.clear()
    bwd_dhu_inject(*ins, ext, ext_idx, cu, offs, NT, 0.3, block_v=32)
    assert tried == [(32, 1)]
    assert dhu.launch_configs(64) == [(64, None), (64, 2), (64, 1), (32, 1), (16, 1)]

    class Refusing_all:  # nothing fits: the narrowest launch's own error, not a generic one
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise OutOfResources(100000 * kw["BV"], 232448, "shared memory")
            return launch

    monkeypatch.setattr(dhu, "_bwd_dhu_inject_kernel", Refusing_all())
    with pytest.raises(OutOfResources, match="Required: 1600000"):
        bwd_dhu_inject(*ins, ext, ext_idx, cu, offs, NT, 0.3, block_v=64)


def test_value_block_keeps_the_sms_busy():
    # 16 heads, V = 128, 132 SMs (the H200): 1 sequence -> 16, 2-3 -> 32, 16 -> 64
    assert [value_block(n, 16, 128, 132) for n in (1, 2, 3, 4, 16)] == [16, 32, 32, 64, 64]
    assert value_block(1, 16, 128, None) == 64  # no SM count (CPU, interpreter): as before


def test_forward_state_config_only_for_rounds_that_leave_sms_idle():
    # one long sequence on 132 SMs: an explicit narrow value block; 4+ sequences: fla's own
    assert fwd_h_config(1, 16, 128, 132) is not None and fwd_h_config(1, 16, 128, 132)[0] < 32
    assert fwd_h_config(16, 16, 128, 132) is None
    assert fwd_h_config(1, 16, 128, None) is None  # no SM count: fla's own
    assert fwd_h_config(1, 16, 128, 132, KernelConfig(kda_fwd_h="fla")) is None
    assert fwd_h_config(16, 16, 128, 132, KernelConfig(kda_fwd_h="32,2,3")) == (32, 2, 3)


def test_forward_state_falls_back_to_flas_launch_when_its_signature_differs():
    """An fla whose kernel does not take the explicit config (another version's signature)
    gets its own launch, with a warning naming what ran, instead of a crash. The fallback
    is per call: a later call tries the configured launch again (and warns once per record)."""
    import warnings

    from harts.exec.ops.kda import fla as kda_mod
    from harts.exec.ops.record import KernelFallbackWarning, KernelRecord

    calls, tries = [], []

    class Jit:
        def __getitem__(self, grid):
            def launch(**kw):
                tries.append(kw["BV"])
                raise TypeError("unexpected keyword argument 'IS_VARLEN'")
            return launch

    class Kernel:
        fn = type("Autotuned", (), {"fn": Jit()})()

        def __getitem__(self, grid):
            return lambda **kw: calls.append(sorted(kw))

    kernels = KernelConfig(kda_fwd_h="16,4,3")
    record = KernelRecord()
    f = {"chunk_gated_delta_rule_fwd_kernel_h_blockdim64": Kernel()}
    kg = torch.zeros(1, 8, 2, 4)
    u = torch.zeros(1, 8, 2, 4)
    with pytest.warns(KernelFallbackWarning, match="kda_fwd_h: requested BV=16,warps=4,stages=3, ran fla .*own launch"):
        kda_mod._fwd_h(f, kg, kg, u, kg, None, torch.tensor([0, 8]), None, 1, 64,
                       h_dtype=torch.float32, with_final=True, kernels=kernels, record=record)
    assert len(calls) == 1 and "BV" not in calls[0] and tries == [16]
    assert record.to_dict()["ran"] == {"kda_fwd_h": ["fla"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same (op, reason) on the same record: no second warning
        kda_mod._fwd_h(f, kg, kg, u, kg, None, torch.tensor([0, 8]), None, 1, 64, h_dtype=torch.float32,
                       with_final=True, kernels=kernels, record=record)
    assert len(calls) == 2 and tries == [16, 16]  # tried again: nothing sticks between calls
    assert len(record.fallbacks) == 1


def test_sparse_injection_equals_the_dense_one_with_zeros_elsewhere():
    H, K, V = 1, 16, 16
    ins, cu, offs, NT, g = _problem([150, 64, 90], H, K, V, 5)
    ext, ext_idx = _injection("sparse", NT, H, K, V, g)
    dense = torch.zeros(NT, H, K, V)
    at = (ext_idx >= 0).nonzero().squeeze(1)
    dense[at] = ext[ext_idx[at]]
    sparse_out = [x.clone() for x in bwd_dhu_inject(*ins, ext, ext_idx, cu, offs, NT, 0.5)]
    dense_out = [x.clone() for x in bwd_dhu_inject(*ins, dense, torch.arange(NT), cu, offs, NT, 0.5)]
    for name, a, b in zip(("dh", "dh0", "dv2"), sparse_out, dense_out, strict=True):
        assert torch.equal(a, b), name


def test_injection_is_linear_in_the_injected_gradient():
    # dh0 with an injection = dh0 without + the injection carried back alone (do = dv = 0)
    H, K, V = 1, 16, 16
    (q, k, w, gk, do, dv), cu, offs, NT, g = _problem([150], H, K, V, 7)
    gk = gk / 3
    ext, ext_idx = _injection("sparse", NT, H, K, V, g)
    with_ext = bwd_dhu_inject(q, k, w, gk, do, dv, ext, ext_idx, cu, offs, NT, 0.5)[1].clone()
    without = bwd_dhu_inject(q, k, w, gk, do, dv, None, None, cu, offs, NT, 0.5)[1].clone()
    alone = bwd_dhu_inject(q, k, w, gk, torch.zeros_like(do), torch.zeros_like(dv), ext, ext_idx, cu, offs, NT,
                           0.5)[1].clone()
    assert_close("linearity", with_ext, without + alone, 1e-5)


def test_compact_injection_adds_gradients_that_meet_at_one_chunk():
    # the dense buffer the injection replaces: every state gradient and every final-state
    # gradient index_added at its chunk
    lens = [64, 200, 0, 128, 37]
    cu, _, NT = _grid(lens)
    ix = boundary_index(cu.numpy(), B)
    g = torch.Generator().manual_seed(11)
    H, K, V = 2, 4, 3
    # the last full state of sequences 0 and 3 sits at their last chunk; one state twice
    sel = np.array([0, 4, 2, 5, 4])
    chunk_sel = ix["chunk"][sel]
    dstates = torch.randn(sel.size, H, K, V, generator=g, dtype=torch.float64)
    dht = torch.randn(len(lens), H, K, V, generator=g, dtype=torch.float64)
    has = ix["last_chunk"] >= 0
    for ds, dh in ((dstates, dht), (dstates, None), (None, dht), (None, None)):
        ext, ext_idx = build_injection(ds, dh, chunk_sel, ix["last_chunk"], NT)
        dense = torch.zeros(NT, H, K, V, dtype=torch.float64)
        if ds is not None:
            dense.index_add_(0, torch.from_numpy(chunk_sel), ds)
        if dh is not None:
            dense.index_add_(0, torch.from_numpy(ix["last_chunk"][has]), dh[torch.from_numpy(has)])
        if ext is None:
            assert ds is None and dh is None
            continue
        assert ext.dtype == torch.float32 and ext_idx.shape == (NT,)
        # one row per chunk that receives anything
        assert ext.shape[0] == int((dense.flatten(1) != 0).any(1).sum()) == int((ext_idx >= 0).sum())
        got = torch.zeros(NT, H, K, V, dtype=torch.float32)
        at = (ext_idx >= 0).nonzero().squeeze(1)
        got[at] = ext[ext_idx[at]]
        assert_close("injection", got, dense, 1e-6)


def test_boundary_index_picks_the_reference_chunk_states():
    g = torch.Generator().manual_seed(3)
    lens = [64, 200, 37, 128, 130]
    cu, _, _ = _grid(lens)
    T, H, K, V = int(cu[-1]), 2, 8, 8
    q = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(T, H, V, generator=g, dtype=torch.float64)
    gg = -torch.rand(T, H, K, generator=g, dtype=torch.float64) * 0.3
    beta = torch.rand(T, H, generator=g, dtype=torch.float64)
    h0 = torch.randn(len(lens), H, K, V, generator=g, dtype=torch.float64)
    out = chunk_kda(q, k, v, gg, beta, initial_state=h0, cu_seqlens=cu, output_chunk_states=True)
    ix = boundary_index(cu.numpy(), B)
    assert np.array_equal(ix["state_offsets"], out.chunk_state_offsets.numpy())
    # h: the state entering every chunk, as fla's forward lays it out
    h = []
    for n, L in enumerate(lens):
        states = out.chunk_states[out.chunk_state_offsets[n]:out.chunk_state_offsets[n + 1]]
        for j in range((L + B - 1) // B):
            h.append(h0[n] if j == 0 else states[j - 1])
    picked = torch.cat([torch.stack(h), out.final_state])[torch.from_numpy(ix["source"])]
    assert torch.equal(picked, out.chunk_states)
    # the forward's two-part gather of a selection (h rows, final rows) picks the same
    sel = np.array([6, 0, 3, 3, 1])
    parts = state_gather(ix["source"][sel], len(h))
    got = torch.empty(sel.size, H, K, V, dtype=torch.float64)
    got[parts["pos_h"]] = torch.stack(h)[parts["src_h"]]
    got[parts["pos_f"]] = out.final_state[parts["src_f"]]
    assert parts["pos_f"].size and parts["pos_h"].size
    assert torch.equal(got, out.chunk_states[sel])
    assert ix["num_chunks"] == len(h)
    assert ix["last_chunk"].tolist() == (np.cumsum([(L + B - 1) // B for L in lens]) - 1).tolist()
