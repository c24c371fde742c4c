"""HARTS's Gated DeltaNet layer (`harts.exec.model.gdn.GDNMixer`) against the layer written
out token by token in float64, from the published definitions (no transformers needed):

- projections in Qwen3-Next's checkpoint layout (transformers' `fix_query_key_value_ordering`):
  in_proj_qkvz per q/k head g = [q_g | k_g | v, z of value heads g r .. g r + r - 1],
  in_proj_ba per g = [b | a] of those heads;
- causal depthwise conv (window W, zero history) + SiLU over [q heads | k heads | v heads];
- q, k L2-normalised (x / sqrt(sum x^2 + 1e-6)), q scaled by K^-1/2, value head h reads
  q/k head h // r;
- Gated DeltaNet (Yang et al., "Gated Delta Networks"; transformers'
  `torch_recurrent_gated_delta_rule`, fla's naive recurrence), per value head with state
  S (K x V) from zero: g_t = -exp(A_log) softplus(a_t + dt_bias), beta_t = sigmoid(b_t),
      S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t;
- RMSNorm(o_t) * weight * SiLU(z_t) per value head, then out_proj.

Two sequences packed (the state restarts), chunk size 4 so HARTS's chunked kernel crosses
chunk boundaries; outputs and the gradients of the input and every parameter must agree
within 1e-10 (relative RMS).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harts.config.models import LayerKind
from harts.exec.model import PackedContext
from harts.exec.model.gdn import GDNMixer
from harts.models.hf import qwen3_next
from harts.testing import assert_close

HK, HV, K, V, D, W = 2, 4, 4, 3, 8, 4
EPS = 1e-6
LENGTHS = (9, 6)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config():
    return qwen3_next.to_config(dict(
        model_type="qwen3_next", vocab_size=7, hidden_size=D, intermediate_size=6, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4, linear_conv_kernel_dim=W,
        linear_key_head_dim=K, linear_value_head_dim=V, linear_num_key_heads=HK, linear_num_value_heads=HV,
        num_experts=0, layer_types=["linear_attention"], rms_norm_eps=EPS,
    ))


def reference_layer(x, p):
    """The GDN layer on one sequence x [T, D], a plain loop over tokens and heads."""
    T, r, G = x.shape[0], HV // HK, 2 * K + 2 * (HV // HK) * V
    qkvz, ba = x @ p["in_proj_qkvz.weight"].T, x @ p["in_proj_ba.weight"].T
    conv_in, z, b, a = [], [], [], []
    for t in range(T):
        q_ = [qkvz[t, g * G: g * G + K] for g in range(HK)]
        k_ = [qkvz[t, g * G + K: g * G + 2 * K] for g in range(HK)]
        v_ = [qkvz[t, g * G + 2 * K + j * V: g * G + 2 * K + (j + 1) * V] for g in range(HK) for j in range(r)]
        z.append([qkvz[t, g * G + 2 * K + r * V + j * V: g * G + 2 * K + r * V + (j + 1) * V]
                  for g in range(HK) for j in range(r)])
        b.append([ba[t, g * 2 * r + j] for g in range(HK) for j in range(r)])
        a.append([ba[t, g * 2 * r + r + j] for g in range(HK) for j in range(r)])
        conv_in.append(torch.cat(q_ + k_ + v_))
    w = p["conv"]  # [C, W]: tap W-1 multiplies the current token
    mixed = []
    for t in range(T):
        acc = sum(w[:, j] * conv_in[t - (W - 1) + j] for j in range(W) if t - (W - 1) + j >= 0)
        mixed.append(F.silu(acc))
    states = [torch.zeros(K, V, dtype=x.dtype) for _ in range(HV)]
    out = []
    for t in range(T):
        heads = []
        for h in range(HV):
            g = h // r
            q = mixed[t][g * K: (g + 1) * K]
            k = mixed[t][HK * K + g * K: HK * K + (g + 1) * K]
            v = mixed[t][2 * HK * K + h * V: 2 * HK * K + (h + 1) * V]
            q = q / torch.sqrt((q * q).sum() + 1e-6) * K ** -0.5
            k = k / torch.sqrt((k * k).sum() + 1e-6)
            beta = torch.sigmoid(b[t][h])
            decay = -torch.exp(p["A_log"][h]) * F.softplus(a[t][h] + p["dt_bias"][h])
            S = torch.exp(decay) * states[h]
            S = S + beta * torch.outer(k, v - S.T @ k)
            states[h] = S
            o = S.T @ q
            o = o / torch.sqrt((o * o).mean() + EPS) * p["norm.weight"] * F.silu(z[t][h])
            heads.append(o)
        out.append(p["out_proj.weight"] @ torch.cat(heads))
    return torch.stack(out)


def test_gdn_layer_equals_the_token_by_token_definition():
    config = _config()
    assert config.layer_kinds == (LayerKind.GDN,)
    torch.manual_seed(0)
    mixer = GDNMixer(config, 0).to(torch.float64)
    with torch.no_grad():
        mixer.reset_special_parameters()
        mixer.A_log.copy_(torch.empty(HV, dtype=torch.float64).uniform_(0.2, 2.0).log())
        mixer.dt_bias.normal_(0.0, 0.5)
        mixer.norm.weight.normal_(1.0, 0.2)
        mixer.conv.mul_(2.0)
    params = dict(mixer.named_parameters())
    gen = torch.Generator().manual_seed(1)
    T = sum(LENGTHS)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(T, D, generator=gen, dtype=torch.float64)

    ctx = PackedContext(torch.tensor([0, LENGTHS[0], T]), chunk_size=4)
    ours = mixer(x, ctx)
    ours_grads = torch.autograd.grad((ours * weight).sum(), [x, *params.values()])

    ref = torch.cat([reference_layer(x[s:e], params) for s, e in ((0, LENGTHS[0]), (LENGTHS[0], T))])
    ref_grads = torch.autograd.grad((ref * weight).sum(), [x, *params.values()])

    # the decays are far from 0 and 1: a wrong decay cannot hide
    with torch.no_grad():
        dec = torch.exp(-torch.exp(mixer.A_log) * F.softplus(mixer.dt_bias))
    assert float(dec.min()) < 0.6 and float(dec.max()) < 0.95
    assert_close("output", ours, ref, 1e-10)
    for name, g_ours, g_ref in zip(["x", *params], ours_grads, ref_grads, strict=True):
        assert_close(f"d{name}", g_ours, g_ref, 1e-10)
