"""Implementation selection through the op registries picks what the if/else it replaced
picked, in every situation of a table: device (cpu / cuda), dtype, `KernelConfig`
settings and which fast paths' libraries import.

`_old_*` are that if/else, kept verbatim as the specification."""

from __future__ import annotations

import itertools

import pytest
import torch

from harts.config.kernels import ConvKernel, Impl, KernelConfig
from harts.exec import backend

FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

DEVICES = (torch.device("cpu"), torch.device("cuda"))
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
CONFIGS = (
    KernelConfig(),
    KernelConfig(force_reference=True),
    KernelConfig(conv="reference"),
    KernelConfig(conv="triton"),
    KernelConfig(conv="triton", force_reference=True),
    KernelConfig(tree_attention="cudnn"),
    KernelConfig(tree_attention="flex", baseline_attention="flash"),
    KernelConfig(tree_attention="graph", conv="reference", force_reference=True),
    KernelConfig(norm="reference"),
)
AVAILABLE = tuple(itertools.product((True, False), repeat=3))  # (fla, flex, grouped_mm)


def _old_kda(device, dtype, kernels, fla):
    if kernels.force_reference or device.type != "cuda" or dtype not in FAST_DTYPES or not fla:
        return Impl.REFERENCE
    return Impl.FLA


def _old_tree_attention(device, kernels, flex):
    if kernels.force_reference or device.type != "cuda" or not flex:
        return Impl.REFERENCE
    return Impl.FLEX


def _old_moe(device, dtype, kernels, grouped_mm):
    if kernels.force_reference or device.type != "cuda" or dtype != torch.bfloat16 or not grouped_mm:
        return Impl.REFERENCE
    return Impl.GROUPED


def _norm(device, dtype, kernels):
    """The norms (added with the registry, no older branch): torch's fused RMSNorm on CUDA
    in bf16/fp16/fp32 unless norm=reference or force_reference."""
    if kernels.force_reference or device.type != "cuda" or dtype not in FAST_DTYPES or kernels.norm == "reference":
        return Impl.REFERENCE
    return Impl.FUSED


def _old_conv(device, kernels):
    if kernels.force_reference or device.type != "cuda" or kernels.conv is ConvKernel.REFERENCE:
        return Impl.REFERENCE
    return Impl.TRITON


@pytest.mark.parametrize("fla, flex, grouped_mm", AVAILABLE)
def test_every_situation_selects_what_the_old_branches_selected(libraries, fla, flex, grouped_mm):
    libraries.set(fla=fla, flex=flex, grouped_mm=grouped_mm)
    assert (backend.fla_available(), backend.flex_available(), backend.grouped_mm_available()) == (
        fla, flex, grouped_mm)
    rows = 0
    for device, dtype, kernels in itertools.product(DEVICES, DTYPES, CONFIGS):
        situation = (device.type, dtype, kernels)
        assert backend.kda_impl(device, dtype, kernels) is _old_kda(device, dtype, kernels, fla), situation
        assert backend.moe_impl(device, dtype, kernels) is _old_moe(device, dtype, kernels, grouped_mm), situation
        assert backend.tree_attention_impl(device, kernels) is _old_tree_attention(device, kernels, flex), situation
        assert backend.conv_impl(device, kernels) is _old_conv(device, kernels), situation
        assert backend.conv_impl(device, kernels, dtype) is _old_conv(device, kernels), situation
        assert backend.norm_impl(device, dtype, kernels) is _norm(device, dtype, kernels), situation
        rows += 1
    assert rows == len(DEVICES) * len(DTYPES) * len(CONFIGS)


def test_the_table_reaches_every_fast_path(libraries):
    libraries.set(fla=True, flex=True, grouped_mm=True)
    cuda = torch.device("cuda")
    assert backend.kda_impl(cuda, torch.bfloat16) is Impl.FLA
    assert backend.moe_impl(cuda, torch.bfloat16) is Impl.GROUPED
    assert backend.tree_attention_impl(cuda) is Impl.FLEX
    assert backend.conv_impl(cuda) is Impl.TRITON


def test_defaults_are_the_default_config(libraries):
    libraries.set(fla=True, flex=True, grouped_mm=True)
    for device, dtype in itertools.product(DEVICES, DTYPES):
        assert backend.kda_impl(device, dtype) is backend.kda_impl(device, dtype, KernelConfig())
        assert backend.moe_impl(device, dtype) is backend.moe_impl(device, dtype, KernelConfig())
        assert backend.tree_attention_impl(device) is backend.tree_attention_impl(device, KernelConfig())
        assert backend.conv_impl(device) is backend.conv_impl(device, KernelConfig())
