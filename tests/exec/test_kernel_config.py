"""Kernel selection as configuration: `KernelConfig` validates and records itself, is
built from the environment only when asked (`from_env`), and the ops follow the config
they are handed, saying per call when they run another path than the one it asks for."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from harts.config import env
from harts.config.kernels import Impl, KernelConfig
from harts.config.models import get_model_config
from harts.exec import backend
from harts.exec.model import PackedContext, build_model
from harts.exec.ops.attention import naive
from harts.exec.ops.attention.tree import FastTreeAttention
from harts.exec.ops.conv import short_conv as reference_conv
from harts.exec.ops.conv import window_from_cu_seqlens
from harts.exec.ops.record import KernelFallbackWarning, KernelRecord
from harts.exec.trainer import ExpandedTrainer
from harts.exec.tree import TreeContext
from harts.exec.tree_trainer import TreeTrainer
from harts.tree import build_forest
from harts.tree.workload import generate_trajectories

KERNEL_VARS = env.KERNEL_VARIABLES


@pytest.fixture
def clean_env(monkeypatch):
    for name in KERNEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("field, value", [
    ("tree_attention", "grpah"), ("baseline_attention", "cudnn-graph"), ("conv", "fused"),
    ("kda_fwd_h", "16,4"), ("kda_fwd_h", "a,b,c"), ("conv_bwd_tiles", (1, 2, 3)), ("conv_bwd_tiles", "1,2,3,4,5,0"),
    ("force_reference", "yes"), ("cudnn_split_min_rows_per_segment", -1), ("graph_backward_max_rows", 1.5),
    ("kda_fwd_h_programs_per_sm", 0), ("compile", "max-autotune"),
])
def test_unknown_or_malformed_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KernelConfig(**{field: value})


def test_values_are_normalised_and_recorded_as_plain_json():
    k = KernelConfig(tree_attention="cudnn", conv="reference", conv_bwd_tiles="64,16,16,2,16,2", kda_fwd_h="32,2,3")
    assert k.tree_attention is k.tree_attention.CUDNN and k.conv_bwd_tiles == (64, 16, 16, 2, 16, 2)
    assert k.kda_fwd_h_launch == (32, 2, 3) and KernelConfig().kda_fwd_h_launch == "auto"
    d = k.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["tree_attention"] == "cudnn" and d["conv_bwd_tiles"] == [64, 16, 16, 2, 16, 2]
    assert KernelConfig(**{**d, "conv_bwd_tiles": tuple(d["conv_bwd_tiles"])}) == k
    with pytest.raises(AttributeError):
        k.conv = "auto"  # frozen


def test_from_env_reads_the_variables_once_when_built(clean_env):
    assert KernelConfig.from_env() == KernelConfig()
    clean_env.setenv(env.TREE_ATTENTION, "varlen")
    clean_env.setenv(env.BASELINE_ATTENTION, "graph")
    clean_env.setenv(env.CONV, "reference")
    clean_env.setenv(env.CONV_BWD_TILES, "128,32,8,8,32,4")
    clean_env.setenv(env.FWD_H, "fla")
    clean_env.setenv(env.COMPILE, "inductor")
    clean_env.setenv(env.FORCE_REFERENCE, "1")
    clean_env.setenv(env.RECTANGLE_TRIANGLES, "8192")
    clean_env.setenv(env.CHAIN_STASH_BUDGETS, "2.5")
    k = KernelConfig.from_env()
    assert k == KernelConfig(tree_attention="varlen", baseline_attention="graph", conv="reference",
                             conv_bwd_tiles=(128, 32, 8, 8, 32, 4), kda_fwd_h="fla", compile="inductor",
                             force_reference=True, rectangle_triangles_min_rows=8192,
                             chain_stash_device_budgets=2.5)
    assert KernelConfig.from_env(tree_attention="flex").tree_attention == "flex"  # overrides on top
    clean_env.setenv(env.FORCE_REFERENCE, "0")
    assert not KernelConfig.from_env().force_reference
    assert k.force_reference  # a built config does not follow the environment


@pytest.mark.parametrize("var, value", [(env.TREE_ATTENTION, "grpah"), (env.BASELINE_ATTENTION, "cudnn-graph"),
                                        (env.CONV, "fused"), (env.FWD_H, "16"), (env.CONV_BWD_TILES, "1,2"),
                                        (env.COMPILE, "eager"), (env.RECTANGLE_TRIANGLES, "-1"),
                                        (env.RECTANGLE_TRIANGLES, "8k"), (env.CHAIN_STASH_BUDGETS, "-1"),
                                        (env.CHAIN_STASH_BUDGETS, "four")])
def test_from_env_names_the_variable_of_a_bad_value(clean_env, var, value):
    clean_env.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        KernelConfig.from_env()


def test_a_trainer_builds_its_config_once_and_hands_it_to_its_contexts(clean_env):
    model = build_model(get_model_config("tiny-cpu"), dtype=torch.float64, seed=0)
    clean_env.setenv(env.TREE_ATTENTION, "cudnn")
    trainer = TreeTrainer(model)
    clean_env.setenv(env.TREE_ATTENTION, "flex")
    assert trainer.kernels.tree_attention == "cudnn"
    given = KernelConfig(conv="reference")
    trajs = generate_trajectories("tiny-treestep", seed=1, vocab_size=model.config.vocab_size, num_groups=1)
    for cls in (ExpandedTrainer, TreeTrainer):
        t = cls(model, kernels=given)
        mbs = list(t.layout.microbatches(trajs, t.partition(trajs, 1 << 20)))
        assert all(mb.ctx.kernels is given and mb.ctx.kernel_record is t.kernel_record for mb in mbs)


def test_a_step_records_its_config_and_what_ran(clean_env):
    model = build_model(get_model_config("tiny-cpu"), dtype=torch.float64, seed=0)
    trajs = generate_trajectories("tiny-treestep", seed=1, vocab_size=model.config.vocab_size, num_groups=1)
    res = TreeTrainer(model, kernels=KernelConfig()).evaluate(trajs, 1 << 20)
    assert res.kernels["config"] == KernelConfig().to_dict()
    # on the CPU every family runs its reference
    assert res.kernels["ran"] == {"conv": ["reference"], "kda": ["reference"], "l2_norm": ["reference"],
                                  "moe": ["reference"], "rms_norm": ["reference"], "tree_attention": ["reference"]}
    assert res.kernels["fallbacks"] == []


def _conv_case():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    return x, w, window_from_cu_seqlens(torch.tensor([0, 4, 9]), 3, 9)


def test_conv_asked_for_the_fused_kernels_on_the_cpu_runs_the_reference_and_says_so():
    x, w, window = _conv_case()
    want = reference_conv(x, w, None, window_TW=window, activation="silu")
    record = KernelRecord()
    with pytest.warns(KernelFallbackWarning, match="conv: requested triton, ran reference"):
        got = backend.short_conv(x, w, None, window_TW=window, kernels=KernelConfig(conv="triton"), record=record)
    assert torch.equal(got, want)
    assert record.to_dict()["ran"] == {"conv": ["reference"]}
    assert record.to_dict()["fallbacks"][0]["requested"] == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto (and force_reference) pick the reference without a warning
        backend.short_conv(x, w, None, window_TW=window, kernels=KernelConfig(), record=KernelRecord())
        backend.short_conv(x, w, None, window_TW=window, kernels=KernelConfig(conv="triton", force_reference=True))


def test_the_backend_follows_the_config_not_the_environment(clean_env, libraries):
    libraries.set(fla=True, flex=True, grouped_mm=True)
    cuda = torch.device("cuda")
    clean_env.setenv(env.FORCE_REFERENCE, "1")
    clean_env.setenv(env.CONV, "reference")
    assert backend.kda_impl(cuda, torch.bfloat16, KernelConfig()) is Impl.FLA
    assert backend.conv_impl(cuda, KernelConfig()) is Impl.TRITON
    assert backend.kda_impl(cuda, torch.bfloat16, KernelConfig(force_reference=True)) is Impl.REFERENCE
    assert backend.kda_impl(cuda, torch.float64, KernelConfig()) is Impl.REFERENCE


def test_tree_attention_asked_for_cudnn_on_the_cpu_in_float64_falls_back_per_call():
    trajs = generate_trajectories("tiny-treestep", seed=2, vocab_size=64, num_groups=1)
    forest = build_forest(trajs)
    ctx = TreeContext(forest, chunk_size=16, kernels=KernelConfig(tree_attention="cudnn"))
    g = torch.Generator().manual_seed(0)
    R, H = forest.num_rows, 2
    q, k = (torch.randn(R, H, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(R, H, 4, generator=g, dtype=torch.float64)
    end = torch.as_tensor(ctx.layout.end)
    want = naive.tree_attention(q, k, v, 0.3, naive.ancestor_mask(torch.arange(R), end))
    with pytest.warns(KernelFallbackWarning, match="tree_attention: requested cudnn, ran reference .*CUDA"):
        got = ctx.attention(0, q, k, v, 0.3)
    assert torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per (op, reason) on the context's record
        ctx.attention(1, q, k, v, 0.3)
    assert ctx.kernel_record.to_dict()["ran"] == {"tree_attention": ["reference"]}


def test_fast_tree_attention_says_why_it_runs_another_path():
    parent = np.array([-1, 0, 1, 1])
    att = FastTreeAttention(torch.arange(4), torch.tensor([3, 3, 2, 3]), parent,
                            kernels=KernelConfig(tree_attention="graph"))
    impl, why = att._choose(torch.float32, 8, 4)
    assert impl is Impl.FLEX and "bf16/fp16" in why
    assert att._choose(torch.bfloat16, 8, 4) == (Impl.GRAPH, None)
    flex = FastTreeAttention(torch.arange(4), torch.tensor([3, 3, 2, 3]), parent,
                             kernels=KernelConfig(tree_attention="flex"))
    assert flex._choose(torch.float64, 8, 4) == (Impl.FLEX, None)


def test_packed_context_asked_for_the_graph_baseline_off_cuda_runs_per_sequence_and_says_so():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(9, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(9, 2, 4, generator=g, dtype=torch.float64)
    plain = PackedContext(torch.tensor([0, 4, 9]), kernels=KernelConfig())
    graph = PackedContext(torch.tensor([0, 4, 9]), kernels=KernelConfig(baseline_attention="graph"))
    want = plain.attention(0, q, k, v, 0.3)
    with pytest.warns(KernelFallbackWarning, match="baseline_attention: requested graph, ran per-sequence"):
        got = graph.attention(0, q, k, v, 0.3)
    assert torch.equal(got, want)
    assert graph.kernel_record.to_dict()["ran"] == {"baseline_attention": ["per-sequence attention", "reference"]}
