"""Implementation selection: references on CPU and for float64, force_reference forces them on CUDA."""

import torch
import torch.nn.functional as F

from harts.config.kernels import KernelConfig
from harts.exec import backend
from harts.exec.backend import Impl
from harts.testing import assert_close


def test_cpu_and_float64_run_the_references():
    assert backend.kda_impl(torch.device("cpu"), torch.float32) is Impl.REFERENCE
    assert backend.kda_impl(torch.device("cuda"), torch.float64) is Impl.REFERENCE
    assert backend.tree_attention(torch.arange(3), torch.tensor([2, 2, 2]), torch.device("cpu")) is None


def test_force_reference_switch(libraries):
    libraries.set(fla=True, flex=True, grouped_mm=True)
    assert backend.kda_impl(torch.device("cuda"), torch.bfloat16) is Impl.FLA
    assert backend.tree_attention_impl(torch.device("cuda")) is Impl.FLEX
    forced = KernelConfig(force_reference=True)
    assert backend.kda_impl(torch.device("cuda"), torch.bfloat16, forced) is Impl.REFERENCE
    assert backend.tree_attention_impl(torch.device("cuda"), forced) is Impl.REFERENCE


def test_reference_kda_and_causal_attention_on_cpu():
    g = torch.Generator().manual_seed(0)
    T, H, K = 70, 2, 8
    q, k, v = (torch.randn(T, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    gg = -torch.rand(T, H, K, generator=g, dtype=torch.float64)
    beta = torch.rand(T, H, generator=g, dtype=torch.float64)
    from harts.exec.ops.kda import chunk_kda

    assert torch.equal(backend.chunk_kda(q, k, v, gg, beta).o, chunk_kda(q, k, v, gg, beta).o)
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v[..., :4]))
    from harts.exec.ops.attention.causal import causal_attention

    assert_close("causal", causal_attention(qh, kh, vh, 0.3),
                 F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=0.3), 1e-15)
