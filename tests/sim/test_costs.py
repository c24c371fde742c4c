"""Cost models: roofline prices by hand, the physics each term encodes, the registry."""

from __future__ import annotations

import math

import pytest

from harts.config.models import get_model_config
from harts.config.parallel import ParallelConfig
from harts.config.param_counts import parameter_counts
from harts.plan.stages import stage_layers
from harts.plan.work import KDARound, MicrobatchWork, expanded_microbatch
from harts.sim.costs import (
    COST_MODELS,
    CostModelName,
    RooflinePricer,
    make_cost_model,
    register_cost_model,
)
from harts.sim.hardware import load_hardware
from harts.sim.ops import OpCall, OpKind, Phase
from harts.sim.parallel import default_parallel

HW = load_hardware("h200")
TINY = get_model_config("tiny")


def test_roofline_gemm_and_elementwise_by_hand():
    pr = RooflinePricer(HW)
    big = OpCall("g", OpKind.GEMM, Phase.FWD, 1, flops=1e15, bytes=1e9)
    assert pr.seconds(big) == pytest.approx(1e15 / HW.matmul_flops_per_s + HW.kernel_launch_s)
    thin = OpCall("g", OpKind.GEMM, Phase.FWD, 2, flops=1e9, bytes=1e10)
    assert pr.seconds(thin) == pytest.approx(1e10 / HW.hbm_bytes_per_s + 2 * HW.kernel_launch_s)
    ew = OpCall("e", OpKind.ELEMENTWISE, Phase.BWD, 3, bytes=4.3e9)
    assert pr.seconds(ew) == pytest.approx(1e-3 + 3 * HW.kernel_launch_s)


def test_attention_reproduces_the_measured_h200_runs():
    # the profile's own measurements: causal 32k x 16 heads fwd+bwd = 37 ms, tree mask 59 ms
    pr = RooflinePricer(HW)
    t = 32768
    for kind, pairs, seconds in ((OpKind.ATTENTION_CAUSAL, t * (t + 1) / 2, 0.037),
                                 (OpKind.ATTENTION_TREE, 0.27 * t * t, 0.059)):
        f = OpCall("a", kind, Phase.FWD, 1, pair_heads=pairs * 16, qk_v_dim=320)
        b = OpCall("a", kind, Phase.BWD, 1, pair_heads=pairs * 16, qk_v_dim=320)
        launches = (HW.attention_kernels_fwd + HW.attention_kernels_bwd) * HW.kernel_launch_s
        assert pr.seconds(f) + pr.seconds(b) == pytest.approx(seconds + launches, rel=1e-9)


def test_kda_rate_and_sequential_round_floor():
    pr = RooflinePricer(HW)
    th = 3.0e6 * 16 * 128 * 128  # one second of measured fwd+bwd work at 16 heads x 128
    f = OpCall("k", OpKind.KDA_CHUNK, Phase.FWD, 1, token_heads_kv=th, chunk_steps=1)
    b = OpCall("k", OpKind.KDA_CHUNK, Phase.BWD, 1, token_heads_kv=th, chunk_steps=1)
    launches = (HW.kda_kernels_fwd + HW.kda_kernels_bwd) * HW.kernel_launch_s
    assert pr.seconds(f) + pr.seconds(b) == pytest.approx(1.0 + launches)
    # one long sequence of one head: the chunk recurrence, not the token rate, bounds it
    long = OpCall("k", OpKind.KDA_CHUNK, Phase.FWD, 1, token_heads_kv=64 * 1 * 128 * 128 * 2000,
                  chunk_steps=2000)
    assert pr.seconds(long) == pytest.approx(2000 * HW.kda_chunk_step_s + HW.kda_kernels_fwd * HW.kernel_launch_s)


def test_more_kda_rounds_cost_more_for_the_same_tokens():
    cost = make_cost_model("roofline", TINY, ParallelConfig(), HW)
    one = MicrobatchWork(mb=0, replica=0, tokens=8192, kda_rounds=(KDARound(8192, 16, 8),), attn_pairs_causal=10**7)
    three = MicrobatchWork(mb=0, replica=0, tokens=8192,
                           kda_rounds=(KDARound(4096, 16, 4), KDARound(2048, 8, 2), KDARound(2048, 8, 2)),
                           attn_pairs_causal=10**7)
    assert cost.forward(0, [three]).seconds > cost.forward(0, [one]).seconds
    assert cost.backward(0, [three]).seconds > cost.backward(0, [one]).seconds


def test_tree_mask_attention_costs_more_per_pair_than_causal():
    cost = make_cost_model("roofline", TINY, ParallelConfig(), HW)
    c = MicrobatchWork(mb=0, replica=0, tokens=8192, kda_rounds=(), attn_pairs_causal=10**9)
    t = MicrobatchWork(mb=0, replica=0, tokens=8192, kda_rounds=(), attn_pairs_causal=0, attn_pairs_tree=10**9)
    assert cost.forward(0, [t]).seconds > cost.forward(0, [c]).seconds


