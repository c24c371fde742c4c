"""Which ancestor-attention path the backend picks (the GPU paths themselves are checked
against float64 references in tests/exec/gpu and on the device)."""

import numpy as np
import pytest
import torch

from harts.exec import backend
from harts.exec.backend import FastTreeAttention, Impl, prefer_cudnn_split


def _layout(chains: int, rows_per_chain: int):
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
    return FastTreeAttention(torch.arange(L), torch.as_tensor(end), parent)


def test_cudnn_split_is_preferred_only_for_long_segments():
    assert prefer_cudnn_split(82_000, 8)
    assert prefer_cudnn_split(32_768, 1)
    assert not prefer_cudnn_split(32_768, 39)
    assert not prefer_cudnn_split(0, 0)


def test_the_switch_forces_a_path_and_fp32_takes_flex(monkeypatch):
    att = _layout(3, 5)
    monkeypatch.setenv(backend.TREE_ATTENTION_ENV, "flex")
    assert att.impl(torch.bfloat16) is Impl.FLEX
    monkeypatch.setenv(backend.TREE_ATTENTION_ENV, "cudnn")
    assert att.impl(torch.bfloat16) is Impl.CUDNN
    assert att.impl(torch.float32) is Impl.FLEX  # neither cuDNN nor flash computes fp32 here
    monkeypatch.delenv(backend.TREE_ATTENTION_ENV)
    # off CUDA nothing probes cuDNN: the varlen path (or Flex where torch lacks varlen)
    assert att.impl(torch.bfloat16) in (Impl.VARLEN, Impl.FLEX)
    monkeypatch.setenv(backend.TREE_ATTENTION_ENV, "graph")
    assert att.impl(torch.bfloat16) is Impl.GRAPH


def test_unknown_switch_values_raise(monkeypatch):
    # a typo must not silently run the default path
    att = _layout(2, 3)
    monkeypatch.setenv(backend.TREE_ATTENTION_ENV, "grpah")
    with pytest.raises(ValueError, match="HARTS_TREE_ATTENTION"):
        att.impl(torch.bfloat16)
    monkeypatch.setenv(backend.BASELINE_ATTENTION_ENV, "cudnn-graph")
    with pytest.raises(ValueError, match="HARTS_BASELINE_ATTENTION"):
        backend.baseline_attention()
    monkeypatch.setenv(backend.BASELINE_ATTENTION_ENV, "graph")
    assert backend.expanded_graph_attention()


def test_graph_kernels_are_none_without_cuda():
    # CPU-only machines never build cuDNN graphs; the backend falls back quietly
    if not torch.cuda.is_available():
        assert backend.graph_kernels(192, 128) is None
