"""Kimi-Linear (`model_type: kimi_linear`) checkpoints, as transformers' `KimiLinearForCausalLM`
reads and `save_pretrained` writes them.

What the transformers model computes, and where HARTS computes the same:

- layers: `layer_types` ("linear_attention" = KDA, "full_attention" = MLA), else
  `linear_attn_config.kda_layers` / `full_attn_layers` (1-based), else transformers' default
  (full attention at 0-based layers 4, 8, ...) -> `ModelConfig.layer_kind_list`. FFNs:
  `mlp_layer_types` ("dense" / "sparse"), else the first `first_k_dense_replace` dense;
  HARTS needs the dense layers first (`num_dense_layers`).
- KDA: q/k/v projections, one depthwise conv over [q | k | v] (stored as three convs) with
  `hidden_act` (SiLU) -> the three HARTS convs; forget gate -exp(A_log) softplus(f_b f_a x +
  dt_bias), beta = sigmoid(b_proj x), q/k L2-normalised (eps 1e-6), scale K^-1/2, the output
  RMSNorm (eps `rms_norm_eps`) times sigmoid(g_b g_a x) (no bias), o_proj. Gate rank, key and
  value head dims are all `linear_head_dim`.
- MLA: q full rank or q_a -> RMSNorm -> q_b (`q_lora_rank`), kv_a_proj_with_mqa -> [latent |
  shared key part], latent RMSNorm, kv_b_proj; no rotary embedding at all (the shared key
  part is plain channels: `use_rope=False`), scale (nope + rope)^-1/2. Its two RMSNorms use
  eps 1e-6 (the class default), not `rms_norm_eps`.
- MoE: sigmoid scores; the experts are chosen on scores + e_score_correction_bias within the
  best `topk_group` of `n_group` groups; weights the chosen scores, renormalised when
  `norm_topk_prob` (denominator + 1e-20), times `routed_scaling_factor`; plus the shared
  experts (`moe_intermediate_size` x `n_shared_experts`). The router computes in float32
  for half-precision inputs (`router_float32`). No auxiliary loss (`aux_loss_coef=0`).
- RMSNorms compute in float32 for half-precision inputs (`norm_float32=True`); untied LM head
  (`KimiLinearForCausalLM` never ties, whatever `tie_word_embeddings` says).

The tensors are named as on disk: `block_sparse_moe` for every FFN (`mlp` is read too),
one tensor per expert (w1 gate, w3 up, w2 down), `q_conv1d` / `k_conv1d` / `v_conv1d`
[C, 1, W], `A_log` [1, 1, H, 1].
"""

from __future__ import annotations

import torch
from torch import Tensor

from harts.config.models import ConfigError, LayerKind, ModelConfig
from harts.models.hf.adapter import CheckpointKeyError, HFAdapter

MODEL_TYPE = "kimi_linear"

# transformers' KimiLinearConfig defaults (the published Kimi-Linear-48B-A3B values), used
# where config.json leaves a field out, as transformers does
_DEFAULTS: dict[str, object] = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": None, "n_shared_experts": 1,
    "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False,
    "attention_dropout": 0.0, "num_local_experts": 256, "linear_head_dim": 128, "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4, "first_k_dense_replace": 1,
}
# the same field under the names transformers writes (its attribute_map) or reads
_ALIASES: dict[str, tuple[str, ...]] = {
    "norm_topk_prob": ("moe_renormalize",),
    "n_group": ("num_expert_group",),
    "num_local_experts": ("num_experts",),
    "num_experts_per_tok": ("num_experts_per_token",),
    "n_shared_experts": ("num_shared_experts",),
}
# fields that change nothing HARTS computes (metadata, generation, positions: Kimi-Linear's
# MLA has no positional encoding, so rope settings and the context length do not enter)
_IGNORED = {
    "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
    "transformers_version", "initializer_range", "use_cache", "output_router_logits", "pretraining_tp",
    "model_max_length", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "head_dim", "qk_head_dim", "model_type", "_name_or_path", "return_dict", "output_hidden_states",
    "output_attentions", "tokenizer_class", "keys_to_ignore_at_inference", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "tie_word_embeddings",
    "router_aux_loss_coef",
}
# fields with the one value transformers' KimiLinear computes (it ignores them otherwise;
# another value would mean a model it does not compute, so HARTS refuses it too)
_FIXED: dict[str, object] = {
    "mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
}
_LINEAR_KEYS = {"head_dim", "num_heads", "short_conv_kernel_size", "kda_layers", "full_attn_layers"}
_MIXERS = {"linear_attention": LayerKind.KDA, "full_attention": LayerKind.MLA}
MLA_NORM_EPS = 1e-6  # KimiLinearRMSNorm's default, what q_a_layernorm / kv_a_layernorm use


