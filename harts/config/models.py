"""Model configurations of the hybrid-attention MoE models HARTS trains, as plain data.

A model is Kimi-Linear-shaped: `num_layers` decoder blocks in repeating groups of
`kda_per_mla` KDA (linear attention) layers followed by one MLA (full attention) layer
(or any order given as `layer_kind_list`, as a Hugging Face checkpoint's config sets it,
Gated DeltaNet and gated attention layers included); the first `num_dense_layers` blocks
(or `ffn_kind_list`) use a dense SwiGLU FFN, the rest a top-k MoE with
shared experts. Nothing here imports torch: the simulator and planners read these configs,
and `harts.config.param_counts` derives the parameter counts analytically.

Dimension names: d = d_model, H = heads, K / V = KDA key / value head dims, W = conv
window, c = MLA KV latent rank, n / r / v = MLA no-RoPE / RoPE / value head dims,
E = routed experts, k = top-k, f = FFN hidden dims.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from harts.config.registry import Registry


class ConfigError(ValueError):
    """A model configuration that cannot be built; the message names the field."""


class LayerKind(StrEnum):
    KDA = "kda"
    MLA = "mla"
    # Qwen3-Next's linear attention: the gated delta rule with one decay per head
    # (`harts.exec.model.gdn`), and its gated full attention (`harts.exec.model.gated_attention`)
    GDN = "gdn"
    GATED_ATTENTION = "gated_attention"


# How tables name each layer kind, and the kinds that run the chunkwise linear recurrence
LAYER_KIND_LABEL = {LayerKind.KDA: "KDA", LayerKind.MLA: "MLA", LayerKind.GDN: "GDN",
                    LayerKind.GATED_ATTENTION: "attn"}
LINEAR_ATTENTION_KINDS = (LayerKind.KDA, LayerKind.GDN)


class FFNKind(StrEnum):
    DENSE = "dense"
    MOE = "moe"


RouterKind = Literal["softmax", "sigmoid"]
AuxScope = Literal["microbatch", "global"]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    d_model: int
    num_layers: int
    # Attention pattern: groups of `kda_per_mla` KDA layers then one MLA layer (0 = all MLA).
    kda_per_mla: int = 3
    # KDA (Kimi Delta Attention)
    kda_num_heads: int = 2
    kda_head_dim: int = 32  # K
    kda_head_v_dim: int = 32  # V
    kda_gate_rank: int | None = None  # low-rank forget/output gate projections; None = V
    conv_window: int = 4  # W
    chunk_size: int = 64
    # MLA (multi-head latent attention)
    mla_num_heads: int = 2
    kv_lora_rank: int = 32  # c
    q_lora_rank: int | None = None  # None = full-rank q projection
    qk_nope_head_dim: int = 32  # n
    qk_rope_head_dim: int = 16  # r (the decoupled key part; rotated only when use_rope)
    v_head_dim: int = 32  # v
    use_rope: bool = False  # Kimi-Linear's MLA uses no positional encoding
    rope_theta: float = 10000.0
    # FFN / MoE
    num_dense_layers: int = 1
    dense_ffn_dim: int = 128
    num_experts: int = 8  # E routed experts per MoE layer
    top_k: int = 2
    expert_ffn_dim: int = 32
    num_shared_experts: int = 1
    router: RouterKind = "softmax"
    aux_loss_coef: float = 1e-3
    # Over which rows the MoE aux loss takes its routed fractions f_i: "microbatch" (each
    # microbatch's own, its aux scaled by its token share; depends on the split) or
    # "global" (f_i of the whole step from a no-grad statistics pass; the aux no longer
    # depends on how the step is split). See `harts.exec.model.moe`. It lives here, next to
    # aux_loss_coef, because it is part of the objective every trainer of this model
    # optimises: expanded, tree and window trainers built from one config cannot disagree
    # on it, and torch-free readers (the simulator) can see that a step costs one more
    # forward pass. It adds no parameters.
    aux_scope: AuxScope = "microbatch"
    capacity_factor: float | None = None  # None = no token dropping (required in tree mode)
    # Misc
    norm_eps: float = 1e-6
    # RMSNorms in float32 inside (x upcast, normalised, cast back, times the weight), as
    # HF's Llama/Qwen norms and fla's fused norm kernels do; False (the default, what every
    # measured number so far used) computes in the model's dtype. On CPU in bf16 the
    # model-dtype norm gives different bits for the same row in a tree and in its
    # trajectory (`harts verify --divergence`), the float32 one does not.
    norm_float32: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    # --- Qwen3-Next (GDN + gated attention); defaults leave every other model unchanged ---
    # Per-layer kinds as data (a checkpoint's `layer_types` / `mlp_only_layers`); None = the
    # kda_per_mla / num_dense_layers pattern above.
    layer_kind_list: tuple[LayerKind, ...] | None = None
    ffn_kind_list: tuple[FFNKind, ...] | None = None
    # Gated DeltaNet: q/k heads, value heads (a multiple: each q/k head serves
    # gdn_num_v_heads / gdn_num_k_heads consecutive value heads), head dims. Its conv window
    # is conv_window, its chunk size chunk_size.
    gdn_num_k_heads: int = 2
    gdn_num_v_heads: int = 2
    gdn_head_k_dim: int = 32
    gdn_head_v_dim: int = 32
    # Gated full attention: query heads, key/value heads (GQA), head dim, rotated leading
    # channels of each head (partial RoPE at the row's depth, rope_theta).
    attn_num_heads: int = 2
    attn_num_kv_heads: int = 2
    attn_head_dim: int = 32
    attn_rotary_dim: int = 16
    # MoE variants: the shared expert's hidden width (None = expert_ffn_dim x
    # num_shared_experts) and a sigmoid gate on the shared expert's output (Linear d -> 1);
    # whether the top-k weights are renormalised is `router_renormalize` below.
    shared_expert_ffn_dim: int | None = None
    shared_expert_gate: bool = False
    # Zero-centred RMSNorm weights (Qwen3-Next): the stored weight w scales by (1 + w), for the
    # block norms, the final norm and the attention q/k norms.
    norm_offset: bool = False
    # --- Fields a Hugging Face checkpoint sets (harts.models.hf); their defaults keep the
    # registered HARTS models as they are.
    # Bias of the KDA output gate's second projection (Kimi-Linear's g_b_proj has none).
    kda_gate_bias: bool = True
    # Epsilon of MLA's q_a / kv_a RMSNorms; None = norm_eps (Kimi-Linear: 1e-6 beside 1e-5).
    mla_norm_eps: float | None = None
    # DeepSeek-V3 / Kimi-Linear routing: the scores plus a per-expert correction bias (a
    # buffer, not trained) choose the experts, first keeping the router_topk_groups best of
    # router_groups expert groups (a group scores the sum of its two best); the weights are
    # the chosen experts' plain scores, renormalised to sum to one when router_renormalize,
    # times routed_scaling_factor.
    router_score_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    router_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    # Router logits and scores in float32 for half-precision inputs (transformers'
    # KimiLinearTopkRouter), so a bf16 model picks the experts its checkpoint's model picks.
    router_float32: bool = False

    def validate(self) -> ModelConfig:
        """Raise ConfigError naming the first inconsistent field; return self when valid."""
        positive = [
            "vocab_size", "d_model", "num_layers", "kda_num_heads", "kda_head_dim",
            "kda_head_v_dim", "conv_window", "chunk_size", "mla_num_heads", "kv_lora_rank",
            "qk_nope_head_dim", "v_head_dim",
        ]
        for f in positive:
            _check_int(f, getattr(self, f), minimum=1)
        for f in ["kda_per_mla", "qk_rope_head_dim", "num_dense_layers", "num_experts",
                  "num_shared_experts", "dense_ffn_dim", "expert_ffn_dim", "top_k"]:
            _check_int(f, getattr(self, f), minimum=0)
        if not self.name:
            raise ConfigError("name: must be non-empty")
        group = self.kda_per_mla + 1
        self._validate_kind_lists()
        if self.layer_kind_list is None and self.num_layers % group:
            raise ConfigError(
                f"kda_per_mla: a KDA:MLA ratio of {self.kda_per_mla}:1 needs num_layers to be a "
                f"multiple of {group}, got num_layers={self.num_layers}"
            )
        if self.kda_gate_rank is not None:
            _check_int("kda_gate_rank", self.kda_gate_rank, minimum=1)
        if self.q_lora_rank is not None:
            _check_int("q_lora_rank", self.q_lora_rank, minimum=1)
        if self.use_rope and (self.qk_rope_head_dim == 0 or self.qk_rope_head_dim % 2):
            raise ConfigError(
                f"qk_rope_head_dim: RoPE rotates pairs of channels, needs a positive even "
                f"dim, got {self.qk_rope_head_dim}"
            )
        if self.num_dense_layers > self.num_layers:
            raise ConfigError(
                f"num_dense_layers: {self.num_dense_layers} > num_layers {self.num_layers}"
            )
        if self.num_dense_layers_effective and self.dense_ffn_dim < 1:
            raise ConfigError("dense_ffn_dim: must be >= 1 when there are dense FFN layers")
        if self.num_moe_layers:
            if self.num_experts < 1:
                raise ConfigError("num_experts: MoE layers need at least one routed expert")
            if not 1 <= self.top_k <= self.num_experts:
                raise ConfigError(
                    f"top_k: must be in [1, num_experts={self.num_experts}], got {self.top_k}"
                )
            if self.expert_ffn_dim < 1:
                raise ConfigError("expert_ffn_dim: must be >= 1 when there are MoE layers")
        if self.router not in ("softmax", "sigmoid"):
            raise ConfigError(f"router: must be 'softmax' or 'sigmoid', got {self.router!r}")
        if self.aux_scope not in ("microbatch", "global"):
            raise ConfigError(f"aux_scope: must be 'microbatch' or 'global', got {self.aux_scope!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"capacity_factor: must be > 0 or None, got {self.capacity_factor}")
        for f in ["aux_loss_coef", "norm_eps", "init_std"]:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"{f}: must be a non-negative number, got {v!r}")
        if not self.norm_eps > 0:
            raise ConfigError("norm_eps: must be > 0")
        if not isinstance(self.norm_float32, bool):
            raise ConfigError(f"norm_float32: must be true or false, got {self.norm_float32!r}")
        if not self.rope_theta > 0:
            raise ConfigError("rope_theta: must be > 0")
        self._validate_qwen3_next()
        if self.mla_norm_eps is not None and not (isinstance(self.mla_norm_eps, (int, float))
                                                   and self.mla_norm_eps > 0):
            raise ConfigError(f"mla_norm_eps: must be > 0 or None, got {self.mla_norm_eps!r}")
        for f in ["kda_gate_bias", "router_score_bias", "router_renormalize", "router_float32"]:
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f}: must be true or false, got {getattr(self, f)!r}")
        _check_int("router_groups", self.router_groups, minimum=1)
        _check_int("router_topk_groups", self.router_topk_groups, minimum=1)
        if self.router_groups > 1:
            if self.router != "sigmoid":
                raise ConfigError("router_groups: grouped top-k is defined for the sigmoid router only")
            if self.num_experts % self.router_groups or self.num_experts // self.router_groups < 2:
                raise ConfigError(
                    f"router_groups: {self.router_groups} groups need num_experts={self.num_experts} "
                    "to split into groups of at least two"
                )
            if self.router_topk_groups > self.router_groups:
                raise ConfigError(
                    f"router_topk_groups: {self.router_topk_groups} > router_groups {self.router_groups}"
                )
            if self.router_topk_groups * (self.num_experts // self.router_groups) < self.top_k:
                raise ConfigError(
                    f"router_topk_groups: {self.router_topk_groups} groups of "
                    f"{self.num_experts // self.router_groups} experts hold fewer than top_k={self.top_k}"
                )
        v = self.routed_scaling_factor
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"routed_scaling_factor: must be a number > 0, got {v!r}")
        return self

    def _validate_kind_lists(self) -> None:
        for field, enum in (("layer_kind_list", LayerKind), ("ffn_kind_list", FFNKind)):
            kinds = getattr(self, field)
            if kinds is None:
                continue
            if not isinstance(kinds, tuple) or len(kinds) != self.num_layers:
                raise ConfigError(f"{field}: must be a tuple of num_layers={self.num_layers} kinds, got {kinds!r}")
            for k in kinds:
                if k not in set(enum):
                    raise ConfigError(f"{field}: unknown kind {k!r}; known: {', '.join(enum)}")

    def _validate_qwen3_next(self) -> None:
        kinds = set(self.layer_kinds)
        if LayerKind.GDN in kinds:
            for f in ("gdn_num_k_heads", "gdn_num_v_heads", "gdn_head_k_dim", "gdn_head_v_dim"):
                _check_int(f, getattr(self, f), minimum=1)
            if self.gdn_num_v_heads % self.gdn_num_k_heads:
                raise ConfigError(f"gdn_num_v_heads: {self.gdn_num_v_heads} must be a multiple of "
                                  f"gdn_num_k_heads={self.gdn_num_k_heads}")
        if LayerKind.GATED_ATTENTION in kinds:
            for f in ("attn_num_heads", "attn_num_kv_heads", "attn_head_dim"):
                _check_int(f, getattr(self, f), minimum=1)
            _check_int("attn_rotary_dim", self.attn_rotary_dim, minimum=0)
            if self.attn_num_heads % self.attn_num_kv_heads:
                raise ConfigError(f"attn_num_kv_heads: {self.attn_num_kv_heads} must divide "
                                  f"attn_num_heads={self.attn_num_heads}")
            if self.attn_rotary_dim % 2 or self.attn_rotary_dim > self.attn_head_dim:
                raise ConfigError(f"attn_rotary_dim: must be even and <= attn_head_dim={self.attn_head_dim}, "
                                  f"got {self.attn_rotary_dim}")
        if self.shared_expert_ffn_dim is not None:
            _check_int("shared_expert_ffn_dim", self.shared_expert_ffn_dim, minimum=1)
        for f in ("shared_expert_gate", "norm_offset"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f}: must be true or false, got {getattr(self, f)!r}")

    def check_tree_mode(self) -> None:
        """Tree mode routes each compact row once and weights it by its occurrence count;
        capacity-based token dropping would drop rows, not trajectory tokens, so refuse it."""
        if self.capacity_factor is not None:
            raise ConfigError(
                f"capacity_factor={self.capacity_factor}: token dropping breaks the "
                "tree/expanded equivalence; tree mode needs capacity_factor=None"
            )

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes).validate()

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        if self.layer_kind_list is not None:
            return tuple(LayerKind(k) for k in self.layer_kind_list)
        group = self.kda_per_mla + 1
        return tuple(
            LayerKind.MLA if (i + 1) % group == 0 else LayerKind.KDA for i in range(self.num_layers)
        )

    @property
    def ffn_kinds(self) -> tuple[FFNKind, ...]:
        if self.ffn_kind_list is not None:
            return tuple(FFNKind(k) for k in self.ffn_kind_list)
        return tuple(
            FFNKind.DENSE if i < self.num_dense_layers else FFNKind.MOE
            for i in range(self.num_layers)
        )

    @property
    def num_kda_layers(self) -> int:
        return self.layer_kinds.count(LayerKind.KDA)

    @property
    def num_mla_layers(self) -> int:
        return self.layer_kinds.count(LayerKind.MLA)

    @property
    def num_moe_layers(self) -> int:
        return self.ffn_kinds.count(FFNKind.MOE)

    @property
    def num_dense_layers_effective(self) -> int:
        """Dense-FFN layers: num_dense_layers, or those of ffn_kind_list when given."""
        return self.ffn_kinds.count(FFNKind.DENSE)

    @property
    def shared_ffn_dim(self) -> int:
        """Hidden width of the shared experts of an MoE layer (0: none)."""
        if self.shared_expert_ffn_dim is not None:
            return self.shared_expert_ffn_dim
        return self.expert_ffn_dim * self.num_shared_experts

    def num_layers_of(self, kind: LayerKind) -> int:
        return self.layer_kinds.count(kind)

    @property
    def gate_rank(self) -> int:
        return self.kda_head_v_dim if self.kda_gate_rank is None else self.kda_gate_rank

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def layer_ratio(config: ModelConfig) -> str:
    """The model's layers by its own kinds, as the smallest integer ratio: "KDA:MLA 3:1"
    (Kimi-Linear-shaped), "GDN:attn 3:1" (Qwen3-Next), "KDA:MLA 20:7", "MLA only"."""
    kinds = config.layer_kinds
    present = [k for k in LayerKind if k in kinds]
    if len(present) == 1:
        return f"{LAYER_KIND_LABEL[present[0]]} only"
    counts = [kinds.count(k) for k in present]
    g = math.gcd(*counts)
    return ":".join(LAYER_KIND_LABEL[k] for k in present) + " " + ":".join(str(n // g) for n in counts)


def linear_attention_label(config: ModelConfig) -> str | None:
    """The model's linear-attention kind as tables name it ("KDA", "GDN", "KDA/GDN" when
    both), None without linear-attention layers."""
    present = [LAYER_KIND_LABEL[k] for k in LINEAR_ATTENTION_KINDS if k in config.layer_kinds]
    return "/".join(present) or None


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")


# ---------------------------------------------------------------------------------------
# Registry


class ModelName(StrEnum):
    TINY_CPU = "tiny-cpu"
    TINY = "tiny"
    FLASH = "flash"
    TINY_H200 = "tiny-h200"
    QWEN3_NEXT_80B_A3B = "qwen3-next-80b-a3b"
    KIMI_LINEAR_48B = "kimi-linear-48b-a3b"


# Table 1 of the HARTS paper (total / active parameters, billions): what `tiny` and `flash`
# are sized to match.
# Published totals (total / active parameters, billions) of the released models registered
# below, as their names give them.
PUBLISHED_PARAMS_B: dict[ModelName, tuple[float, float]] = {
    ModelName.KIMI_LINEAR_48B: (48.0, 3.0),
}

TABLE1_PARAMS_B: dict[ModelName, tuple[float, float]] = {
    ModelName.TINY: (7.9, 1.3),
    ModelName.FLASH: (124.0, 5.1),
}

_KIMI_VOCAB = 163_840

_REGISTRY: Registry[ModelName, ModelConfig] = Registry("model", ModelName, ConfigError, "known models")


def _register(name: ModelName, config: ModelConfig) -> None:
    if config.name != name.value:
        raise ConfigError(f"model config registered as {name!r} is named {config.name!r}")
    _REGISTRY.register(name, config.validate())


def known_models() -> list[str]:
    return _REGISTRY.known()


def get_model_config(name: str | ModelName) -> ModelConfig:
    """The registered config; unknown names fail listing the known ones."""
    return _REGISTRY.get(name)


# Small enough for a training step on a few hundred tokens in well under a second on 2
# CPU cores: 3 KDA + 1 MLA, one dense FFN layer, 3 MoE layers of 8 experts top-2.
_register(
    ModelName.TINY_CPU,
    ModelConfig(
        name="tiny-cpu", vocab_size=512, d_model=64, num_layers=4, kda_per_mla=3,
        kda_num_heads=2, kda_head_dim=32, kda_head_v_dim=32, conv_window=4, chunk_size=64,
        mla_num_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, use_rope=False,
        num_dense_layers=1, dense_ffn_dim=128, num_experts=8, top_k=2, expert_ffn_dim=32,
        num_shared_experts=1, router="softmax", aux_loss_coef=1e-3,
    ),
)

# Table 1 "Tiny": 24 layers in 6 groups of 3 KDA + 1 MLA, layer 1 dense, layers 2-24 MoE
# with 128 routed experts top-8 and one shared expert. Kimi-Linear-like head shapes
# (KDA 16x128; MLA 8 heads, latent 512, no-RoPE 128 + decoupled 64, value 128, no RoPE).
# Analytic count: 7.82B total / 1.31B active.
_register(
    ModelName.TINY,
    ModelConfig(
        name="tiny", vocab_size=_KIMI_VOCAB, d_model=1536, num_layers=24, kda_per_mla=3,
        kda_num_heads=16, kda_head_dim=128, kda_head_v_dim=128, conv_window=4, chunk_size=64,
        mla_num_heads=8, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, use_rope=False,
        num_dense_layers=1, dense_ffn_dim=8192, num_experts=128, top_k=8, expert_ffn_dim=512,
        num_shared_experts=1, router="sigmoid", aux_loss_coef=1e-3,
    ),
)

# Table 1 "Flash": 42 layers in 7 groups of 5 KDA + 1 MLA, layers 1-2 dense, layers 3-42
# MoE with 512 routed experts top-8 and one shared expert. KDA 32x128, MLA 64 heads.
# Analytic count: 124.0B total / 5.11B active.
_register(
    ModelName.FLASH,
    ModelConfig(
        name="flash", vocab_size=_KIMI_VOCAB, d_model=2560, num_layers=42, kda_per_mla=5,
        kda_num_heads=32, kda_head_dim=128, kda_head_v_dim=128, conv_window=4, chunk_size=64,
        mla_num_heads=64, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, use_rope=False,
        num_dense_layers=2, dense_ffn_dim=8192, num_experts=512, top_k=8, expert_ffn_dim=768,
        num_shared_experts=1, router="sigmoid", aux_loss_coef=1e-3,
    ),
)

# Tiny's shape at a size that trains on ONE H200 with AdamW (Tiny itself, 7.8B, needs
# ~63 GB for parameters, gradients and moments before any activation): the same 3:1
# KDA:MLA groups, KDA 16x128, MLA 8 heads (latent 512, qk 128 + 64, value 128, no RoPE),
# d_model 1536, dense first layer (8192), MoE top-8 with one shared expert of 512, sigmoid
# router -- with 8 layers instead of 24, 64 routed experts instead of 128 and a 32k
# vocabulary (one [rows, vocab] logit block per microbatch at 163,840 would take tens of
# GB). Per-token costs keep Tiny's proportions. Used by the GPU benchmarks (benchmarks/gpu).
_register(
    ModelName.TINY_H200,
    ModelConfig(
        name="tiny-h200", vocab_size=32_768, d_model=1536, num_layers=8, kda_per_mla=3,
        kda_num_heads=16, kda_head_dim=128, kda_head_v_dim=128, conv_window=4, chunk_size=64,
        mla_num_heads=8, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, use_rope=False,
        num_dense_layers=1, dense_ffn_dim=8192, num_experts=64, top_k=8, expert_ffn_dim=512,
        num_shared_experts=1, router="sigmoid", aux_loss_coef=1e-3,
    ),
)

# Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct's config.json, as published): 48
# layers in 12 groups of 3 Gated DeltaNet (16 q/k heads, 32 value heads, 128 x 128) + 1
# gated attention (16 query heads, 2 key/value heads, head dim 256, a quarter of it rotated,
# rope_theta 1e7); every layer MoE: 512 experts of 512, top-10 softmax routing renormalised,
# one gated shared expert of 512; zero-centred norms (eps 1e-6), untied 151,936-token
# embeddings. Its multi-token-prediction head (`mtp.*`) is not part of the model. What
# `harts.models.hf.qwen3_next.to_config` gives for that config.json (name aside).
# Analytic count: 79.7B total / 3.87B active (3.25B without the embedding and LM head).
_register(
    ModelName.QWEN3_NEXT_80B_A3B,
    ModelConfig(
        name="qwen3-next-80b-a3b", vocab_size=151_936, d_model=2048, num_layers=48, kda_per_mla=0,
        layer_kind_list=tuple(LayerKind.GATED_ATTENTION if (i + 1) % 4 == 0 else LayerKind.GDN for i in range(48)),
        ffn_kind_list=(FFNKind.MOE,) * 48, conv_window=4, chunk_size=64,
        gdn_num_k_heads=16, gdn_num_v_heads=32, gdn_head_k_dim=128, gdn_head_v_dim=128,
        attn_num_heads=16, attn_num_kv_heads=2, attn_head_dim=256, attn_rotary_dim=64, rope_theta=10_000_000.0,
        num_dense_layers=0, dense_ffn_dim=5120, num_experts=512, top_k=10, expert_ffn_dim=512,
        num_shared_experts=1, shared_expert_ffn_dim=512, shared_expert_gate=True, router="softmax",
        router_renormalize=True, aux_loss_coef=0.0, norm_eps=1e-6, norm_float32=True, norm_offset=True,
        tie_embeddings=False, init_std=0.02,
    ),
)

# Kimi-Linear-48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct config.json, what
# transformers' KimiLinearConfig defaults to): 27 layers, full attention (MLA) at layers 4, 8,
# 12, 16, 20, 24 and 27 (1-based), KDA elsewhere (32 heads x 128, conv 4, gate rank 128, no
# output-gate bias); MLA 32 heads, latent 512, no q LoRA, qk 128 + 64, value 128, no RoPE
# (its two latent norms at eps 1e-6); layer 1 dense (9216), layers 2-27 MoE: 256 experts
# of 1024, top-8, one shared expert, sigmoid router with correction bias, one group,
# renormalised, scaled by 2.446; RMSNorm eps 1e-5 in float32; untied head. The same config
# that `harts.models.hf.kimi_linear` derives from that config.json.
_KIMI_LINEAR_FULL_ATTN = (4, 8, 12, 16, 20, 24, 27)
_register(
    ModelName.KIMI_LINEAR_48B,
    ModelConfig(
        name="kimi-linear-48b-a3b", vocab_size=_KIMI_VOCAB, d_model=2304, num_layers=27,
        layer_kind_list=tuple(LayerKind.MLA if i + 1 in _KIMI_LINEAR_FULL_ATTN else LayerKind.KDA for i in range(27)),
        kda_num_heads=32, kda_head_dim=128, kda_head_v_dim=128, kda_gate_rank=128, conv_window=4,
        chunk_size=64, kda_gate_bias=False,
        mla_num_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, use_rope=False, mla_norm_eps=1e-6,
        num_dense_layers=1, dense_ffn_dim=9216, num_experts=256, top_k=8, expert_ffn_dim=1024,
        num_shared_experts=1, router="sigmoid", aux_loss_coef=0.0, router_score_bias=True,
        router_groups=1, router_topk_groups=1, router_renormalize=True, routed_scaling_factor=2.446,
        router_float32=True, norm_eps=1e-5, norm_float32=True, tie_embeddings=False,
    ),
)
