"""Roofline prices of one inference worker: a decode iteration of a batch, a prefill, a
KV transfer, and the KV bytes a trajectory holds.

Model: a `harts.config.models.ModelConfig` (hybrid KDA/MLA MoE) served tensor-parallel on
`degree` GPUs of one node.

- decode iteration (every running sequence emits one token): bytes read per GPU =
  (dense weights + routed experts x the fraction a batch of b tokens touches, 1 - (1 -
  k/E)^b with independent routing) / degree + KV read (MLA latent per context token, KDA
  state per sequence) / degree; FLOPs = 2 x active parameters per token + MLA attention
  over the context; time = max(bytes / HBM, FLOPs / matmul) / efficiency(degree) + kernel
  launches + two all-reduces of the batch's hidden states per layer over NVLink
  (latency + ring bytes / bus bandwidth). efficiency(degree) = mp_efficiency ^ log2(degree).
- prefill of n new tokens after c cached ones: all weights read once, FLOPs 2 x active x n
  + causal MLA attention, the same efficiency, launches and all-reduces of n tokens.
- KV held by a trajectory with c context tokens: c x MLA layers x (c_kv + rope) values +
  KDA layers x heads x K x V state values.
- KV transfer: bytes over the point-to-point link (NVLink inside a node, InfiniBand across).

Dense grouped-query-attention models (`DENSE_SERVED_MODELS`, e.g. `qwen3-32b`) are priced
with the same formulas: no routed experts, no recurrent state, KV = layers x 2 x KV heads x
head dim values per context token, attention FLOPs 4 x layers x query heads x head dim per
(query, key) pair. They are rollout-side shapes only (the trainer's models are the hybrid
ones in `harts.config.models`): a dense model's per-token KV is ~30x the MLA latent of
`flash`, so on them decode time grows with the contexts co-resident on a worker and the
KV capacity binds, the regime in which where a long trajectory runs decides its speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harts.config.models import ModelConfig, get_model_config
from harts.config.param_counts import parameter_counts
from harts.config.rollout import RolloutWorkload
from harts.sim.hardware import HardwareProfile, load_hardware


@dataclass(frozen=True)
class DenseServedModel:
    """A dense GQA decoder's shape (Qwen3-style: SwiGLU MLP, untied embeddings)."""

    name: str
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int

    @property
    def params(self) -> int:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = self.d_model * (2 * q + 2 * kv)
        mlp = 3 * self.d_model * self.ffn_dim
        return self.num_layers * (attn + mlp + 2 * self.d_model) + 2 * self.vocab_size * self.d_model