def _field(hf: dict, name: str) -> object:
    names = (name, *_ALIASES.get(name, ()))
    present = [n for n in names if n in hf]
    values = {repr(hf[n]) for n in present}
    if len(values) > 1:
        raise ConfigError(f"config.json: fields {' and '.join(repr(n) for n in present)} disagree "
                          f"({', '.join(sorted(values))})")
    return hf[present[0]] if present else _DEFAULTS[name]


def _int(hf: dict, name: str, *, minimum: int = 1, optional: bool = False) -> int | None:
    v = _field(hf, name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"config.json: field {name!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _layer_types(hf: dict, n: int) -> tuple[str, ...]:
    lin = hf.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ConfigError(f"config.json: field 'linear_attn_config' must be an object, got {lin!r}")
    unknown = sorted(set(lin) - _LINEAR_KEYS)
    if unknown:
        raise ConfigError(f"config.json: field 'linear_attn_config.{unknown[0]}' is not supported "
                          f"(known: {', '.join(sorted(_LINEAR_KEYS))})")
    types = hf.get("layer_types")
    if types is None and "kda_layers" in lin and "full_attn_layers" in lin:
        types = [None] * n
        for field, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in lin[field]:
                if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= n:
                    raise ConfigError(f"config.json: field 'linear_attn_config.{field}' holds {layer!r}; "
                                      f"layers are numbered 1..{n}")
                types[layer - 1] = kind
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _MIXERS for t in types):
        raise ConfigError(f"config.json: field 'layer_types' needs {n} entries of "
                          f"{sorted(_MIXERS)}, got {types!r}")
    return tuple(_MIXERS[t].value for t in types)


