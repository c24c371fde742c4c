"""Which ancestor-attention path the backend picks (the GPU paths themselves are checked
against float64 references in tests/exec/gpu and on the device)."""

import numpy as np
import pytest
import torch

from harts.config.kernels import Impl, KernelConfig
from harts.exec.ops.attention import tree as backend
from harts.exec.ops.attention.tree import FastTreeAttention, prefer_cudnn_split


def _layout(chains: int, rows_per_chain: int, kernels: KernelConfig | None = None):
    # `chains` root-to-leaf chains hanging off one root row, each rows_per_chain long
    parent = [-1]
    for _ in range(chains):
        prev = 0
        for _ in range(rows_per_chain):
            parent.append(prev)
            prev = len(parent) - 1
    parent = np.asarray(parent)
    L = parent.size
    end = np.arange(L)
    for r in range(L - 1, 0, -1):
        end[parent[r]] = max(end[parent[r]], end[r])
    return FastTreeAttention(torch.arange(L), torch.as_tensor(end), parent, kernels=kernels or KernelConfig())


def test_cudnn_split_is_preferred_only_for_long_segments():
    assert prefer_cudnn_split(82_000, 8)
    assert prefer_cudnn_split(32_768, 1)
    assert not prefer_cudnn_split(32_768, 39)
    assert not prefer_cudnn_split(0, 0)


def test_the_switch_forces_a_path_and_fp32_takes_flex():
    att = lambda choice: _layout(3, 5, KernelConfig(tree_attention=choice))  # noqa: E731
    assert att("flex").impl(torch.bfloat16) is Impl.FLEX
    assert att("cudnn").impl(torch.bfloat16) is Impl.CUDNN
    assert att("cudnn").impl(torch.float32) is Impl.FLEX  # neither cuDNN nor flash computes fp32 here
    # off CUDA nothing probes cuDNN: the varlen path (or Flex where torch lacks varlen)
    assert att("auto").impl(torch.bfloat16) in (Impl.VARLEN, Impl.FLEX)
    assert att("graph").impl(torch.bfloat16) is Impl.GRAPH


def test_unknown_switch_values_raise():
    # a typo must not silently run the default path
    with pytest.raises(ValueError, match="tree_attention"):
        KernelConfig(tree_attention="grpah")
    with pytest.raises(ValueError, match="baseline_attention"):
        KernelConfig(baseline_attention="cudnn-graph")
    assert KernelConfig(baseline_attention="graph").baseline_attention == "graph"


def test_graph_kernels_are_none_without_cuda():
    # CPU-only machines never build cuDNN graphs; the backend falls back quietly
    if not torch.cuda.is_available():
        assert backend.graph_kernels(192, 128) is None


def test_split_part_kernel_follows_length_workspace_and_determinism(monkeypatch):
    # the graph path's backward kernel per part of the split: dense per sequence where they
    # are long, the deterministic graph where its workspace (B x H x Sq x Sk x 2 bytes,
    # bucketed) fits, else the graph without the flag, or dense under deterministic mode
    from harts.exec.ops.attention import split as split_attention

    monkeypatch.setattr(backend, "cudnn_split_ok", lambda D, E: True)
    monkeypatch.setattr(backend, "graph_kernels", lambda D, E: ("fwd", "graph-det"))
    monkeypatch.setattr(split_attention, "cudnn_kernel", lambda D, E, variant="dense-strided": variant)
    pick = lambda *a: backend.split_part_kernel(192, 128, 16, *a)  # noqa: E731
    assert pick(32_768, 1, 32_768, 32_768) == "dense-strided"  # one long chain
    assert pick(12_000, 30, 500, 9_000) == "dense-strided"  # a long key side
    assert pick(4_000, 8, 700, 700) == "graph-det"  # 8 x 16 x 768^2 x 2 bytes = 144 MiB
    assert pick(8_000, 20, 1_000, 1_000) == "graph-nondet"  # 24 x 16 x 1024^2 x 2 bytes = 768 MiB
    wide = KernelConfig(graph_deterministic_workspace_max=2**30)
    assert backend.split_part_kernel(192, 128, 16, 8_000, 20, 1_000, 1_000, wide) == "graph-det"
    # 39 segments of up to 4.4k rows: 40 x 16 x 5120^2 x 2 bytes = 31.25 GiB
    assert backend.deterministic_graph_workspace(39, 16, 4383, 4383) == 40 * 16 * 5120 * 5120 * 2
    assert pick(32_768, 39, 4_383, 4_383) == "graph-nondet"
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert pick(32_768, 39, 4_383, 4_383) == "dense-strided"
