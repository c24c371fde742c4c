"""Qwen3.5 text models (`model_type: qwen3_5_text`, dense FFNs) <-> HARTS, through the
Qwen3-Next mapping (`harts.models.hf.qwen3_next`).

Qwen3.5's text decoder is Qwen3-Next's: the same Gated DeltaNet (conv over q|k|v, A_log,
dt_bias, L2-normalised q/k, each q/k head serving consecutive value heads, SiLU-gated
norm), the same gated attention and zero-centred norms. Two things differ, both mapped
exactly:

- the GDN input projection is stored as four matrices (in_proj_qkv with q, k, v head-major,
  in_proj_z, in_proj_b, in_proj_a) rather than Qwen3-Next's two interleaved per q/k head
  group (in_proj_qkvz, in_proj_ba): the same rows in another order, permuted here (and back);
- the rotary embedding is multimodal (`mrope_section`, `mrope_interleaved`): for text every
  section sees the same position, so it is 1-D RoPE at that position (here: the depth).

Every layer's FFN is dense here (`Qwen3_5ForCausalLM`); the MoE variant is
`harts.models.hf.qwen3_5_moe`. The multimodal checkpoints (`model_type: qwen3_5` /
`qwen3_5_moe`, a `text_config` inside, `model.language_model.*` and `model.visual.*`
tensors) are not mapped: HARTS trains the text decoder, and writing such a checkpoint back
needs the vision tower's tensors carried through unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harts.config.models import ConfigError, LayerKind, ModelConfig
from harts.exec.model.weights import WeightLoadError
from harts.models.hf import qwen3_next
from harts.models.hf.adapter import HFAdapter

MODEL_TYPE = "qwen3_5_text"
_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def as_qwen3_next(cfg: dict, model_type: str, moe: bool) -> dict:
    """The Qwen3-Next config dict describing the same text decoder."""
    got = cfg.get("model_type")
    if got != model_type:
        hint = " (a multimodal checkpoint: its text_config is the text model)" if got in ("qwen3_5", "qwen3_5_moe") else ""
        raise ConfigError(f"model_type: expected {model_type!r}, got {got!r}{hint}")
    rope = dict(cfg.get("rope_parameters") or {})
    # text positions: every mrope section rotates by the same position, i.e. 1-D RoPE
    rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)
    out = {**cfg, "model_type": qwen3_next.MODEL_TYPE, "rope_parameters": rope or None}
    if moe:
        # Qwen3.5-MoE: every layer MoE, top-k weights always renormalised
        out.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    else:
        out.update(num_experts=0)
    return out


def _check_same(a: ModelConfig, b: ModelConfig) -> None:
    if a.replace(name=b.name) != b:
        raise ConfigError("hf_config: describes a different model than the state dict's config")


def to_config(cfg: dict) -> ModelConfig:
    return qwen3_next.to_config(as_qwen3_next(cfg, MODEL_TYPE, moe=False))


def split_to_fused(sd: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Qwen3.5's four GDN input projections as Qwen3-Next's two (rows permuted)."""
    c = config
    Hk, Hv, K, V = c.gdn_num_k_heads, c.gdn_num_v_heads, c.gdn_head_k_dim, c.gdn_head_v_dim
    r = Hv // Hk
    out = dict(sd)
    for i, kind in enumerate(c.layer_kinds):
        if kind != LayerKind.GDN:
            continue
        base = f"model.layers.{i}.linear_attn."
        for name in _SPLIT:
            if base + name + ".weight" not in sd:
                raise WeightLoadError(f"{base}{name}.weight: missing from the checkpoint")
        qkv, z, b, a = (out.pop(base + name + ".weight") for name in _SPLIT)
        D = qkv.shape[-1]
        want = {"in_proj_qkv": (2 * Hk * K + Hv * V, D), "in_proj_z": (Hv * V, D),
                "in_proj_b": (Hv, D), "in_proj_a": (Hv, D)}
        for name, t in zip(_SPLIT, (qkv, z, b, a), strict=True):
            if tuple(t.shape) != want[name]:
                raise WeightLoadError(f"{base}{name}.weight: expected {want[name]}, got {tuple(t.shape)}")
        q, k, v = qkv.split([Hk * K, Hk * K, Hv * V])
        qkvz = torch.cat([q.view(Hk, K, D), k.view(Hk, K, D), v.view(Hk, r * V, D), z.view(Hk, r * V, D)], dim=1)
        ba = torch.cat([b.view(Hk, r, D), a.view(Hk, r, D)], dim=1)
        out[base + "in_proj_qkvz.weight"] = qkvz.reshape(-1, D)
        out[base + "in_proj_ba.weight"] = ba.reshape(-1, D)
    return out


def fused_to_split(sd: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The inverse of `split_to_fused`, key order kept."""
    c = config
    Hk, Hv, K, V = c.gdn_num_k_heads, c.gdn_num_v_heads, c.gdn_head_k_dim, c.gdn_head_v_dim
    r = Hv // Hk
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        if key.endswith("linear_attn.in_proj_ba.weight"):
            continue
        if not key.endswith("linear_attn.in_proj_qkvz.weight"):
            out[key] = t
            continue
        base = key.removesuffix("in_proj_qkvz.weight")
        D = t.shape[-1]
        q, k, v, z = t.view(Hk, 2 * K + 2 * r * V, D).split([K, K, r * V, r * V], dim=1)
        b, a = sd[base + "in_proj_ba.weight"].view(Hk, 2 * r, D).split([r, r], dim=1)
        out[base + "in_proj_qkv.weight"] = torch.cat([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)])
        out[base + "in_proj_z.weight"] = z.reshape(-1, D)
        out[base + "in_proj_b.weight"] = b.reshape(-1, D)
        out[base + "in_proj_a.weight"] = a.reshape(-1, D)
    return {k: v.contiguous() for k, v in out.items()}


def to_harts(sd: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    return qwen3_next.to_harts(split_to_fused(sd, config), config)


def make_to_hf(to_config_fn):
    def to_hf(state: dict[str, Tensor], config: ModelConfig, hf_config: dict) -> dict[str, Tensor]:
        if hf_config:
            _check_same(to_config_fn(hf_config), config)
        return fused_to_split(qwen3_next.to_hf(state, config, {}), config)

    return to_hf


to_hf = make_to_hf(to_config)

ADAPTER = HFAdapter(model_type=MODEL_TYPE, to_config=to_config, to_harts=to_harts, to_hf=to_hf)
