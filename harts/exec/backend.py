"""Implementation selection: the fast GPU paths where they can run, the references otherwise.

Every choice follows the caller's `KernelConfig` (`harts.config.kernels`), which a
trainer builds once and hands to the contexts its microbatches run on; nothing here reads
the environment or process-wide switches. Each op family lives in `harts.exec.ops.<op>`
with its reference beside its fast paths:

- KDA: fla-core's kernels with our boundary-state kernel (`ops.kda.fla`) on CUDA in
  fp32/bf16/fp16 where fla imports, the chunkwise reference (`ops.kda.chunk`) otherwise.
- ancestor attention: `ops.attention.tree.FastTreeAttention` on CUDA where FlexAttention
  imports (graph, cuDNN per segment, varlen or flex by `tree_attention`), the dense-mask
  reference (`ops.attention.naive`) otherwise.
- the baseline's causal attention: `ops.attention.causal` (`baseline_attention`).
- MoE experts: torch's `grouped_mm` over expert-sorted rows on CUDA bf16, the per-expert
  loop otherwise.
- short conv: the fused Triton kernels (`ops.conv.triton`) on CUDA, the gather-form
  reference elsewhere or with conv=reference.

`force_reference` runs the references everywhere. A path that cannot run a call falls
back and says so per call (`ops.record`). Call sites ask here and never import a GPU
module themselves, so CPU-only machines never touch triton kernels.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from harts.config.kernels import ConvKernel, Impl, KernelConfig, TreeAttention
from harts.exec.ops.record import KernelRecord, report, report_fallback

__all__ = ["FAST_DTYPES", "Impl", "KernelConfig", "KernelRecord", "chunk_kda", "conv_impl", "fla_available",
           "flex_available", "grouped_mm_available", "kda_impl", "moe_impl", "short_conv", "tree_attention",
           "tree_attention_impl"]

FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_KERNELS = KernelConfig()


@functools.cache
def fla_available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


@functools.cache
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@functools.cache
def grouped_mm_available() -> bool:
    import torch.nn.functional as F

    return hasattr(F, "grouped_mm")


def kda_impl(device: torch.device, dtype: torch.dtype, kernels: KernelConfig = DEFAULT_KERNELS) -> Impl:
    if kernels.force_reference or device.type != "cuda" or dtype not in FAST_DTYPES or not fla_available():
        return Impl.REFERENCE
    return Impl.FLA


def tree_attention_impl(device: torch.device, kernels: KernelConfig = DEFAULT_KERNELS) -> Impl:
    """FLEX (standing for the fast paths, `FastTreeAttention` picks among them) on CUDA
    where FlexAttention imports, else the dense-mask REFERENCE."""
    if kernels.force_reference or device.type != "cuda" or not flex_available():
        return Impl.REFERENCE
    return Impl.FLEX


def moe_impl(device: torch.device, dtype: torch.dtype, kernels: KernelConfig = DEFAULT_KERNELS) -> Impl:
    """MoE experts: grouped matrix products on CUDA bf16 (what grouped_mm's CUDA kernels
    take), the per-expert loop reference otherwise (any dtype, float64 included)."""
    if kernels.force_reference or device.type != "cuda" or dtype != torch.bfloat16 or not grouped_mm_available():
        return Impl.REFERENCE
    return Impl.GROUPED


def conv_impl(device: torch.device, kernels: KernelConfig = DEFAULT_KERNELS) -> Impl:
    """Short conv: on CUDA the fused Triton kernels (`harts.exec.ops.conv.triton`; on the
    H200 at 82k rows x 2048 channels 0.32 vs 3.4 ms forward, 6.7 vs 11.2 ms
    forward+backward), elsewhere or with conv=reference the gather-form reference."""
    if kernels.force_reference or device.type != "cuda" or kernels.conv is ConvKernel.REFERENCE:
        return Impl.REFERENCE
    return Impl.TRITON


def short_conv(x_TD: Tensor, weight_DW: Tensor, bias_D: Tensor | None, *, window_TW: Tensor,
               activation: str | None = "silu", kernels: KernelConfig = DEFAULT_KERNELS,
               record: KernelRecord | None = None) -> Tensor:
    """`harts.exec.ops.conv.short_conv`'s contract (no carried state), on `conv_impl`'s pick."""
    impl = conv_impl(x_TD.device, kernels)
    if kernels.conv is ConvKernel.TRITON and impl is not Impl.TRITON and not kernels.force_reference:
        report_fallback(record, "conv", ConvKernel.TRITON, impl, f"the fused kernels need CUDA, not {x_TD.device.type}")
    else:
        report(record, "conv", impl)
    if impl is Impl.TRITON:
        from harts.exec.ops.conv.triton import short_conv_fused

        return short_conv_fused(x_TD, weight_DW, bias_D, window_TW=window_TW, activation=activation,
                                bwd_tiles=kernels.conv_bwd_tiles)
    from harts.exec.ops.conv import short_conv as reference

    return reference(x_TD, weight_DW, bias_D, window_TW=window_TW, activation=activation)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, kernels: KernelConfig = DEFAULT_KERNELS,
              record: KernelRecord | None = None, **kwargs):
    """`harts.exec.ops.kda.chunk_kda`'s contract, on the implementation `kda_impl` picks.

    `cu_seqlens_cpu` (optional): a host copy of cu_seqlens, which the fast path's
    bookkeeping reads without a device-to-host sync; the reference ignores it."""
    cu_cpu = kwargs.pop("cu_seqlens_cpu", None)
    impl = kda_impl(q.device, q.dtype, kernels)
    report(record, "kda", impl)
    if impl is Impl.FLA:
        from harts.exec.ops.kda.fla import chunk_kda_fast

        return chunk_kda_fast(q, k, v, g, beta, cu_seqlens_cpu=cu_cpu, kernels=kernels, record=record, **kwargs)
    from harts.exec.ops.kda import chunk_kda as reference

    return reference(q, k, v, g, beta, **kwargs)


def tree_attention(q_local_C: Tensor, end_L: Tensor, device: torch.device, parent_L=None, q_local_host=None, *,
                   kernels: KernelConfig = DEFAULT_KERNELS, record: KernelRecord | None = None):
    """The fast ancestor attention for a layout (`FastTreeAttention`), or None where the
    dense-mask reference runs. parent_L (numpy, local parents) enables the varlen, cuDNN
    and graph paths; q_local_host (numpy, q_local_C's values) spares a device-to-host read
    when a layout's queries are not all its rows."""
    if tree_attention_impl(device, kernels) is Impl.REFERENCE:
        return None
    from harts.exec.ops.attention.tree import FastTreeAttention

    return FastTreeAttention(q_local_C, end_L, parent_L, q_local_host, kernels=kernels, record=record)


def reference_attention_reason(device: torch.device, kernels: KernelConfig) -> str | None:
    """Why a tree layout on `device` runs the dense-mask reference although `kernels`
    asks for a fast path (None: it asked for none, or force_reference)."""
    if kernels.force_reference or kernels.tree_attention is TreeAttention.AUTO:
        return None
    if device.type != "cuda":
        return f"the fast paths need CUDA, not {device.type}"
    return "FlexAttention does not import"
