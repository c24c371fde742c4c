"""Counting, not pricing: the kernels one pipeline stage runs for a microbatch, with their
FLOPs, HBM bytes, kernel launches and communication bytes, derived from the model config.

Both cost models price the same `OpCall` list (`costs.py`): the roofline model from the
hardware profile, the calibrated model from coefficients fitted to measured profiles, so
a difference between them is a difference in prices, never in what was counted.

Conventions (stated once, used everywhere): activations and weights are bf16 (2 bytes);
gradients accumulate in fp32 (a backward GEMM reads the bf16 weight and reads + writes the
fp32 gradient: 10 bytes per parameter); the backward of a GEMM does twice its forward FLOPs;
the optimizer's time is priced as Adam with fp32 master weights and moments sharded over
the DP group (ZeRO-1); its memory as the executor holds it (`static_bytes`: weights,
gradients and moments in bf16, sharded by FSDP2). A fused action (a consumer backward that
also runs its producer's backward) reads each weight once for both: that is the physical
saving of the fusion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from harts.config.loss import DEFAULT_LM_HEAD_CHUNK_ELEMENTS
from harts.config.models import ModelConfig
from harts.config.parallel import ParallelConfig
from harts.config.param_counts import (
    gated_attention_layer_params,
    gdn_layer_params,
    kda_layer_params,
    mla_layer_params,
)
from harts.plan.stages import StageLayers
from harts.plan.work import MicrobatchWork

__all__ = [
    "OpCall",
    "OpKind",
    "Phase",
    "StageCounter",
]

BF16, FP32 = 2, 4
GRAD_BYTES_PER_PARAM = BF16 + 2 * FP32  # read weight, read + write the fp32 gradient
ADAM_BYTES_PER_PARAM = 4 * FP32 + 3 * FP32 + BF16  # read p,m,v,g; write p,m,v; bf16 copy


class OpKind(StrEnum):
    GEMM = "gemm"
    ELEMENTWISE = "elementwise"
    ATTENTION_CAUSAL = "attention_causal"
    ATTENTION_TREE = "attention_tree"
    KDA_CHUNK = "kda_chunk"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    OPTIMIZER = "optimizer"


class Phase(StrEnum):
    FWD = "fwd"
    BWD = "bwd"
    STEP = "step"  # once per step (gradient sync, optimizer)


@dataclass(frozen=True)
class OpCall:
    name: str
    kind: OpKind
    phase: Phase
    calls: int = 1  # kernel launches (or collective calls)
    flops: float = 0.0
    bytes: float = 0.0  # HBM traffic
    comm_bytes: float = 0.0  # bytes each GPU sends
    group: int = 1  # ranks in the collective
    spans_nodes: bool = False
    pair_heads: float = 0.0  # attention: allowed (query, key) pairs x heads
    qk_v_dim: float = 0.0  # attention: qk_dim + v_dim
    token_heads_kv: float = 0.0  # KDA: tokens x heads x K x V
    chunk_steps: float = 0.0  # KDA: sequential chunk steps of the longest sequence


def _recurrence_rounds(name: str, phase: Phase, works: Sequence[MicrobatchWork], heads_kv: int) -> list[OpCall]:
    """One chunkwise call per KDA round of every microbatch (KDA and Gated DeltaNet alike:
    `heads_kv` = heads x K x V of the layer's recurrence)."""
    return [OpCall(name, OpKind.KDA_CHUNK, phase, 1, token_heads_kv=float(rnd.tokens) * heads_kv,
                   chunk_steps=float(rnd.max_chunks)) for w in works for rnd in w.kda_rounds]


def _gemm(name: str, phase: Phase, n: float, d_in: int, d_out: int, calls: int, n_weights: float = 1.0) -> OpCall:
    """n rows through a d_in x d_out projection (n_weights copies of it, e.g. local experts)."""
    params = d_in * d_out * n_weights
    if phase == Phase.FWD:
        return OpCall(name, OpKind.GEMM, phase, calls, 2.0 * n * d_in * d_out,
                      params * BF16 + n * (d_in + d_out) * BF16)
    return OpCall(name, OpKind.GEMM, phase, 2 * calls, 4.0 * n * d_in * d_out,
                  params * GRAD_BYTES_PER_PARAM + 2 * n * (d_in + d_out) * BF16)


def _elementwise(name: str, phase: Phase, bytes_fwd: float, calls: int) -> OpCall:
    m = 1 if phase == Phase.FWD else 2
    return OpCall(name, OpKind.ELEMENTWISE, phase, m * calls, bytes=m * bytes_fwd)


class StageCounter:
    """Op lists and memory sizes of one pipeline stage under one parallel layout."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, layers: StageLayers, gpus_per_node: int,
                 recompute: bool = True):
        self.recompute = recompute
        self.m = model
        self.par = parallel
        self.layers = layers
        self.gpus_per_node = gpus_per_node
        self.ep_spans_nodes = parallel.ep_spans_nodes(gpus_per_node)

    # ---- per-layer op lists ----------------------------------------------------------

    def _kda_layer(self, phase: Phase, n: float, works: Sequence[MicrobatchWork]) -> list[OpCall]:
        m = self.m
        d, h, k, v, r = m.d_model, m.kda_num_heads, m.kda_head_dim, m.kda_head_v_dim, m.gate_rank
        qkv = 2 * h * k + h * v
        ops = [
            _elementwise("kda.norm", phase, 2 * n * d * BF16, 1),
            _gemm("kda.in_proj", phase, n, d, qkv + h + 2 * r, 4),
            _gemm("kda.gate_up", phase, n, r, h * k + h * v, 2),
            _elementwise("kda.conv", phase, 3 * n * qkv * BF16, 4),
        ]
        ops += _recurrence_rounds("kda.core", phase, works, h * k * v)
        ops += [
            _elementwise("kda.out_norm_gate", phase, 3 * n * h * v * BF16, 2),
            _gemm("kda.o_proj", phase, n, h * v, d, 1),
            _elementwise("kda.residual", phase, 3 * n * d * BF16, 1),
        ]
        return ops

    def _mla_layer(self, phase: Phase, n: float, works: Sequence[MicrobatchWork]) -> list[OpCall]:
        m = self.m
        d, h, c = m.d_model, m.mla_num_heads, m.kv_lora_rank
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        ops = [
            _elementwise("mla.norm", phase, 2 * n * d * BF16, 1),
            _gemm("mla.q_kv_a", phase, n, d, h * qk + c + m.qk_rope_head_dim, 2),
            _elementwise("mla.kv_norm", phase, 2 * n * c * BF16, 1),
            _gemm("mla.kv_b", phase, n, c, h * (m.qk_nope_head_dim + m.v_head_dim), 1),
        ]
        causal = sum(w.attn_pairs_causal for w in works)
        tree = sum(w.attn_pairs_tree for w in works)
        for kind, pairs in ((OpKind.ATTENTION_CAUSAL, causal), (OpKind.ATTENTION_TREE, tree)):
            if pairs:
                ops.append(OpCall("mla.attention", kind, phase, 1, pair_heads=float(pairs) * h,
                                  qk_v_dim=float(qk + m.v_head_dim)))
        ops += [
            _gemm("mla.o_proj", phase, n, h * m.v_head_dim, d, 1),
            _elementwise("mla.residual", phase, 3 * n * d * BF16, 1),
        ]
        return ops

    def _gdn_layer(self, phase: Phase, n: float, works: Sequence[MicrobatchWork]) -> list[OpCall]:
        """Qwen3-Next's Gated DeltaNet: in_proj_qkvz + in_proj_ba, one conv over q|k|v, the
        recurrence as KDA rounds over the value heads (HARTS runs it through the KDA
        kernels with the decay broadcast along K), the SiLU-gated norm, out_proj."""
        m = self.m
        d, hk, hv, k, v = m.d_model, m.gdn_num_k_heads, m.gdn_num_v_heads, m.gdn_head_k_dim, m.gdn_head_v_dim
        qkv = 2 * hk * k + hv * v
        ops = [
            _elementwise("gdn.norm", phase, 2 * n * d * BF16, 1),
            _gemm("gdn.in_proj", phase, n, d, qkv + hv * v + 2 * hv, 2),
            _elementwise("gdn.conv", phase, 3 * n * qkv * BF16, 1),
            _elementwise("gdn.qk_norm_gate", phase, 2 * n * (2 * hv * k + 2 * hv) * BF16, 3),
        ]
        ops += _recurrence_rounds("gdn.core", phase, works, hv * k * v)
        ops += [
            _elementwise("gdn.out_norm_gate", phase, 3 * n * hv * v * BF16, 1),
            _gemm("gdn.out_proj", phase, n, hv * v, d, 1),
            _elementwise("gdn.residual", phase, 3 * n * d * BF16, 1),
        ]
        return ops

    def _gated_attention_layer(self, phase: Phase, n: float, works: Sequence[MicrobatchWork]) -> list[OpCall]:
        """Qwen3-Next's gated attention: q (with gate), k, v projections, q/k norms and
        partial RoPE, attention over the query heads (keys/values repeated for GQA), the
        sigmoid output gate, o_proj."""
        m = self.m
        d, h, g, e = m.d_model, m.attn_num_heads, m.attn_num_kv_heads, m.attn_head_dim
        ops = [
            _elementwise("gattn.norm", phase, 2 * n * d * BF16, 1),
            _gemm("gattn.qkv", phase, n, d, 2 * h * e + 2 * g * e, 3),
            _elementwise("gattn.qk_norm_rope", phase, 2 * n * (h + g) * e * BF16, 4),
        ]
        causal = sum(w.attn_pairs_causal for w in works)
        tree = sum(w.attn_pairs_tree for w in works)
        for kind, pairs in ((OpKind.ATTENTION_CAUSAL, causal), (OpKind.ATTENTION_TREE, tree)):
            if pairs:
                ops.append(OpCall("gattn.attention", kind, phase, 1, pair_heads=float(pairs) * h,
                                  qk_v_dim=float(2 * e)))
        ops += [
            _elementwise("gattn.gate", phase, 3 * n * h * e * BF16, 1),
            _gemm("gattn.o_proj", phase, n, h * e, d, 1),
            _elementwise("gattn.residual", phase, 3 * n * d * BF16, 1),
        ]
        return ops

    def _dense_ffn(self, phase: Phase, n: float) -> list[OpCall]:
        d, f = self.m.d_model, self.m.dense_ffn_dim
        return [
            _elementwise("ffn.norm", phase, 2 * n * d * BF16, 1),
            _gemm("ffn.gate_up", phase, n, d, 2 * f, 1),
            _elementwise("ffn.act", phase, 3 * n * f * BF16, 1),
            _gemm("ffn.down", phase, n, f, d, 1),
            _elementwise("ffn.residual", phase, 3 * n * d * BF16, 1),
        ]

    def _moe_ffn(self, phase: Phase, n: float) -> list[OpCall]:
        m, ep = self.m, self.par.ep
        d, f, e, k = m.d_model, m.expert_ffn_dim, m.num_experts, m.top_k
        local_e = e / ep
        # balanced routing assumption: each GPU of the EP group runs n * k routed rows
        routed = n * k
        ops = [
            _elementwise("moe.norm", phase, 2 * n * d * BF16, 1),
            _gemm("moe.router", phase, n, d, e, 1),
            _elementwise("moe.topk", phase, 2 * n * e * FP32, 2),
        ]
        a2a = []
        if ep > 1:
            sent = routed * d * BF16 * (ep - 1) / ep
            a2a = [OpCall("moe.all_to_all", OpKind.ALL_TO_ALL, phase, 2, comm_bytes=2 * sent,
                          group=ep, spans_nodes=self.ep_spans_nodes)]
        ops += a2a
        ops += [
            _elementwise("moe.permute", phase, 4 * routed * d * BF16, 2),
            _gemm("moe.experts_gate_up", phase, routed, d, 2 * f, 1, n_weights=local_e),
            _elementwise("moe.act", phase, 3 * routed * f * BF16, 1),
            _gemm("moe.experts_down", phase, routed, f, d, 1, n_weights=local_e),
        ]
        if m.shared_ffn_dim:
            fs = m.shared_ffn_dim
            ops += [
                _gemm("moe.shared_gate_up", phase, n, d, 2 * fs, 1),
                _elementwise("moe.shared_act", phase, 3 * n * fs * BF16, 1),
                _gemm("moe.shared_down", phase, n, fs, d, 1),
            ]
            if m.shared_expert_gate:
                ops += [_gemm("moe.shared_expert_gate", phase, n, d, 1, 1),
                        _elementwise("moe.shared_gate_mul", phase, 3 * n * d * BF16, 1)]
        ops.append(_elementwise("moe.residual", phase, 3 * n * d * BF16, 1))
        return ops

    # ---- a microbatch (or a fused group) through the stage --------------------------

    def pass_ops(self, phase: Phase, works: Sequence[MicrobatchWork]) -> list[OpCall]:
        """One forward or backward pass of the stage over the given microbatches, run as one
        pass (one set of kernels, each weight read once). In a fused backward the KDA calls
        of the consumer and of its producer stay separate rounds: the producer's boundary
        states only receive their gradient once the consumer's KDA backward has run."""
        return [op for op, count in self.pass_op_counts(phase, works) for _ in range(count)]

    def pass_op_counts(self, phase: Phase, works: Sequence[MicrobatchWork]) -> list[tuple[OpCall, int]]:
        """`pass_ops` grouped: every layer of one kind runs the same kernels on the same rows,
        so each distinct op is listed once with the number of layers that run it."""
        if phase == Phase.BWD and self.recompute:
            # full activation recomputation: the backward reruns the stage's forward first
            # (the loss head excepted: its gradient is formed in the forward, chunk by chunk)
            again = [(op, c) for op, c in self._pass_op_counts(Phase.FWD, works)
                     if op.name not in ("final_norm", "lm_head", "log_softmax")]
            return again + self._pass_op_counts(phase, works)
        return self._pass_op_counts(phase, works)

    def _pass_op_counts(self, phase: Phase, works: Sequence[MicrobatchWork]) -> list[tuple[OpCall, int]]:
        lay = self.layers
        n = float(sum(w.tokens for w in works))
        out: list[tuple[OpCall, int]] = []
        if lay.has_embedding:
            out.append((_elementwise("embedding", phase, 2 * n * self.m.d_model * BF16, 1), 1))
        for count, ops in (
            (lay.num_kda, lambda: self._kda_layer(phase, n, works)),
            (lay.num_mla, lambda: self._mla_layer(phase, n, works)),
            (lay.num_gdn, lambda: self._gdn_layer(phase, n, works)),
            (lay.num_gated_attention, lambda: self._gated_attention_layer(phase, n, works)),
            (lay.num_dense_ffn, lambda: self._dense_ffn(phase, n)),
            (lay.num_moe, lambda: self._moe_ffn(phase, n)),
        ):
            if count:
                out += [(op, count) for op in ops()]
        if lay.has_lm_head:
            rows = float(sum(w.rows_out for w in works))
            vocab = self.m.vocab_size
            out += [
                (_elementwise("final_norm", phase, 2 * n * self.m.d_model * BF16, 1), 1),
                (_gemm("lm_head", phase, rows, self.m.d_model, vocab, 1), 1),
                # chunked log-softmax + gather: read the logits, write their gradient
                (_elementwise("log_softmax", phase, 2 * rows * vocab * BF16, 2), 1),
            ]
        return out

    def p2p_op(self, phase: Phase, work: MicrobatchWork) -> OpCall:
        """Hidden rows (forward) or their gradient (backward) to the next/previous stage."""
        return OpCall("pp.send", OpKind.P2P, phase, 1, comm_bytes=float(work.tokens) * self.m.d_model * BF16,
                      group=2, spans_nodes=self.par.pp_spans_nodes(self.gpus_per_node))

    # ---- parameters and memory -------------------------------------------------------

    def stage_params(self) -> tuple[float, float]:
        """(non-expert parameters, routed-expert parameters) held by the stage, unsharded."""
        m, lay = self.m, self.layers
        d = m.d_model
        dense = lay.num_kda * kda_layer_params(m) + lay.num_mla * mla_layer_params(m)
        dense += lay.num_gdn * gdn_layer_params(m) + lay.num_gated_attention * gated_attention_layer_params(m)
        dense += 2 * d * len(lay.layers)
        dense += lay.num_dense_ffn * 3 * d * m.dense_ffn_dim
        dense += lay.num_moe * (m.num_experts * d + 3 * d * m.shared_ffn_dim)
        if m.shared_expert_gate and m.shared_ffn_dim:
            dense += lay.num_moe * d
        experts = lay.num_moe * m.num_experts * 3 * d * m.expert_ffn_dim
        if lay.has_embedding:
            dense += m.vocab_size * d
        if lay.has_lm_head:
            dense += d + (0 if m.tie_embeddings else m.vocab_size * d)
        return float(dense), float(experts)

    def static_bytes(self) -> float:
        """What the executor holds for the whole step: the weights, their gradients and
        AdamW's two moments, all in the weights' dtype (bf16: the executor trains a model in
        its own dtype with `torch.optim.AdamW`, no float32 master copy; `harts.exec.step`),
        sharded by FSDP2 over DP (the routed experts over dp / ep, each rank holding 1 / ep
        of them), and with dp > 1 the stage's weights gathered whole for the step as well
        (`fully_shard(..., reshard_after_forward=False)`, `harts.distributed.parallelize`).
        Measured on one H100 (tiny-h200, 1.31B parameters): 9.81 GiB allocated before the
        step's activations, against 9.73 GiB by this rule (docs/BENCHMARKS.md, "The
        simulator's memory against measured peaks")."""
        dense, experts = self.stage_params()
        local_experts = experts / self.par.ep
        expert_dp = self.par.dp // self.par.ep
        sharded = 4 * BF16 * (dense / self.par.dp + local_experts / expert_dp)
        gathered = BF16 * (dense + local_experts) if self.par.dp > 1 else 0.0
        return sharded + gathered

    def _layer_activation_bytes(self) -> dict[str, float]:
        """Saved-for-backward bytes per row of one layer of each kind (no recomputation)."""
        m = self.m
        d = m.d_model
        h, k, v, r = m.kda_num_heads, m.kda_head_dim, m.kda_head_v_dim, m.gate_rank
        qkv = 2 * h * k + h * v
        kda = 2 * d * BF16 + 2 * qkv * BF16 + h * k * FP32 + h * FP32 + 2 * r * BF16 + 3 * h * v * BF16
        hm, c = m.mla_num_heads, m.kv_lora_rank
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        mla = (2 * d + hm * qk + c + m.qk_rope_head_dim + c + hm * (m.qk_nope_head_dim + m.v_head_dim)
               + hm * m.v_head_dim) * BF16 + hm * FP32
        dense = (2 * d + 3 * m.dense_ffn_dim) * BF16
        fs = m.shared_ffn_dim
        moe = ((2 * d + m.top_k * (d + 3 * m.expert_ffn_dim) + 3 * fs) * BF16
               + m.num_experts * FP32 + m.top_k * FP32)
        hk, hv, gk, gv = m.gdn_num_k_heads, m.gdn_num_v_heads, m.gdn_head_k_dim, m.gdn_head_v_dim
        gqkv = 2 * hk * gk + hv * gv
        # input, projections (q|k|v|z, b|a), conv output, repeated normalised q/k, the
        # broadcast decay (fp32, [H, K]), beta, recurrence output and its gated norm
        gdn = ((2 * d + gqkv + hv * gv + 2 * hv + gqkv + 2 * hv * gk + 3 * hv * gv) * BF16
               + hv * gk * FP32 + hv * FP32)
        ha, ga, e = m.attn_num_heads, m.attn_num_kv_heads, m.attn_head_dim
        # input, q|gate|k|v, normalised/rotated q and k (k, v repeated to the query heads),
        # attention output, gated output, log-sum-exp
        gattn = (2 * d + 2 * ha * e + 2 * ga * e + 3 * ha * e + 2 * ha * e) * BF16 + ha * FP32
        return {"kda": kda, "mla": mla, "dense": dense, "moe": moe, "gdn": gdn, "gated_attention": gattn}

    def activation_bytes_per_token(self) -> float:
        """Held from a row's forward to its backward on this stage. With recomputation only
        each layer's input (bf16 hidden row) is kept; without, everything saved for backward."""
        m, lay = self.m, self.layers
        d = m.d_model
        head = d * BF16 + FP32 if lay.has_lm_head else 0.0
        if self.recompute:
            return float(len(lay.layers) * d * BF16 + head)
        a = self._layer_activation_bytes()
        total = lay.num_kda * a["kda"] + lay.num_mla * a["mla"] + lay.num_dense_ffn * a["dense"] + lay.num_moe * a["moe"]
        total += lay.num_gdn * a["gdn"] + lay.num_gated_attention * a["gated_attention"]
        return float(total + head)

    def recompute_working_bytes_per_token(self) -> float:
        """With recomputation, the backward holds one layer's saved activations at a time."""
        if not self.recompute:
            return 0.0
        a = self._layer_activation_bytes()
        lay = self.layers
        attn = max(a["kda"] if lay.num_kda else 0.0, a["mla"] if lay.num_mla else 0.0,
                   a["gdn"] if lay.num_gdn else 0.0, a["gated_attention"] if lay.num_gated_attention else 0.0)
        ffn = max(a["dense"] if lay.num_dense_ffn else 0.0, a["moe"] if lay.num_moe else 0.0)
        return float(attn + ffn)

    def producer_extra_bytes_per_token(self) -> float:
        """Gradient accumulators a producer keeps for its consumers, per producer row: fp32
        dK/dV of every MLA layer and the KDA boundary-state gradients (one K x V state per
        head per chunk boundary)."""
        m, lay = self.m, self.layers
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        mla = m.mla_num_heads * (qk + m.v_head_dim) * FP32
        kda = m.kda_num_heads * m.kda_head_dim * m.kda_head_v_dim * FP32 / m.chunk_size
        gattn = m.attn_num_heads * 2 * m.attn_head_dim * FP32  # dK/dV after the GQA repeat
        gdn = m.gdn_num_v_heads * m.gdn_head_k_dim * m.gdn_head_v_dim * FP32 / m.chunk_size
        return float(lay.num_mla * mla + lay.num_kda * kda + lay.num_gated_attention * gattn + lay.num_gdn * gdn)

    def _attention_kv_bytes_per_row(self) -> tuple[float, float]:
        """Keys and values of one row in one MLA layer and in one gated-attention layer, as
        the layer hands them to attention (bf16; MLA's per-head keys with the RoPE part
        repeated, gated attention's repeated to the query heads)."""
        m = self.m
        mla = m.mla_num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * BF16
        gattn = m.attn_num_heads * 2 * m.attn_head_dim * BF16
        return float(mla), float(gattn)

    def attention_kv_bytes_per_row(self) -> float:
        """Keys and values of one row over every full-attention layer of the stage: what a
        stash keeps per row it hands on."""
        mla, gattn = self._attention_kv_bytes_per_row()
        return self.layers.num_mla * mla + self.layers.num_gated_attention * gattn

    def stash_bytes(self, work: MicrobatchWork, consumers: int) -> float:
        """A window producer's stash with its gradients, once its consumers' backwards have
        run (`harts.exec.stash`): per row its consumers read (`work.read_rows`), the keys
        and values of every full-attention layer (`_attention_kv_bytes_per_row`); per
        consumer, one K x V state of every linear-attention layer
        (fp32) where the consumer starts. Each has a gradient of its own size, which the
        consumers' backwards accumulate in place. The conv inputs and replayed KDA inputs a
        stash also keeps (a few rows per consumer) are left out."""
        m, lay = self.m, self.layers
        read = work.tokens if work.read_rows is None else work.read_rows
        if work.stash_on_host and self.recompute:  # an outer stash of a long chain: its keys and values in host memory
            read = 0
        mla, gattn = self._attention_kv_bytes_per_row()
        kv = lay.num_mla * mla + lay.num_gated_attention * gattn
        states = (lay.num_kda * m.kda_num_heads * m.kda_head_dim * m.kda_head_v_dim
                  + lay.num_gdn * m.gdn_num_v_heads * m.gdn_head_k_dim * m.gdn_head_v_dim) * FP32
        return 2.0 * (read * kv + consumers * states)

    def transient_bytes(self, works: Sequence[MicrobatchWork], phase: Phase = Phase.FWD) -> float:
        """Workspace live only during a pass: the blocks' (MoE dispatch buffers, and in a
        recomputing backward one layer's activations) or the LM head's, whichever is larger.
        The executor runs the chunked LM head after the blocks in the forward and before
        them in the backward, so its workspace (three float32 [chunk, vocab] tensors of at
        most `DEFAULT_LM_HEAD_CHUNK_ELEMENTS` logits, `harts.exec.loss`) and a block's are
        never live together: tiny-h200's measured peaks follow the larger, not the sum
        (docs/BENCHMARKS.md, "The simulator's memory against measured peaks")."""
        m, lay = self.m, self.layers
        n = float(sum(w.tokens for w in works))
        blocks = n * self.recompute_working_bytes_per_token() if phase == Phase.BWD else 0.0
        # a consumer's attention layer over its context rows: one copy of the layer's keys
        # and values per context row in the forward (`RowPlace`'s `cat` of [context | own]),
        # two in the backward (the recomputed `cat` and its gradient, whose context part is
        # a view the stash's gradient accumulates). Fitted to the measured peaks of chains,
        # whose context is up to 5x their own rows (docs/BENCHMARKS.md, "The simulator's
        # memory against measured peaks")
        context = float(sum(w.context_rows for w in works))
        mla, gattn = self._attention_kv_bytes_per_row()
        widest = max(mla if lay.num_mla else 0.0, gattn if lay.num_gated_attention else 0.0)
        blocks += (2 if phase == Phase.BWD else 1) * context * widest
        if lay.num_moe:
            blocks += 2 * n * m.top_k * (m.d_model + 2 * m.expert_ffn_dim) * BF16
        head = 3 * FP32 * min(float(DEFAULT_LM_HEAD_CHUNK_ELEMENTS), n * m.vocab_size) if lay.has_lm_head else 0.0
        return max(blocks, head)

    def step_ops(self) -> list[OpCall]:
        """Gradient sync (reduce-scatter fp32 gradients, all-gather bf16 weights) and Adam."""
        dense, experts = self.stage_params()
        par = self.par
        local_experts = experts / par.ep
        expert_dp = par.dp // par.ep
        ops: list[OpCall] = []
        for name, params, group in (("dense", dense, par.dp), ("experts", local_experts, expert_dp)):
            if group > 1 and params:
                spans = group > self.gpus_per_node
                frac = (group - 1) / group
                ops.append(OpCall(f"grad.reduce_scatter.{name}", OpKind.REDUCE_SCATTER, Phase.STEP, 1,
                                  comm_bytes=params * FP32 * frac, group=group, spans_nodes=spans))
                ops.append(OpCall(f"grad.all_gather.{name}", OpKind.ALL_GATHER, Phase.STEP, 1,
                                  comm_bytes=params * BF16 * frac, group=group, spans_nodes=spans))
        shard = dense / par.dp + local_experts / expert_dp
        opt = [OpCall("adam", OpKind.OPTIMIZER, Phase.STEP, 8, bytes=shard * ADAM_BYTES_PER_PARAM)]
        return ops + opt
