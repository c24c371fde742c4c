"""The float64 reference harness (`tests/models/float64_reference.py`): the private copies of
transformers' modeling modules run transformers' own pure-torch GDN / KDA functions, in
float64 (they equal HARTS's token-by-token recurrences to 1e-12; fla's kernels compute in
float32 and would miss that by orders of magnitude), share transformers' configuration
classes, and leave `sys.modules` as they found it."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

from harts.exec.ops.gdn import naive_recurrent_gdn
from harts.exec.ops.kda.naive import naive_recurrent_kda
from tests.models.float64_reference import BLOCKED_PACKAGES, float64_module, torch_only_modeling

transformers = pytest.importorskip("transformers")

GDN_MODULES = [
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
]
KIMI = "transformers.models.kimi_linear.modeling_kimi_linear"


def _inputs(T: int, Hk: int, Hv: int, K: int, V: int, per_channel: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(rand(T, Hk, K), dim=-1), F.normalize(rand(T, Hk, K), dim=-1)
    v = rand(T, Hv, V)
    g = -torch.rand(T, Hv, *((K,) if per_channel else ()), generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(T, Hv, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


@pytest.mark.parametrize("name", GDN_MODULES)
def test_the_copy_runs_transformers_torch_gdn_in_float64(name):
    M = torch_only_modeling(name)
    T, Hk, Hv, K, V = 70, 2, 4, 6, 5  # two chunks of 64; each q/k head serves 2 value heads
    q, k, v, g, beta = _inputs(T, Hk, Hv, K, V, per_channel=False)
    with float64_module(M):
        o, state = M.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                  output_final_state=True)
    assert o.dtype == state.dtype == torch.float64
    # consecutive value heads share a q/k head
    o_ref, state_ref = naive_recurrent_gdn(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v, g, beta)
    assert float((o[0] - o_ref).abs().max()) <= 1e-12 * float(o_ref.abs().max())
    assert float((state - state_ref).abs().max()) <= 1e-12 * float(state_ref.abs().max())


def test_the_copy_runs_transformers_torch_kda_in_float64():
    M = torch_only_modeling(KIMI)
    q, k, v, g, beta = _inputs(70, 2, 2, 6, 5, per_channel=True, seed=1)
    with float64_module(M):
        o, state = M.chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                output_final_state=True)
    assert o.dtype == state.dtype == torch.float64
    o_ref, state_ref = naive_recurrent_kda(q, k, v, g, beta)
    assert float((o[0] - o_ref).abs().max()) <= 1e-12 * float(o_ref.abs().max())
    assert float((state - state_ref).abs().max()) <= 1e-12 * float(state_ref.abs().max())


def test_configs_are_shared_models_are_the_copys_and_sys_modules_is_left_alone():
    before = {n: sys.modules.get(n) for n in (*BLOCKED_PACKAGES, *GDN_MODULES, KIMI)}
    M = torch_only_modeling(GDN_MODULES[0])
    assert torch_only_modeling(GDN_MODULES[0]) is M  # one copy per module
    assert {n: sys.modules.get(n) for n in before} == before
    public = importlib.import_module(GDN_MODULES[0])
    assert public is not M
    assert M.Qwen3NextConfig is transformers.Qwen3NextConfig
    assert M.Qwen3NextForCausalLM is not transformers.Qwen3NextForCausalLM
    assert issubclass(M.Qwen3NextForCausalLM, transformers.PreTrainedModel)
    K = torch_only_modeling(KIMI)
    assert K.KimiLinearConfig is transformers.KimiLinearConfig
    for pkg in BLOCKED_PACKAGES:  # importable again where installed
        if before[pkg] is not None:
            assert importlib.import_module(pkg) is before[pkg]
