"""`tiny-h200`: a model shaped like Table 1's Tiny that trains on ONE H200 with AdamW.

Tiny itself (7.8B parameters) does not fit: AdamW keeps 2 moments per parameter, so even
in bf16 its parameters, gradients and moments take 7.8B x 8 B = 63 GB before one
activation, and a step over a SWE-bench-sized group (hundreds of thousands of tokens)
takes minutes. `tiny-h200` keeps Tiny's *shape* -- 3:1 KDA:MLA groups, KDA 16 heads x 128,
MLA 8 heads (latent 512, qk 128 + 64, value 128, no RoPE), d_model 1536, first layer
dense (8192), MoE top-8 with one shared expert of 512, sigmoid router -- with 8 layers
instead of 24, 64 routed experts instead of 128, and a 32k vocabulary (the loss
materialises one [rows, vocab] logit block per microbatch; at 163,840 and 100k-token
microbatches that alone is tens of GB). Every per-token cost therefore sits in the same
proportions as Tiny's: what tree mode saves is token-wise work, which all of these are.

Kept out of `harts.config.models`' registry on purpose (that file is being edited by
others); `resolve_model` accepts this name wherever a registered one is accepted.
"""

from __future__ import annotations

from harts.config.models import ModelConfig, get_model_config

TINY_H200 = ModelConfig(
    name="tiny-h200", vocab_size=32_768, d_model=1536, num_layers=8, kda_per_mla=3,
    kda_num_heads=16, kda_head_dim=128, kda_head_v_dim=128, conv_window=4, chunk_size=64,
    mla_num_heads=8, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, use_rope=False,
    num_dense_layers=1, dense_ffn_dim=8192, num_experts=64, top_k=8, expert_ffn_dim=512,
    num_shared_experts=1, router="sigmoid", aux_loss_coef=1e-3,
).validate()

EXTRA_MODELS = {TINY_H200.name: TINY_H200}


def resolve_model(name: str) -> ModelConfig:
    """A registered model config, or one of the extra configs defined here."""
    if name in EXTRA_MODELS:
        return EXTRA_MODELS[name]
    return get_model_config(name)