# published Qwen3 configurations (config.json of Qwen/Qwen3-32B and Qwen/Qwen3-8B)
DENSE_SERVED_MODELS: dict[str, DenseServedModel] = {
    m.name: m for m in (
        DenseServedModel("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936),
        DenseServedModel("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
    )
}


@dataclass(frozen=True)
class RolloutCost:
    dense_weight_bytes: float
    routed_weight_bytes: float
    active_params: float
    experts: int
    top_k: int
    kv_bytes_per_token: float
    state_bytes_per_seq: float
    mla_flops_per_context_token: float  # decode: per sequence and context token
    mla_prefill_flops_per_pair: float
    num_layers: int
    hidden_bytes_per_token: float
    hbm_bytes_per_s: float
    hbm_capacity_bytes: float
    matmul_flops_per_s: float
    kernel_launch_s: float
    kernels_per_layer: int
    nvlink_bus_bytes_per_s: float
    nvlink_latency_s: float
    nvlink_p2p_bytes_per_s: float
    ib_p2p_bytes_per_s: float
    ib_latency_s: float
    gpus_per_node: int
    mp_efficiency: float
    hbm_utilization: float
    fixed_cost_scale: float = 1.0  # multiplies launches and all-reduces (an assumption; sensitivity knob)
    swap_bytes_per_s: float = 50e9  # host <-> GPU KV copy of one worker (preemption by swapping)

    @property
    def weight_bytes(self) -> float:
        return self.dense_weight_bytes + self.routed_weight_bytes

    def efficiency(self, degree: int) -> float:
        return self.mp_efficiency ** math.log2(degree)

    def kv_capacity(self, degree: int) -> float:
        """HBM left for KV on a worker of `degree` GPUs (negative: the weights do not fit)."""
        return degree * self.hbm_capacity_bytes * self.hbm_utilization - self.weight_bytes

    def kv_bytes(self, context_tokens: int) -> float:
        return context_tokens * self.kv_bytes_per_token + self.state_bytes_per_seq

    def allreduce(self, degree: int, tokens: float) -> float:
        if degree == 1:
            return 0.0
        ring = 2.0 * (degree - 1) / degree * tokens * self.hidden_bytes_per_token / self.nvlink_bus_bytes_per_s
        return self.fixed_cost_scale * self.num_layers * 2 * (self.nvlink_latency_s + ring)

    def launch_overhead(self) -> float:
        return self.fixed_cost_scale * self.num_layers * self.kernels_per_layer * self.kernel_launch_s

    def swap(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` of KV between a worker's GPUs and host memory."""
        return nbytes / self.swap_bytes_per_s

    def touched_fraction(self, tokens: float) -> float:
        if self.experts == 0:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.experts) ** tokens

    def decode_step(self, batch: int, context_tokens: float, degree: int) -> float:
        """Seconds of one decode iteration of `batch` sequences holding `context_tokens` in all."""
        if batch <= 0:
            return 0.0
        weights = self.dense_weight_bytes + self.routed_weight_bytes * self.touched_fraction(batch)
        kv = context_tokens * self.kv_bytes_per_token + batch * self.state_bytes_per_seq
        flops = batch * 2.0 * self.active_params + context_tokens * self.mla_flops_per_context_token
        roof = max((weights + kv) / degree / self.hbm_bytes_per_s, flops / degree / self.matmul_flops_per_s)
        return roof / self.efficiency(degree) + self.launch_overhead() + self.allreduce(degree, batch)

    def decode_steps(self, batch: np.ndarray, context_tokens: np.ndarray, degree: int) -> np.ndarray:
        """`decode_step` elementwise over arrays of (possibly fractional) batches >= 1 and
        context totals: what the planners price expected batches with. The same formula
        as `decode_step`, which stays scalar because the event loop calls it once per
        chunk, where numpy's per-call overhead would cost more than the arithmetic (a test
        checks that the two agree)."""
        b = np.asarray(batch, dtype=float)
        c = np.asarray(context_tokens, dtype=float)
        weights = self.dense_weight_bytes + self.routed_weight_bytes * self.touched_fraction(b)
        kv = c * self.kv_bytes_per_token + b * self.state_bytes_per_seq
        flops = b * 2.0 * self.active_params + c * self.mla_flops_per_context_token
        roof = np.maximum((weights + kv) / degree / self.hbm_bytes_per_s, flops / degree / self.matmul_flops_per_s)
        return roof / self.efficiency(degree) + self.launch_overhead() + self.allreduce(degree, b)

    def prefill(self, new_tokens: float, pairs: float, degree: int) -> float:
        """Seconds to prefill `new_tokens` whose causal attention spans `pairs` (query, key) pairs."""
        if new_tokens <= 0:
            return 0.0
        flops = 2.0 * self.active_params * new_tokens + pairs * self.mla_prefill_flops_per_pair
        roof = max(self.weight_bytes / degree / self.hbm_bytes_per_s, flops / degree / self.matmul_flops_per_s)
        return roof / self.efficiency(degree) + self.launch_overhead() + self.allreduce(degree, new_tokens)

    def transfer(self, nbytes: float, same_node: bool) -> float:
        if same_node:
            return self.nvlink_latency_s + nbytes / self.nvlink_p2p_bytes_per_s
        return self.ib_latency_s + nbytes / self.ib_p2p_bytes_per_s


def make_rollout_cost(cfg: RolloutWorkload, model: ModelConfig | None = None,
                      hardware: HardwareProfile | None = None) -> RolloutCost:
    hw = hardware or load_hardware(cfg.hardware)
    if model is None and cfg.model in DENSE_SERVED_MODELS:
        return _dense_cost(cfg, DENSE_SERVED_MODELS[cfg.model], hw)
    m = model or get_model_config(cfg.model)
    pc = parameter_counts(m)
    routed = pc.by_component.get("routed_experts", 0)
    mla, kda = m.num_mla_layers, m.num_kda_layers
    kv_values = mla * (m.kv_lora_rank + m.qk_rope_head_dim)
    state_values = kda * m.kda_num_heads * m.kda_head_dim * m.kda_head_v_dim
    # absorbed MLA decode: scores over the latent + rope part, values over the latent
    decode_attn = mla * 2.0 * m.mla_num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    prefill_attn = mla * 2.0 * m.mla_num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return RolloutCost(
        dense_weight_bytes=float((pc.total - routed) * cfg.bytes_per_param),
        routed_weight_bytes=float(routed * cfg.bytes_per_param),
        active_params=float(pc.active),
        experts=m.num_experts if routed else 0,
        top_k=m.top_k,
        kv_bytes_per_token=float(kv_values * cfg.kv_bytes_per_value),
        state_bytes_per_seq=float(state_values * cfg.state_bytes_per_value),
        mla_flops_per_context_token=decode_attn,
        mla_prefill_flops_per_pair=prefill_attn,
        num_layers=m.num_layers,
        hidden_bytes_per_token=float(m.d_model * 2),
        hbm_bytes_per_s=hw.hbm_bytes_per_s,
        hbm_capacity_bytes=float(hw.hbm_capacity_bytes),
        matmul_flops_per_s=hw.matmul_flops_per_s,
        kernel_launch_s=hw.kernel_launch_s,
        kernels_per_layer=cfg.decode_kernels_per_layer,
        nvlink_bus_bytes_per_s=hw.intra_node.bus_bytes_per_s,
        nvlink_latency_s=hw.intra_node.latency_s,
        nvlink_p2p_bytes_per_s=hw.intra_node.p2p_bytes_per_s,
        ib_p2p_bytes_per_s=hw.inter_node.p2p_bytes_per_s,
        ib_latency_s=hw.inter_node.latency_s,
        gpus_per_node=hw.gpus_per_node,
        mp_efficiency=cfg.mp_efficiency,
        hbm_utilization=cfg.hbm_utilization,
        fixed_cost_scale=cfg.fixed_cost_scale,
        swap_bytes_per_s=cfg.swap_bytes_per_s,
    )


def _links(hw: HardwareProfile) -> dict:
    return dict(
        hbm_bytes_per_s=hw.hbm_bytes_per_s,
        hbm_capacity_bytes=float(hw.hbm_capacity_bytes),
        matmul_flops_per_s=hw.matmul_flops_per_s,
        kernel_launch_s=hw.kernel_launch_s,
        nvlink_bus_bytes_per_s=hw.intra_node.bus_bytes_per_s,
        nvlink_latency_s=hw.intra_node.latency_s,
        nvlink_p2p_bytes_per_s=hw.intra_node.p2p_bytes_per_s,
        ib_p2p_bytes_per_s=hw.inter_node.p2p_bytes_per_s,
        ib_latency_s=hw.inter_node.latency_s,
        gpus_per_node=hw.gpus_per_node,
    )


def _dense_cost(cfg: RolloutWorkload, m: DenseServedModel, hw: HardwareProfile) -> RolloutCost:
    attn = 4.0 * m.num_layers * m.num_heads * m.head_dim  # QK^T and PV per (query, key) pair
    return RolloutCost(
        dense_weight_bytes=float(m.params * cfg.bytes_per_param),
        routed_weight_bytes=0.0,
        active_params=float(m.params - m.vocab_size * m.d_model),  # the input embedding is a lookup
        experts=0,
        top_k=0,
        kv_bytes_per_token=float(m.num_layers * 2 * m.num_kv_heads * m.head_dim * cfg.kv_bytes_per_value),
        state_bytes_per_seq=0.0,
        mla_flops_per_context_token=attn,
        mla_prefill_flops_per_pair=attn,
        num_layers=m.num_layers,
        hidden_bytes_per_token=float(m.d_model * 2),
        kernels_per_layer=cfg.decode_kernels_per_layer,
        mp_efficiency=cfg.mp_efficiency,
        hbm_utilization=cfg.hbm_utilization,
        fixed_cost_scale=cfg.fixed_cost_scale,
        swap_bytes_per_s=cfg.swap_bytes_per_s,
        **_links(hw),
    )