def test_fused_backward_reads_weights_once():
    par = default_parallel(TINY, 8)
    cost = make_cost_model("roofline", TINY, par, HW)
    c = expanded_microbatch(1, 0, [256])
    p = expanded_microbatch(0, 0, [512])
    fused = cost.backward(0, [c, p]).seconds
    apart = cost.backward(0, [c]).seconds + cost.backward(0, [p]).seconds
    assert max(cost.backward(0, [c]).seconds, cost.backward(0, [p]).seconds) < fused < apart


def test_recomputation_trades_backward_time_for_memory():
    par = default_parallel(TINY, 8)
    w = expanded_microbatch(0, 0, [16384])
    on = make_cost_model("roofline", TINY, par, HW, recompute=True)
    off = make_cost_model("roofline", TINY, par, HW, recompute=False)
    for s in range(par.pp):
        assert on.backward(s, [w]).seconds > off.backward(s, [w]).seconds
        assert on.forward(s, [w]).seconds == off.forward(s, [w]).seconds
        assert on.activation_bytes(s, w) < off.activation_bytes(s, w) / 5


def test_static_memory_accounts_every_parameter_once():
    par = ParallelConfig(dp=4, pp=2, ep=4)
    cost = make_cost_model("roofline", TINY, par, HW)
    dense = sum(cost.stages[s].stage_params()[0] for s in range(2))
    experts = sum(cost.stages[s].stage_params()[1] for s in range(2))
    assert dense + experts == parameter_counts(TINY).total
    # bf16 weights, gradients and both AdamW moments sharded by FSDP2 over DP (the 1/4 of
    # the experts a rank holds under ep=4 over dp/ep = 1), and the stage's weights gathered
    # whole for the step
    s0_dense, s0_exp = cost.stages[0].stage_params()
    want = 8 * (s0_dense / 4 + s0_exp / 4) + 2 * (s0_dense + s0_exp / 4)
    assert cost.static_bytes(0) == pytest.approx(want)
    one = make_cost_model("roofline", TINY, ParallelConfig(), HW)
    assert one.static_bytes(0) == pytest.approx(8 * parameter_counts(TINY).total)


def test_static_memory_is_what_the_executors_step_holds():
    """One update step of the executor in bf16 on the CPU: its weights, gradients and
    optimizer state are the simulator's static bytes of one GPU, byte for byte."""
    import torch

    from harts.exec.factory import make_trainer
    from harts.exec.model.model import build_model
    from harts.tree import shapes

    cfg = get_model_config("tiny-cpu")
    torch.manual_seed(0)
    model = build_model(cfg).to(torch.bfloat16)
    trajs = shapes.draw("grpo", 0, 256, vocab_size=cfg.vocab_size)
    trainer = make_trainer("tree", model)
    trainer.step(trajs, 4096)
    params = list(model.parameters())
    held = sum(p.numel() * p.element_size() for p in params)
    held += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    held += sum(t.numel() * t.element_size() for st in trainer.optimizer.state.values()
                for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    cost = make_cost_model("roofline", cfg, ParallelConfig(), HW)
    assert held == cost.static_bytes(0)


def test_all_to_all_only_with_expert_parallelism():
    w = expanded_microbatch(0, 0, [4096])
    with_ep = make_cost_model("roofline", TINY, ParallelConfig(dp=4, ep=4), HW).forward(0, [w])
    without = make_cost_model("roofline", TINY, ParallelConfig(dp=4, ep=1), HW).forward(0, [w])
    assert dict(with_ep.by_kind)["all_to_all"] > 0
    assert "all_to_all" not in dict(without.by_kind)


def test_stage_partition_covers_layers():
    for model in (TINY, get_model_config("flash")):
        for pp in (1, 2, 3, 4):
            lays = stage_layers(model, pp)
            assert sum(len(s.layers) for s in lays) == model.num_layers
            assert lays[0].has_embedding and lays[-1].has_lm_head
            assert sum(s.num_kda for s in lays) == model.num_kda_layers
    assert default_parallel(TINY, 8) == ParallelConfig(dp=4, pp=2, ep=4)
    assert default_parallel(get_model_config("flash"), 64) == ParallelConfig(dp=16, pp=4, ep=8)
    assert math.prod((default_parallel(TINY, 1).dp, default_parallel(TINY, 1).pp)) == 1


def test_registry():
    assert {n.value for n in COST_MODELS} == {"roofline", "calibrated", "executor"}
    with pytest.raises(KeyError, match="unknown cost model"):
        make_cost_model("magic", TINY, ParallelConfig(), HW)
    with pytest.raises(ValueError, match="twice"):
        register_cost_model(CostModelName.ROOFLINE, lambda *a, **k: None)
    with pytest.raises(ValueError, match="calibration"):
        make_cost_model("calibrated", TINY, ParallelConfig(), HW)