def _num_dense(hf: dict, n: int) -> int:
    types = hf.get("mlp_layer_types")
    if types is None:
        k = _int(hf, "first_k_dense_replace", minimum=0)
        types = ["dense" if i < k else "sparse" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ConfigError(f"config.json: field 'mlp_layer_types' needs {n} entries of 'dense'/'sparse', "
                          f"got {types!r}")
    dense = types.count("dense")
    if types != ["dense"] * dense + ["sparse"] * (n - dense):
        raise ConfigError(f"config.json: field 'mlp_layer_types' {types}: HARTS needs the dense layers first")
    return dense


def to_config(hf: dict) -> ModelConfig:
    """The ModelConfig of a kimi_linear config.json; ConfigError naming the field otherwise."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"config.json: field 'model_type' is {hf.get('model_type')!r}, not {MODEL_TYPE!r}")
    known = set(_DEFAULTS) | {a for v in _ALIASES.values() for a in v} | _IGNORED | set(_FIXED) | {
        "linear_attn_config", "layer_types", "mlp_layer_types", "use_grouped_topk"}
    unknown = sorted(set(hf) - known)
    if unknown:
        raise ConfigError(f"config.json: field {unknown[0]!r} is not supported by the {MODEL_TYPE} adapter")
    for name, value in _FIXED.items():
        if name in hf and hf[name] != value:
            raise ConfigError(f"config.json: field {name!r} is {hf[name]!r}; only {value!r} is supported")
    if _field(hf, "hidden_act") != "silu":
        raise ConfigError(f"config.json: field 'hidden_act' is {_field(hf, 'hidden_act')!r}; "
                          "only 'silu' is supported")
    if _field(hf, "attention_bias"):
        raise ConfigError("config.json: field 'attention_bias' is true; MLA projections without bias only")
    if _field(hf, "attention_dropout"):
        raise ConfigError(f"config.json: field 'attention_dropout' is {_field(hf, 'attention_dropout')!r}; "
                          "only 0 is supported")
    n = _int(hf, "num_hidden_layers")
    heads = _int(hf, "num_attention_heads")
    kv_heads = _int(hf, "num_key_value_heads", optional=True)
    if kv_heads is not None and kv_heads != heads:
        raise ConfigError(f"config.json: field 'num_key_value_heads' is {kv_heads}; MLA needs it equal to "
                          f"num_attention_heads ({heads})")
    lin = hf.get("linear_attn_config") or {}
    layer_pattern = _layer_types(hf, n)
    head_dim = lin.get("head_dim", _field(hf, "linear_head_dim"))
    num_heads = lin.get("num_heads", _field(hf, "linear_num_heads"))
    conv = lin.get("short_conv_kernel_size", _field(hf, "linear_conv_kernel_dim"))
    dense = _num_dense(hf, n)
    shared = _int(hf, "n_shared_experts", minimum=0)
    if dense < n and shared < 1:
        raise ConfigError("config.json: field 'n_shared_experts' is 0; transformers' KimiLinearMoE always "
                          "has a shared expert MLP")
    renorm = _field(hf, "norm_topk_prob")
    if not isinstance(renorm, bool):
        raise ConfigError(f"config.json: field 'norm_topk_prob' must be true or false, got {renorm!r}")
    experts = _int(hf, "num_local_experts")
    groups = _int(hf, "n_group")
    if "use_grouped_topk" in hf and not hf["use_grouped_topk"] and groups > 1:
        raise ConfigError("config.json: field 'use_grouped_topk' is false with n_group > 1; transformers "
                          "groups the top-k whatever it says")
    eps = _field(hf, "rms_norm_eps")
    scaling = _field(hf, "routed_scaling_factor")
    config = ModelConfig(
        name=MODEL_TYPE, vocab_size=_int(hf, "vocab_size"), d_model=_int(hf, "hidden_size"), num_layers=n,
        layer_kind_list=tuple(LayerKind(v) for v in layer_pattern),
        kda_num_heads=num_heads, kda_head_dim=head_dim, kda_head_v_dim=head_dim, kda_gate_rank=head_dim,
        conv_window=conv, chunk_size=64, kda_gate_bias=False,
        mla_num_heads=heads, kv_lora_rank=_int(hf, "kv_lora_rank"), q_lora_rank=_int(hf, "q_lora_rank", optional=True),
        qk_nope_head_dim=_int(hf, "qk_nope_head_dim"), qk_rope_head_dim=_int(hf, "qk_rope_head_dim", minimum=0),
        v_head_dim=_int(hf, "v_head_dim"), use_rope=False, mla_norm_eps=MLA_NORM_EPS,
        num_dense_layers=dense, dense_ffn_dim=_int(hf, "intermediate_size"),
        num_experts=experts, top_k=_int(hf, "num_experts_per_tok"), expert_ffn_dim=_int(hf, "moe_intermediate_size"),
        num_shared_experts=shared, router="sigmoid", aux_loss_coef=0.0,
        router_score_bias=True, router_groups=groups, router_topk_groups=_int(hf, "topk_group"),
        router_renormalize=renorm, routed_scaling_factor=scaling, router_float32=True,
        norm_eps=eps, norm_float32=True, tie_embeddings=False,
    )
    try:
        return config.validate()
    except ConfigError as err:
        raise ConfigError(f"config.json: {err}") from None


# ---------------------------------------------------------------------------------------
# Tensors


def hf_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a kimi_linear checkpoint of config `c` holds, with its shape."""
    d, V = c.d_model, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,),
                                          "lm_head.weight": (V, d)}
    for i, (mixer, ffn) in enumerate(zip(c.layer_kinds, c.ffn_kinds, strict=True)):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        a = p + "self_attn."
        if mixer == LayerKind.KDA:
            H, K, W = c.kda_num_heads, c.kda_head_dim, c.conv_window
            for x in "qkv":
                shapes[f"{a}{x}_proj.weight"] = (H * K, d)
                shapes[f"{a}{x}_conv1d.weight"] = (H * K, 1, W)
            shapes |= {a + "f_a_proj.weight": (K, d), a + "f_b_proj.weight": (H * K, K), a + "dt_bias": (H * K,),
                       a + "A_log": (1, 1, H, 1), a + "b_proj.weight": (H, d), a + "g_a_proj.weight": (K, d),
                       a + "g_b_proj.weight": (H * K, K), a + "o_norm.weight": (K,), a + "o_proj.weight": (d, H * K)}
        else:
            H, N, R, E, C = c.mla_num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
            if c.q_lora_rank is None:
                shapes[a + "q_proj.weight"] = (H * (N + R), d)
            else:
                shapes |= {a + "q_a_proj.weight": (c.q_lora_rank, d), a + "q_a_layernorm.weight": (c.q_lora_rank,),
                           a + "q_b_proj.weight": (H * (N + R), c.q_lora_rank)}
            shapes |= {a + "kv_a_proj_with_mqa.weight": (C + R, d), a + "kv_a_layernorm.weight": (C,),
                       a + "kv_b_proj.weight": (H * (N + E), C), a + "o_proj.weight": (d, H * E)}
        m = p + "block_sparse_moe."
        if ffn.value == "dense":
            F = c.dense_ffn_dim
            shapes |= {m + "gate_proj.weight": (F, d), m + "up_proj.weight": (F, d), m + "down_proj.weight": (d, F)}
        else:
            F, S = c.expert_ffn_dim, c.expert_ffn_dim * c.num_shared_experts
            for e in range(c.num_experts):
                shapes |= {f"{m}experts.{e}.w1.weight": (F, d), f"{m}experts.{e}.w3.weight": (F, d),
                           f"{m}experts.{e}.w2.weight": (d, F)}
            shapes |= {m + "gate.weight": (c.num_experts, d), m + "gate.e_score_correction_bias": (c.num_experts,),
                       m + "shared_experts.gate_proj.weight": (S, d), m + "shared_experts.up_proj.weight": (S, d),
                       m + "shared_experts.down_proj.weight": (d, S)}
    return shapes


