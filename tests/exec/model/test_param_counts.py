"""The analytic parameter count (used by the simulator for models never built on CPU) equals
the instantiated model's, in total and per component."""

from __future__ import annotations

import pytest

from harts.config.param_counts import parameter_counts
from harts.exec.model import build_model
from harts.exec.model.gated_attention import GatedAttentionMixer
from harts.exec.model.gdn import GDNMixer
from harts.exec.model.kda import KDAMixer
from harts.exec.model.layers import SwiGLU
from harts.exec.model.mla import MLAMixer
from harts.exec.model.moe import MoE

VARIANTS = [
    {},
    {"tie_embeddings": True},
    {"q_lora_rank": 12},
    {"use_rope": True},
    {"kda_per_mla": 0, "num_layers": 2},
    {"kda_per_mla": 1, "num_layers": 6, "num_dense_layers": 2},
    {"num_shared_experts": 0, "router": "sigmoid"},
    {"num_shared_experts": 2, "expert_ffn_dim": 24, "num_experts": 6, "top_k": 3},
    {"kda_gate_rank": 5, "kda_head_v_dim": 12, "conv_window": 3},
    {"num_dense_layers": 4, "num_experts": 0, "top_k": 0},
    {"qk_rope_head_dim": 0},
    # Qwen3-Next: GDN + gated attention (GQA, partial RoPE), kinds as data, a gated shared
    # expert of its own width, zero-centred norms, a KDA and an MLA layer beside them
    {"layer_kind_list": ("gdn", "gated_attention", "kda", "mla"), "ffn_kind_list": ("moe", "dense", "moe", "moe"),
     "gdn_num_k_heads": 1, "gdn_num_v_heads": 3, "gdn_head_k_dim": 6, "gdn_head_v_dim": 5,
     "attn_num_heads": 4, "attn_num_kv_heads": 2, "attn_head_dim": 6, "attn_rotary_dim": 2,
     "shared_expert_ffn_dim": 12, "shared_expert_gate": True, "norm_offset": True, "router_renormalize": False},
    # Hugging Face (Kimi-Linear) fields: an explicit layer pattern, no output-gate bias, the
    # router's correction bias (a buffer, not a parameter) and grouped top-k
    {"layer_kind_list": ("kda", "mla", "kda", "kda", "mla"), "num_layers": 5, "kda_gate_bias": False,
     "router": "sigmoid", "router_score_bias": True, "router_groups": 2, "router_topk_groups": 1,
     "routed_scaling_factor": 2.5, "router_renormalize": False, "mla_norm_eps": 1e-6},
]


def _numel(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


@pytest.mark.parametrize("changes", VARIANTS, ids=[",".join(v)[:60] or "base" for v in VARIANTS])
def test_analytic_count_equals_instantiated(make_config, changes):
    config = make_config(**changes)
    model = build_model(config)
    counts = parameter_counts(config)
    assert counts.total == sum(p.numel() for p in model.parameters())
    by = counts.by_component
    assert by["kda"] == _numel(m for m in model.modules() if isinstance(m, KDAMixer))
    assert by["mla"] == _numel(m for m in model.modules() if isinstance(m, MLAMixer))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert by["router"] == _numel(m.router for m in moes)
    assert by["routed_experts"] == sum(m.w_gate.numel() + m.w_up.numel() + m.w_down.numel() for m in moes)
    assert by["shared_experts"] == _numel(m.shared for m in moes if m.shared is not None)
    assert by.get("shared_expert_gate", 0) == _numel(m.shared_gate for m in moes if m.shared_gate is not None)
    assert by.get("gdn", 0) == _numel(m for m in model.modules() if isinstance(m, GDNMixer))
    assert by.get("gated_attention", 0) == _numel(m for m in model.modules() if isinstance(m, GatedAttentionMixer))
    assert by["dense_ffn"] == _numel(b.ffn for b in model.layers if isinstance(b.ffn, SwiGLU))
    assert by["embedding"] == model.embed.weight.numel()
    assert by["lm_head"] == (0 if config.tie_embeddings else model.lm_head.weight.numel())


def test_tiny_cpu_count():
    model = build_model("tiny-cpu")
    assert parameter_counts(model.config).total == model.num_parameters()
