"""Every checkpoint adapter's tensor mapping, without transformers: exact round trips on
random tensors, and each head's rows where the checkpoint format puts them.

The expected layouts are written here from the checkpoint formats (transformers'
modeling code), not from the adapters: a checkpoint tensor is built whose row encodes
(role, head, channel) as its value, the adapter maps it, and the HARTS tensor's rows must
hold the codes HARTS's mixer reads there (`harts.exec.model.gdn`: Qwen3-Next's own layout).

- Qwen3-Next `linear_attn.in_proj_qkvz` / `in_proj_ba` (`fix_query_key_value_ordering`):
  per q/k head g, [q_g (K) | k_g (K) | v of value heads g r .. g r + r - 1 (r V) | z of
  them (r V)], and [b of those r heads | a of them]; HARTS keeps them as they are.
- Qwen3.5 `in_proj_qkv` = [q of q/k heads 0..Hk-1 | k of them | v of value heads
  0..Hv-1], `in_proj_z` per value head, `in_proj_b` / `in_proj_a` one row per value head;
  value head h reads q/k head h // r (`repeat_interleave` in its GDN).
- the GDN conv over [q heads | k heads | v heads] channels, stored [C, 1, W].
- fused experts `gate_up_proj` [E, 2F, D]: gate rows first (`.chunk(2)`); per-expert
  checkpoints `experts.{e}.{gate,up,down}_proj`; Kimi's `experts.{e}.w1` (gate), `w3`
  (up), `w2` (down); Kimi's `A_log` [1, 1, H, 1], one per head.
"""

from __future__ import annotations

import pytest
import torch

from harts.config.models import FFNKind, LayerKind
from harts.exec.model.model import HybridModel
from harts.models.hf import kimi_linear, qwen3_5, qwen3_5_moe, qwen3_next

# small shapes with every dimension distinct where it can be: Hk q/k heads, Hv value heads
# (r = 3 per q/k head), K key dim, V value dim, D model dim, W conv window
HK, HV, K, V, D, W = 2, 6, 3, 2, 5, 4

QWEN3_NEXT = dict(
    model_type="qwen3_next", vocab_size=11, hidden_size=D, intermediate_size=7, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=1, head_dim=4, linear_conv_kernel_dim=W,
    linear_key_head_dim=K, linear_value_head_dim=V, linear_num_key_heads=HK, linear_num_value_heads=HV,
    moe_intermediate_size=3, shared_expert_intermediate_size=5, num_experts_per_tok=2, num_experts=3,
    mlp_only_layers=[1], layer_types=["linear_attention", "full_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
QWEN3_5 = {**{k: v for k, v in QWEN3_NEXT.items() if not k.startswith(("moe_", "shared_", "num_experts", "mlp_"))},
           "model_type": "qwen3_5_text"}
QWEN3_5_MOE = {**QWEN3_5, "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 3,
               "shared_expert_intermediate_size": 5, "num_experts_per_tok": 2, "num_experts": 3}
KIMI = dict(
    model_type="kimi_linear", vocab_size=13, hidden_size=8, intermediate_size=10, moe_intermediate_size=3,
    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=4, q_lora_rank=3,
    qk_rope_head_dim=2, v_head_dim=3, qk_nope_head_dim=4, n_group=1, topk_group=1, num_experts_per_tok=2,
    num_local_experts=4, n_shared_experts=1,
    linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2], "head_dim": 3, "num_heads": 2,
                        "short_conv_kernel_size": W},
    first_k_dense_replace=1,
)
ADAPTERS = {
    "qwen3_next": (qwen3_next.ADAPTER, QWEN3_NEXT),
    "qwen3_5_text": (qwen3_5.ADAPTER, QWEN3_5),
    "qwen3_5_moe_text": (qwen3_5_moe.ADAPTER, QWEN3_5_MOE),
    "kimi_linear": (kimi_linear.ADAPTER, KIMI),
}
ROLES = {"q": 1, "k": 2, "v": 3, "z": 4, "b": 5, "a": 6}


def code(role: str, head: int, channel: int) -> int:
    return ROLES[role] * 10_000 + head * 100 + channel


def rows(codes: list[int], cols: int) -> torch.Tensor:
    """[len(codes), cols]: row i holds codes[i] * 1000 + column (exact in float64)."""
    return torch.tensor(codes, dtype=torch.float64)[:, None] * 1000 + torch.arange(cols, dtype=torch.float64)


def qwen3_next_codes() -> tuple[list[int], list[int]]:
    """(in_proj_qkvz rows, in_proj_ba rows) as a Qwen3-Next checkpoint stores them."""
    r = HV // HK
    qkvz: list[int] = []
    ba: list[int] = []
    for g in range(HK):
        qkvz += [code("q", g, i) for i in range(K)] + [code("k", g, i) for i in range(K)]
        for role in "vz":
            qkvz += [code(role, g * r + j, i) for j in range(r) for i in range(V)]
        ba += [code("b", g * r + j, 0) for j in range(r)] + [code("a", g * r + j, 0) for j in range(r)]
    return qkvz, ba


