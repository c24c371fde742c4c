"""`step_benchmark` (behind `harts bench`) runs end to end on CPU with the CUDA memory
calls stubbed: every mode trains, the ratios and the ideal are consistent, the speedup is a ratio of the
measured times (no number here is asserted about speed)."""

import pytest
import torch

from harts.bench.step import step_benchmark
from harts.tree.workload import generate, preset


def test_step_benchmark_on_cpu(monkeypatch):
    for name, value in (("reset_peak_memory_stats", None), ("max_memory_allocated", 0), ("empty_cache", None)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, value=value, **k: value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    trajs = generate(preset("tiny-treestep", vocab_size=512)).trajectories()
    lines = []
    r = step_benchmark(trajs, model="tiny-cpu", dtype=torch.float32, microbatch_tokens=4096, steps=1,
                       warmup=0, device="cpu", baselines=("packed", "prefix-merged"), progress=lines.append)
    assert r["expanded_tokens"] == sum(len(t) for t in trajs)
    # progress: every mode built, timed and reported, in order, each line with the seconds so far
    for mode in ("packed", "prefix-merged", "tree"):
        said = [line for line in lines if line.startswith(f"{mode}: ")]
        assert said[0].startswith(f"{mode}: building") and said[-1].startswith(f"{mode}: step ")
    assert all(line.endswith(" s)") for line in lines)
    assert r["speedup"] == pytest.approx(r["expanded"]["seconds"] / r["tree"]["seconds"])
    assert r["speedup_inline"] == pytest.approx(r["expanded"]["inline_seconds"] / r["tree"]["inline_seconds"])
    for mode in ("expanded", "prefix_merged", "tree"):  # one timed step each way, prepared ahead or inline
        assert len(r[mode]["all_seconds"]) == len(r[mode]["all_inline_seconds"]) == 1
        assert r[mode]["prepare_seconds"] > 0
    # GEMM FLOPs follow the row ratio, attention less: the FLOP ratio lies between
    parts = r["flop_ratio_parts"]
    assert parts["attention_ratio"] <= r["flop_ratio"] <= parts["gemm_ratio"]
    assert parts["gemm_ratio"] == pytest.approx(r["expanded_tokens"] / r["tree"]["rows"])
    assert r["tree"]["loss"] == pytest.approx(r["expanded"]["loss"], rel=1e-4)
    assert r["prefix_merged"]["loss"] == pytest.approx(r["expanded"]["loss"], rel=1e-4)
    # the prefix-merged baseline computes no more rows than the packed one, the tree fewest
    assert r["tree"]["rows"] <= r["prefix_merged"]["rows"] <= r["expanded"]["rows"]
    for name, key in (("packed", "expanded"), ("prefix-merged", "prefix_merged")):
        b = r["baselines"][name]
        assert b["speedup"] == pytest.approx(r[key]["seconds"] / r["tree"]["seconds"])
        assert b["of_ideal"] == pytest.approx(b["speedup"] / b["ideal"])
        assert b["op_seconds"] == "simulated (h200)"
        assert b["work"]["tokens"] == r[key]["rows"]
    assert r["ideal"] == r["baselines"]["packed"]["ideal"]
    # less work to save against the stronger baseline: its ideal is no higher
    assert r["baselines"]["prefix-merged"]["ideal"] <= r["baselines"]["packed"]["ideal"]


def test_kernel_kinds():
    from harts.bench.step import kernel_kind, kind_seconds
    from harts.sim.flops import WorkKind

    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == WorkKind.ATTENTION_PAIRS
    assert kernel_kind("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == WorkKind.KDA_CHUNK_STEPS
    assert kernel_kind("bwd_dhu_inject_kernel") == WorkKind.KDA_CHUNK_STEPS
    assert kernel_kind("chunk_kda_fwd_kernel_intra_sub_chunk") == WorkKind.KDA_TOKENS
    assert kernel_kind("void multi_tensor_apply_kernel<FusedAdamMathFunctor>") == WorkKind.PARAMETERS
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == WorkKind.TOKENS
    assert kernel_kind("l2norm_fwd_kernel") == WorkKind.TOKENS  # KDA's q/k norms run per row
    assert kind_seconds({"flash_fwd": 1.0, "gemm": 2.0, "flash_bwd": 0.5}) == {
        WorkKind.ATTENTION_PAIRS: 1.5, WorkKind.TOKENS: 2.0}


def test_unknown_baseline_is_refused():
    with pytest.raises(ValueError, match="unknown baseline"):
        step_benchmark([], model="tiny-cpu", baselines=("stepwise",), device="cpu")


def test_memory_plan_of_tiny_on_one_h200():
    from harts.bench.memory import largest_fitting_budget, memory_plan

    h200 = 139.8 * 2**30
    plan = memory_plan("tiny", 131072)
    parts = plan["static_bytes"] + plan["activation_bytes"] + plan["lm_head_bytes"]
    assert plan["total_bytes"] == pytest.approx(parts)
    # the chunked LM head keeps one chunk's logits: tiny's 131k-row step plans under one H200;
    # the unchunked [rows, vocab] log-softmax alone would not fit
    assert plan["lm_head_bytes"] <= 3 * 4 * 2**27
    assert plan["total_bytes"] < h200 < plan["unchunked_lm_head_bytes"]
    fits = largest_fitting_budget("tiny", h200)
    assert fits >= 131072 and fits % 4096 == 0
    assert memory_plan("tiny", fits)["total_bytes"] <= h200 < memory_plan("tiny", fits + 4096)["total_bytes"]
    assert largest_fitting_budget("tiny", plan["static_bytes"] / 2) == 0


def test_provenance_takes_the_revision_named_in_the_environment(monkeypatch):
    """A copy of the tree on another machine may carry stale git metadata: HARTS_GIT_REV,
    where set, is the revision recorded (and no dirty flag is claimed for it)."""
    from harts.bench.provenance import provenance

    monkeypatch.setenv("HARTS_GIT_REV", "0123abc")
    p = provenance(["harts", "bench"])
    assert p["git_revision"] == "0123abc" and p["git_dirty"] is None
    monkeypatch.delenv("HARTS_GIT_REV")
    assert provenance(["harts", "bench"])["git_revision"] != "0123abc"


def test_the_packed_baseline_chains_a_trajectory_longer_than_the_budget(monkeypatch):
    """A trajectory longer than the budget: the packed baseline runs the expanded-ffd plan's
    chain of windows, every microbatch within the budget, the tree step's loss up to the MoE
    aux loss (its scope is the microbatch, and the two split differently: as in the test
    above; the policy loss is held to 1e-10 in tests/cli/test_train_cli.py)."""
    for name, value in (("reset_peak_memory_stats", None), ("max_memory_allocated", 0), ("empty_cache", None)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, value=value, **k: value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from tests.strategies import long_chain_trajectories

    trajs = long_chain_trajectories(300, [(3, 60), (130, 40)], seed=2)
    r = step_benchmark(trajs, model="tiny-cpu", dtype=torch.float64, microbatch_tokens=128, steps=1,
                       warmup=0, device="cpu", baselines=("packed",), tree=True)
    assert r["expanded"]["largest_microbatch_rows"] <= 128
    assert r["expanded"]["rows"] == r["expanded_tokens"]  # each trajectory's own copy, once
    assert r["tree"]["loss"] == pytest.approx(r["expanded"]["loss"], rel=1e-4)
