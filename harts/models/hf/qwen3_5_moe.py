"""Qwen3.5-MoE text models (`model_type: qwen3_5_moe_text`) <-> HARTS: Qwen3.5's mapping
(`harts.models.hf.qwen3_5`: split GDN projections, text RoPE) with Qwen3-Next's MoE in
every layer (softmax top-k, always renormalised, one gated shared expert)."""

from __future__ import annotations

from harts.config.models import ModelConfig
from harts.models.hf import qwen3_next
from harts.models.hf.adapter import HFAdapter
from harts.models.hf.qwen3_5 import as_qwen3_next, make_to_hf, to_harts

MODEL_TYPE = "qwen3_5_moe_text"


def to_config(cfg: dict) -> ModelConfig:
    return qwen3_next.to_config(as_qwen3_next(cfg, MODEL_TYPE, moe=True))


ADAPTER = HFAdapter(model_type=MODEL_TYPE, to_config=to_config, to_harts=to_harts, to_hf=make_to_hf(to_config))
