"""Qwen3-Next (`model_type: qwen3_next`): transformers' config and state dict <-> HARTS.

Layers: `layer_types` ("linear_attention" -> `LayerKind.GDN`, "full_attention" ->
`LayerKind.GATED_ATTENTION`, or every `full_attention_interval`-th layer full when absent);
FFNs: a layer is MoE when num_experts > 0, it is not in `mlp_only_layers` and
(layer + 1) % decoder_sparse_step == 0, else a dense SwiGLU of `intermediate_size`. The MoE
is a softmax router over `num_experts`, top `num_experts_per_tok`, renormalised when
`norm_topk_prob`, plus one shared expert of `shared_expert_intermediate_size` scaled by
sigmoid(shared_expert_gate x). Norms are zero-centred RMSNorms (weight + 1) in float32
(`norm_float32`), the GDN output norm a plain-weight RMSNorm gated by SiLU(z).

The auxiliary loss: transformers adds one only with `output_router_logits`, so
`aux_loss_coef` is `router_aux_loss_coef` then and 0 otherwise; where it is on, HARTS's own
per-layer form (`harts.exec.model.moe`) is what is optimised. `mtp.*` tensors (the
multi-token-prediction head, which transformers' model does not load) are not part of the
HybridModel. Experts are read in either layout a checkpoint has them (transformers'
fused `experts.gate_up_proj` / `experts.down_proj`, or one `experts.{e}.{gate,up,down}_proj`
per expert, the published checkpoints' layout) and written in the fused layout that
transformers reads and writes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harts.config.models import ConfigError, FFNKind, LayerKind, ModelConfig
from harts.exec.model.weights import WeightLoadError
from harts.models.hf.adapter import HFAdapter

MODEL_TYPE = "qwen3_next"
_LAYER_TYPES = {"linear_attention": LayerKind.GDN, "full_attention": LayerKind.GATED_ATTENTION}


def _get(cfg: dict, field: str, default=None, *, required: bool = False):
    if field not in cfg or cfg[field] is None:
        if required:
            raise ConfigError(f"{field}: missing from the checkpoint's config")
        return default
    return cfg[field]


def _rope(cfg: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from `rope_parameters` or the older flat fields."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "default":
            raise ConfigError(f"rope_scaling: rope type {kind!r} is not supported (only 'default')")
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ConfigError(f"rope_parameters.rope_type: {kind!r} is not supported (only 'default')")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


def to_config(cfg: dict) -> ModelConfig:
    """The HybridModel config of a Qwen3-Next `config.json` dict; ConfigError names the
    first field HARTS cannot compute exactly."""
    model_type = cfg.get("model_type")
    if model_type != MODEL_TYPE:
        raise ConfigError(f"model_type: expected {MODEL_TYPE!r}, got {model_type!r}")
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act: {act!r} is not supported (the GDN conv and the FFNs run SiLU)")
    if _get(cfg, "attention_bias", False):
        raise ConfigError("attention_bias: biased attention projections are not supported")
    if _get(cfg, "attention_dropout", 0.0):
        raise ConfigError(f"attention_dropout: {cfg['attention_dropout']} (HARTS trains without dropout)")
    n = int(_get(cfg, "num_hidden_layers", required=True))
    layer_types = _get(cfg, "layer_types")
    if layer_types is None:
        interval = int(_get(cfg, "full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if len(layer_types) != n:
        raise ConfigError(f"layer_types: {len(layer_types)} entries for num_hidden_layers={n}")
    for t in layer_types:
        if t not in _LAYER_TYPES:
            raise ConfigError(f"layer_types: {t!r} is not supported (known: {', '.join(_LAYER_TYPES)})")
    num_experts = int(_get(cfg, "num_experts", 0))
    step = int(_get(cfg, "decoder_sparse_step", 1))
    if num_experts and step < 1:
        raise ConfigError(f"decoder_sparse_step: must be >= 1, got {step}")
    mlp_only = set(_get(cfg, "mlp_only_layers", []) or [])
    ffn = tuple(
        FFNKind.MOE if (i not in mlp_only and num_experts > 0 and (i + 1) % step == 0) else FFNKind.DENSE
        for i in range(n)
    )
    head_dim = int(_get(cfg, "head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    theta, factor = _rope(cfg)
    rotary = head_dim * factor
    if rotary != int(rotary):
        raise ConfigError(f"partial_rotary_factor: {factor} x head_dim {head_dim} is not a whole number of channels")
    moe = FFNKind.MOE in ffn
    try:
        return ModelConfig(
            name=str(cfg.get("_name_or_path") or MODEL_TYPE).rstrip("/").rsplit("/", 1)[-1] or MODEL_TYPE,
            vocab_size=int(cfg["vocab_size"]), d_model=int(cfg["hidden_size"]), num_layers=n, kda_per_mla=0,
            layer_kind_list=tuple(_LAYER_TYPES[t] for t in layer_types), ffn_kind_list=ffn,
            conv_window=int(_get(cfg, "linear_conv_kernel_dim", 4)),
            gdn_num_k_heads=int(_get(cfg, "linear_num_key_heads", 16)),
            gdn_num_v_heads=int(_get(cfg, "linear_num_value_heads", 32)),
            gdn_head_k_dim=int(_get(cfg, "linear_key_head_dim", 128)),
            gdn_head_v_dim=int(_get(cfg, "linear_value_head_dim", 128)),
            attn_num_heads=int(cfg["num_attention_heads"]), attn_num_kv_heads=int(cfg["num_key_value_heads"]),
            attn_head_dim=head_dim, attn_rotary_dim=int(rotary), rope_theta=theta,
            num_dense_layers=0, dense_ffn_dim=int(_get(cfg, "intermediate_size", 0)),
            num_experts=num_experts if moe else 0,
            top_k=int(_get(cfg, "num_experts_per_tok", 0)) if moe else 0,
            expert_ffn_dim=int(_get(cfg, "moe_intermediate_size", 0)) if moe else 0,
            num_shared_experts=1 if moe else 0,
            shared_expert_ffn_dim=int(_get(cfg, "shared_expert_intermediate_size", 0)) if moe else None,
            shared_expert_gate=True, router="softmax", router_renormalize=bool(_get(cfg, "norm_topk_prob", True)),
            aux_loss_coef=float(_get(cfg, "router_aux_loss_coef", 0.0)) if _get(cfg, "output_router_logits") else 0.0,
            norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)), norm_float32=True, norm_offset=True,
            tie_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
            init_std=float(_get(cfg, "initializer_range", 0.02)),
        ).validate()
    except ConfigError as err:
        raise ConfigError(f"{MODEL_TYPE} config: {err}") from err


# HF name under "model.layers.{i}." -> HybridModel name under "layers.{i}.", per layer kind
_GDN_KEYS = {f"linear_attn.{k}": f"mixer.{k}" for k in
             ("in_proj_qkvz.weight", "in_proj_ba.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")}
_ATTN_KEYS = {f"self_attn.{k}.weight": f"mixer.{k}.weight" for k in
              ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
_DENSE_KEYS = {f"mlp.{k}.weight": f"ffn.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")}
_MOE_KEYS = {"mlp.gate.weight": "ffn.router.weight", "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
             **{f"mlp.shared_expert.{k}.weight": f"ffn.shared.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")}}


def _take(sd: dict[str, Tensor], used: set[str], key: str) -> Tensor:
    if key not in sd:
        raise WeightLoadError(f"{key}: missing from the checkpoint")
    used.add(key)
    return sd[key]


def to_harts(sd: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The HybridModel state dict of a Qwen3-Next state dict (transformers' key names)."""
    c = config
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    out["embed.weight"] = _take(sd, used, "model.embed_tokens.weight")
    out["norm.weight"] = _take(sd, used, "model.norm.weight")
    if c.tie_embeddings:
        if "lm_head.weight" in sd:
            if not torch.equal(sd["lm_head.weight"], out["embed.weight"]):
                raise WeightLoadError("lm_head.weight: differs from model.embed_tokens.weight with tie_word_embeddings")
            used.add("lm_head.weight")
    else:
        out["lm_head.weight"] = _take(sd, used, "lm_head.weight")
    for i, (kind, ffn) in enumerate(zip(c.layer_kinds, c.ffn_kinds, strict=True)):
        hf, hs = f"model.layers.{i}.", f"layers.{i}."
        out[hs + "attn_norm.weight"] = _take(sd, used, hf + "input_layernorm.weight")
        out[hs + "ffn_norm.weight"] = _take(sd, used, hf + "post_attention_layernorm.weight")
        if kind == LayerKind.GDN:
            for a, b in _GDN_KEYS.items():
                out[hs + b] = _take(sd, used, hf + a)
            conv = _take(sd, used, hf + "linear_attn.conv1d.weight")
            if conv.dim() != 3 or conv.shape[1] != 1:
                raise WeightLoadError(f"{hf}linear_attn.conv1d.weight: expected [C, 1, W], got {tuple(conv.shape)}")
            out[hs + "mixer.conv"] = conv[:, 0, :]
        else:
            for a, b in _ATTN_KEYS.items():
                out[hs + b] = _take(sd, used, hf + a)
        if ffn == FFNKind.DENSE:
            for a, b in _DENSE_KEYS.items():
                out[hs + b] = _take(sd, used, hf + a)
            continue
        for a, b in _MOE_KEYS.items():
            out[hs + b] = _take(sd, used, hf + a)
        if hf + "mlp.experts.gate_up_proj" in sd:
            gate_up = _take(sd, used, hf + "mlp.experts.gate_up_proj")
            F_ = c.expert_ffn_dim
            if gate_up.dim() != 3 or gate_up.shape[1] != 2 * F_:
                raise WeightLoadError(f"{hf}mlp.experts.gate_up_proj: expected [E, {2 * F_}, D], got "
                                      f"{tuple(gate_up.shape)}")
            out[hs + "ffn.w_gate"], out[hs + "ffn.w_up"] = gate_up[:, :F_], gate_up[:, F_:]
            out[hs + "ffn.w_down"] = _take(sd, used, hf + "mlp.experts.down_proj")
        else:
            for name, proj in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                out[hs + "ffn." + name] = torch.stack([
                    _take(sd, used, f"{hf}mlp.experts.{e}.{proj}.weight") for e in range(c.num_experts)])
    unexpected = sorted(k for k in sd if k not in used and not k.startswith("mtp."))
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f", ... ({len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        raise WeightLoadError(f"{len(unexpected)} checkpoint tensors do not belong to this config: {shown}")
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(state: dict[str, Tensor], config: ModelConfig, hf_config: dict) -> dict[str, Tensor]:
    """A HybridModel state dict under Qwen3-Next's key names (fused experts); `hf_config`
    (the checkpoint's config dict) is checked to describe the same model."""
    if hf_config and to_config(hf_config).replace(name=config.name) != config:
        raise ConfigError("hf_config: describes a different model than the state dict's config")
    c = config
    out: dict[str, Tensor] = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i, (kind, ffn) in enumerate(zip(c.layer_kinds, c.ffn_kinds, strict=True)):
        hf, hs = f"model.layers.{i}.", f"layers.{i}."
        out[hf + "input_layernorm.weight"] = state[hs + "attn_norm.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[hs + "ffn_norm.weight"]
        if kind == LayerKind.GDN:
            out.update({hf + a: state[hs + b] for a, b in _GDN_KEYS.items()})
            out[hf + "linear_attn.conv1d.weight"] = state[hs + "mixer.conv"][:, None, :]
        else:
            out.update({hf + a: state[hs + b] for a, b in _ATTN_KEYS.items()})
        if ffn == FFNKind.DENSE:
            out.update({hf + a: state[hs + b] for a, b in _DENSE_KEYS.items()})
        else:
            out.update({hf + a: state[hs + b] for a, b in _MOE_KEYS.items()})
            out[hf + "mlp.experts.gate_up_proj"] = torch.cat([state[hs + "ffn.w_gate"], state[hs + "ffn.w_up"]], dim=1)
            out[hf + "mlp.experts.down_proj"] = state[hs + "ffn.w_down"]
    return {k: v.contiguous() for k, v in out.items()}


ADAPTER = HFAdapter(model_type=MODEL_TYPE, to_config=to_config, to_harts=to_harts, to_hf=to_hf)