def _names(c: ModelConfig) -> list[tuple[str, str]]:
    """(HARTS state-dict name, checkpoint name) of every tensor that maps one to one."""
    pairs = [("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
             ("lm_head.weight", "lm_head.weight")]
    for i, (mixer, ffn) in enumerate(zip(c.layer_kinds, c.ffn_kinds, strict=True)):
        h, p = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(h + "attn_norm.weight", p + "input_layernorm.weight"),
                  (h + "ffn_norm.weight", p + "post_attention_layernorm.weight")]
        x, a = h + "mixer.", p + "self_attn."
        if mixer == LayerKind.KDA:
            same = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "dt_bias", "b_proj.weight",
                    "o_norm.weight", "o_proj.weight"]
            pairs += [(x + s, a + s) for s in same]
            pairs += [(x + "f_proj.0.weight", a + "f_a_proj.weight"), (x + "f_proj.1.weight", a + "f_b_proj.weight"),
                      (x + "g_proj.0.weight", a + "g_a_proj.weight"), (x + "g_proj.1.weight", a + "g_b_proj.weight")]
        else:
            if c.q_lora_rank is None:
                pairs.append((x + "q_proj.weight", a + "q_proj.weight"))
            else:
                pairs += [(x + "q_a_proj.weight", a + "q_a_proj.weight"),
                          (x + "q_a_norm.weight", a + "q_a_layernorm.weight"),
                          (x + "q_b_proj.weight", a + "q_b_proj.weight")]
            pairs += [(x + "kv_a_proj.weight", a + "kv_a_proj_with_mqa.weight"),
                      (x + "kv_a_norm.weight", a + "kv_a_layernorm.weight"),
                      (x + "kv_b_proj.weight", a + "kv_b_proj.weight"), (x + "o_proj.weight", a + "o_proj.weight")]
        f, m = h + "ffn.", p + "block_sparse_moe."
        if ffn.value == "dense":
            pairs += [(f + s, m + s) for s in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
        else:
            pairs += [(f + "router.weight", m + "gate.weight"), (f + "score_bias", m + "gate.e_score_correction_bias")]
            pairs += [(f + "shared." + s, m + "shared_experts." + s)
                      for s in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
    return pairs


def _canonical(name: str) -> str:
    """The on-disk name transformers writes (`mlp` FFNs are stored as `block_sparse_moe`)."""
    return name.replace(".mlp.", ".block_sparse_moe.") if name.startswith("model.layers.") else name


def _check(tensors: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    by_name: dict[str, Tensor] = {}
    for name, t in tensors.items():
        key = _canonical(name)
        if key in by_name:
            raise CheckpointKeyError(f"tensor {name!r} is stored twice (also as {key!r})", tensor=name)
        by_name[key] = t
    shapes = hf_shapes(c)
    missing = sorted(set(shapes) - set(by_name))
    unexpected = sorted(set(by_name) - set(shapes))
    if missing:
        raise CheckpointKeyError(f"tensor {missing[0]!r} is missing (config.json's model needs it"
                                 + (f"; {len(missing) - 1} more missing)" if len(missing) > 1 else ")"),
                                 tensor=missing[0])
    if unexpected:
        raise CheckpointKeyError(f"tensor {unexpected[0]!r} is unexpected (config.json's model has no such "
                                 "tensor" + (f"; {len(unexpected) - 1} more)" if len(unexpected) > 1 else ")"),
                                 tensor=unexpected[0])
    for key, shape in shapes.items():
        if tuple(by_name[key].shape) != shape:
            raise CheckpointKeyError(f"tensor {key!r} has shape {tuple(by_name[key].shape)}; config.json's model "
                                     f"needs {shape}", tensor=key)
    return by_name


def to_harts(tensors: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """HybridModel state-dict tensors (the checkpoint's dtypes) from the checkpoint's."""
    t = _check(tensors, c)
    state = {h: t[k] for h, k in _names(c)}
    for i, (mixer, ffn) in enumerate(zip(c.layer_kinds, c.ffn_kinds, strict=True)):
        h, p = f"layers.{i}.", f"model.layers.{i}."
        if mixer == LayerKind.KDA:
            for x in "qkv":
                state[f"{h}mixer.{x}_conv"] = t[f"{p}self_attn.{x}_conv1d.weight"].squeeze(1)
            state[h + "mixer.A_log"] = t[p + "self_attn.A_log"].reshape(-1)
        if ffn.value != "dense":
            m = p + "block_sparse_moe.experts."
            for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
                state[f"{h}ffn.{ours}"] = torch.stack([t[f"{m}{e}.{theirs}.weight"] for e in range(c.num_experts)])
    return state


def to_hf(state: dict[str, Tensor], c: ModelConfig, hf_config: dict) -> dict[str, Tensor]:
    """Checkpoint tensors (names and shapes as `save_pretrained` writes them) from a
    HybridModel state dict; dtypes as given."""
    out = {k: state[h] for h, k in _names(c)}
    for i, (mixer, ffn) in enumerate(zip(c.layer_kinds, c.ffn_kinds, strict=True)):
        h, p = f"layers.{i}.", f"model.layers.{i}."
        if mixer == LayerKind.KDA:
            for x in "qkv":
                out[f"{p}self_attn.{x}_conv1d.weight"] = state[f"{h}mixer.{x}_conv"].unsqueeze(1)
            out[p + "self_attn.A_log"] = state[h + "mixer.A_log"].reshape(1, 1, -1, 1)
        if ffn.value != "dense":
            m = p + "block_sparse_moe.experts."
            for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
                for e, w in enumerate(state[f"{h}ffn.{ours}"].unbind(0)):
                    out[f"{m}{e}.{theirs}.weight"] = w
    shapes = hf_shapes(c)
    assert set(out) == set(shapes), sorted(set(out) ^ set(shapes))
    return {k: v.contiguous() for k, v in out.items()}


ADAPTER = HFAdapter(model_type=MODEL_TYPE, to_config=to_config, to_harts=to_harts, to_hf=to_hf)