def qwen3_5_codes() -> dict[str, list[int]]:
    """Qwen3.5's four GDN input projections' rows."""
    return {
        "in_proj_qkv": [code(x, h, i) for x in "qk" for h in range(HK) for i in range(K)]
        + [code("v", h, i) for h in range(HV) for i in range(V)],
        "in_proj_z": [code("z", h, i) for h in range(HV) for i in range(V)],
        "in_proj_b": [code("b", h, 0) for h in range(HV)],
        "in_proj_a": [code("a", h, 0) for h in range(HV)],
    }


def conv_codes() -> list[int]:
    return [code(x, h, i) for x in "qk" for h in range(HK) for i in range(K)] + [
        code("v", h, i) for h in range(HV) for i in range(V)]


def _random_checkpoint(name: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], object]:
    """Every tensor of the adapter's checkpoint format, random; bfloat16 in even layers,
    float32 elsewhere (one dtype per layer, as a checkpoint stores a layer's projections)."""
    adapter, hf = ADAPTERS[name]
    config = adapter.to_config(hf)
    if name == "kimi_linear":
        shapes = kimi_linear.hf_shapes(config)
    else:
        model = HybridModel(config)
        shapes = {k: tuple(v.shape) for k, v in adapter.to_hf(model.state_dict(), config, hf).items()}
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, shape in sorted(shapes.items()):
        t = torch.randn(shape, generator=gen)
        layer = key.split(".")[2] if key.startswith("model.layers.") else "1"
        sd[key] = t.to(torch.bfloat16) if int(layer) % 2 == 0 else t
    return sd, config


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_round_trip_is_exact_on_random_tensors(name):
    adapter, hf = ADAPTERS[name]
    sd, config = _random_checkpoint(name)
    state = adapter.to_harts(sd, config)
    model = HybridModel(config)
    assert set(state) == set(model.state_dict())
    for k, t in model.state_dict().items():
        assert state[k].shape == t.shape, k
    back = adapter.to_hf(state, config, hf)
    assert sorted(back) == sorted(sd)
    for k, t in sd.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


def _gdn_layers(config) -> list[int]:
    return [i for i, kind in enumerate(config.layer_kinds) if kind == LayerKind.GDN]


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_gdn_heads_land_where_the_checkpoint_format_says(name):
    adapter, hf = ADAPTERS[name]
    sd, config = _random_checkpoint(name)
    sd = {k: v.to(torch.float64) for k, v in sd.items()}
    assert _gdn_layers(config) == [0, 2]
    qkvz, ba = qwen3_next_codes()
    for i in _gdn_layers(config):
        p = f"model.layers.{i}.linear_attn."
        if name == "qwen3_next":
            sd[p + "in_proj_qkvz.weight"], sd[p + "in_proj_ba.weight"] = rows(qkvz, D), rows(ba, D)
        else:
            for proj, codes in qwen3_5_codes().items():
                assert sd[p + proj + ".weight"].shape == (len(codes), D)
                sd[p + proj + ".weight"] = rows(codes, D)
        sd[p + "conv1d.weight"] = rows(conv_codes(), W)[:, None, :]
        sd[p + "A_log"] = torch.tensor([code("a", h, 9) for h in range(HV)], dtype=torch.float64)
    state = adapter.to_harts(sd, config)
    for i in _gdn_layers(config):
        m = f"layers.{i}.mixer."
        assert torch.equal(state[m + "in_proj_qkvz.weight"], rows(qkvz, D))
        assert torch.equal(state[m + "in_proj_ba.weight"], rows(ba, D))
        assert torch.equal(state[m + "conv"], rows(conv_codes(), W))
        assert state[m + "A_log"].tolist() == [code("a", h, 9) for h in range(HV)]
    back = adapter.to_hf(state, config, hf)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe_text"])
def test_fused_experts_split_gate_first_and_per_expert_checkpoints_load_the_same(name):
    adapter, hf = ADAPTERS[name]
    sd, config = _random_checkpoint(name)
    moe = [i for i, f in enumerate(config.ffn_kinds) if f == FFNKind.MOE]
    assert moe
    E, F_ = config.num_experts, config.expert_ffn_dim
    per_expert = dict(sd)
    for i in moe:
        e = f"model.layers.{i}.mlp.experts."
        gate_up, down = per_expert.pop(e + "gate_up_proj"), per_expert.pop(e + "down_proj")
        assert gate_up.shape == (E, 2 * F_, config.d_model) and down.shape == (E, config.d_model, F_)
        for j in range(E):
            per_expert[f"{e}{j}.gate_proj.weight"] = gate_up[j, :F_]
            per_expert[f"{e}{j}.up_proj.weight"] = gate_up[j, F_:]
            per_expert[f"{e}{j}.down_proj.weight"] = down[j]
    state = adapter.to_harts(sd, config)
    for i in moe:
        e, f = f"model.layers.{i}.mlp.experts.", f"layers.{i}.ffn."
        for j in range(E):
            assert torch.equal(state[f + "w_gate"][j], sd[e + "gate_up_proj"][j, :F_])
            assert torch.equal(state[f + "w_up"][j], sd[e + "gate_up_proj"][j, F_:])
            assert torch.equal(state[f + "w_down"][j], sd[e + "down_proj"][j])
    if name == "qwen3_next":  # Qwen3.5 reads only the fused layout transformers writes
        again = adapter.to_harts(per_expert, config)
        assert sorted(again) == sorted(state)
        assert all(torch.equal(again[k], state[k]) for k in state)


