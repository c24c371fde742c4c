"""The boundary-state gradient kernel under TRITON_INTERPRET=1 against its PyTorch reference,
and the chunk-grid bookkeeping of the replay path against the reference chunk_kda."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from harts.exec.gpu.kda import boundary_index  # noqa: E402
from harts.exec.gpu.kda_dhu import bwd_dhu_inject, bwd_dhu_reference  # noqa: E402
from harts.exec.ops.kda import chunk_kda  # noqa: E402
from harts.testing import assert_close  # noqa: E402

B = 64


def _grid(lens):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
    nt = (torch.tensor(lens) + B - 1) // B
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), nt.cumsum(0)])
    return cu, offs, int(offs[-1])


@pytest.mark.parametrize("lens,inject", [([70, 128, 37], True), ([200], False), ([64, 1, 130], True)])
def test_dhu_kernel_matches_reference(lens, inject):
    g = torch.Generator().manual_seed(sum(lens))
    H, K, V = 2, 32, 48
    cu, offs, NT = _grid(lens)
    T = int(cu[-1])
    q, k, w = (torch.randn(1, T, H, K, generator=g) for _ in range(3))
    gk = -torch.rand(1, T, H, K, generator=g) * 3
    do, dv = (torch.randn(1, T, H, V, generator=g) for _ in range(2))
    ext = torch.randn(NT, H, K, V, generator=g) if inject else None
    dh, dh0, dv2 = (x.clone() for x in bwd_dhu_inject(q, k, w, gk, do, dv, ext, cu, offs, NT, 0.3))
    ref = bwd_dhu_reference(q, k, w, gk, do, dv, ext, cu, 0.3)
    for name, got, want in zip(("dh", "dh0", "dv2"), (dh, dh0, dv2), ref, strict=True):
        assert torch.isfinite(got).all()
        assert_close(name, got, want, 1e-5)


def test_injection_is_linear_in_the_injected_gradient():
    # dh0 with an injection = dh0 without + the injection carried back alone (do = dv = 0)
    g = torch.Generator().manual_seed(7)
    H, K, V = 1, 16, 16
    cu, offs, NT = _grid([150])
    T = int(cu[-1])
    q, k, w = (torch.randn(1, T, H, K, generator=g) for _ in range(3))
    gk = -torch.rand(1, T, H, K, generator=g)
    do, dv = (torch.randn(1, T, H, V, generator=g) for _ in range(2))
    ext = torch.randn(NT, H, K, V, generator=g)
    with_ext = bwd_dhu_inject(q, k, w, gk, do, dv, ext, cu, offs, NT, 0.5)[1].clone()
    without = bwd_dhu_inject(q, k, w, gk, do, dv, None, cu, offs, NT, 0.5)[1].clone()
    alone = bwd_dhu_inject(q, k, w, gk, torch.zeros_like(do), torch.zeros_like(dv), ext, cu, offs, NT, 0.5)[1].clone()
    assert_close("linearity", with_ext, without + alone, 1e-5)


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
    assert ix["num_chunks"] == len(h)
    assert ix["last_chunk"].tolist() == (np.cumsum([(L + B - 1) // B for L in lens]) - 1).tolist()
