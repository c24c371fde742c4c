"""Small float64 model configs for the model tests."""

from __future__ import annotations

import pytest

from harts.config.models import ModelConfig, get_model_config


def small_config(**changes: object) -> ModelConfig:
    base = get_model_config("tiny-cpu").replace(
        name="test-small", vocab_size=64, d_model=32, num_layers=4, kda_per_mla=3,
        kda_num_heads=2, kda_head_dim=8, kda_head_v_dim=8, chunk_size=16,
        mla_num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        num_dense_layers=1, dense_ffn_dim=32, num_experts=4, top_k=2, expert_ffn_dim=16,
        init_std=0.2,
    )
    return base.replace(**changes) if changes else base


@pytest.fixture
def make_config():
    return small_config