# HARTS name -> checkpoint name of every tensor mapped one to one (layer-local suffixes)
_QWEN_SAME = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "mixer.dt_bias": "linear_attn.dt_bias", "mixer.A_log": "linear_attn.A_log",
    "mixer.norm.weight": "linear_attn.norm.weight", "mixer.out_proj.weight": "linear_attn.out_proj.weight",
    **{f"mixer.{x}.weight": f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                              "k_norm")},
    **{f"ffn.{x}.weight": f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")},
    "ffn.router.weight": "mlp.gate.weight", "ffn.shared_gate.weight": "mlp.shared_expert_gate.weight",
    **{f"ffn.shared.{x}.weight": f"mlp.shared_expert.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")},
}
_KIMI_SAME = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"mixer.{x}": f"self_attn.{x}" for x in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "dt_bias",
                                                 "b_proj.weight", "o_norm.weight", "o_proj.weight",
                                                 "q_a_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")},
    "mixer.f_proj.0.weight": "self_attn.f_a_proj.weight", "mixer.f_proj.1.weight": "self_attn.f_b_proj.weight",
    "mixer.g_proj.0.weight": "self_attn.g_a_proj.weight", "mixer.g_proj.1.weight": "self_attn.g_b_proj.weight",
    "mixer.q_a_norm.weight": "self_attn.q_a_layernorm.weight", "mixer.kv_a_proj.weight":
        "self_attn.kv_a_proj_with_mqa.weight", "mixer.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    **{f"ffn.{x}.weight": f"block_sparse_moe.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")},
    "ffn.router.weight": "block_sparse_moe.gate.weight", "ffn.score_bias": "block_sparse_moe.gate.e_score_correction_bias",
    **{f"ffn.shared.{x}.weight": f"block_sparse_moe.shared_experts.{x}.weight"
       for x in ("gate_proj", "up_proj", "down_proj")},
}


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_one_to_one_tensors_keep_their_names_meaning(name):
    adapter, _ = ADAPTERS[name]
    sd, config = _random_checkpoint(name)
    state = adapter.to_harts(sd, config)
    same = _KIMI_SAME if name == "kimi_linear" else _QWEN_SAME
    pairs = [("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
             ("lm_head.weight", "lm_head.weight")]
    pairs += [(f"layers.{i}.{a}", f"model.layers.{i}.{b}") for i in range(config.num_layers) for a, b in same.items()
              if f"model.layers.{i}.{b}" in sd]
    assert len(pairs) > 3 * config.num_layers
    for ours, theirs in pairs:
        assert torch.equal(state[ours], sd[theirs]), (ours, theirs)


def test_kimi_heads_experts_and_convs_land_where_the_checkpoint_says():
    adapter, hf = ADAPTERS["kimi_linear"]
    sd, config = _random_checkpoint("kimi_linear")
    H, Kh = config.kda_num_heads, config.kda_head_dim
    kda = [i for i, kind in enumerate(config.layer_kinds) if kind == LayerKind.KDA]
    moe = [i for i, f in enumerate(config.ffn_kinds) if f == FFNKind.MOE]
    assert kda == [0, 2] and moe == [1, 2]
    for i in kda:
        p = f"model.layers.{i}.self_attn."
        sd[p + "A_log"] = torch.tensor([code("a", h, 0) for h in range(H)], dtype=torch.float64).view(1, 1, H, 1)
        for x in "qkv":  # channel c of head h = c // Kh
            sd[f"{p}{x}_conv1d.weight"] = rows([code(x, c // Kh, c % Kh) for c in range(H * Kh)], W)[:, None, :]
    state = adapter.to_harts(sd, config)
    for i in kda:
        m = f"layers.{i}.mixer."
        assert state[m + "A_log"].tolist() == [code("a", h, 0) for h in range(H)]
        for x in "qkv":
            assert torch.equal(state[f"{m}{x}_conv"], rows([code(x, c // Kh, c % Kh) for c in range(H * Kh)], W))
    for i in moe:
        e, f = f"model.layers.{i}.block_sparse_moe.experts.", f"layers.{i}.ffn."
        for j in range(config.num_experts):
            assert torch.equal(state[f + "w_gate"][j], sd[f"{e}{j}.w1.weight"])
            assert torch.equal(state[f + "w_up"][j], sd[f"{e}{j}.w3.weight"])
            assert torch.equal(state[f + "w_down"][j], sd[f"{e}{j}.w2.weight"])
    back = adapter.to_hf(state, config, hf)
    assert all(back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]) for k in sd)
