"""Analytic parameter counts of a `ModelConfig`: exactly what `harts.exec.model.HybridModel`
would hold, without building it, so the Table 1 models (7.9B and 124B parameters) are
never instantiated on a CPU. `tests/exec/model/test_param_counts.py` holds the formulas to
`sum(p.numel())` of instantiated small models, so they and `harts.exec.model` cannot drift
apart silently. No torch.

Dimension names as in `harts.config.models`.
"""

from __future__ import annotations

from dataclasses import dataclass

from harts.config.models import LayerKind, ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # per token: all non-routed parameters + top_k of the E routed experts
    by_component: dict[str, int]
    active_by_component: dict[str, int]


def kda_layer_params(c: ModelConfig) -> int:
    d, h, k, v, w, r = c.d_model, c.kda_num_heads, c.kda_head_dim, c.kda_head_v_dim, c.conv_window, c.gate_rank
    qk = 2 * d * h * k
    vp = d * h * v
    conv = w * (2 * h * k + h * v)
    forget_gate = d * r + r * h * k + h + h * k  # low-rank f_proj, A_log [H], dt_bias [HK]
    beta = d * h
    out_gate = d * r + r * h * v + (h * v if c.kda_gate_bias else 0)  # low-rank g_proj (+ bias)
    o_norm = v
    o_proj = h * v * d
    return qk + vp + conv + forget_gate + beta + out_gate + o_norm + o_proj


def mla_layer_params(c: ModelConfig) -> int:
    d, h = c.d_model, c.mla_num_heads
    qk_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        q = d * h * qk_dim
    else:
        q = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * qk_dim
    kv_a = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
    kv_b = c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
    o = h * c.v_head_dim * d
    return q + kv_a + kv_b + o


def gdn_layer_params(c: ModelConfig) -> int:
    """Gated DeltaNet (Qwen3-Next): in_proj_qkvz, in_proj_ba, one conv over q|k|v, A_log and
    dt_bias per value head, the gated norm's weight, out_proj."""
    d, hk, hv, k, v, w = c.d_model, c.gdn_num_k_heads, c.gdn_num_v_heads, c.gdn_head_k_dim, c.gdn_head_v_dim, c.conv_window
    qkv = 2 * hk * k + hv * v
    return d * (qkv + hv * v) + d * 2 * hv + w * qkv + 2 * hv + v + hv * v * d


def gated_attention_layer_params(c: ModelConfig) -> int:
    """Qwen3-Next gated attention: q_proj (query and gate), k_proj, v_proj, o_proj, q/k norms."""
    d, h, kv, hd = c.d_model, c.attn_num_heads, c.attn_num_kv_heads, c.attn_head_dim
    return d * 2 * h * hd + 2 * d * kv * hd + h * hd * d + 2 * hd


def parameter_counts(config: ModelConfig) -> ParamCounts:
    """Exact parameter counts of `harts.exec.model.HybridModel(config)` without building it."""
    c = config.validate()
    d = c.d_model
    comp = {
        "embedding": c.vocab_size * d,
        "lm_head": 0 if c.tie_embeddings else c.vocab_size * d,
        "norms": (2 * c.num_layers + 1) * d,
        "kda": c.num_kda_layers * kda_layer_params(c),
        "mla": c.num_mla_layers * mla_layer_params(c),
        "dense_ffn": c.num_dense_layers_effective * 3 * d * c.dense_ffn_dim,
        "router": c.num_moe_layers * c.num_experts * d,
        "shared_experts": c.num_moe_layers * 3 * d * c.shared_ffn_dim,
        "routed_experts": c.num_moe_layers * c.num_experts * 3 * d * c.expert_ffn_dim,
    }
    # Qwen3-Next components, listed only when present (other models' breakdowns unchanged)
    extra = {
        "gdn": c.num_layers_of(LayerKind.GDN) * gdn_layer_params(c),
        "gated_attention": c.num_layers_of(LayerKind.GATED_ATTENTION) * gated_attention_layer_params(c),
        "shared_expert_gate": c.num_moe_layers * d if c.shared_expert_gate and c.shared_ffn_dim else 0,
    }
    comp.update({k: n for k, n in extra.items() if n})
    active = dict(comp)
    if c.num_moe_layers:
        active["routed_experts"] = c.num_moe_layers * c.top_k * 3 * d * c.expert_ffn_dim
    return ParamCounts(sum(comp.values()), sum(active.values()), comp, active)
