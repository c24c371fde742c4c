"""Implementation selection: the fast GPU paths where they can run, the references otherwise.

Every choice follows the caller's `KernelConfig` (`harts.config.kernels`), which a
trainer builds once and hands to the contexts its microbatches run on; nothing here reads
the environment or process-wide switches. Each op family lives in `harts.exec.ops.<op>`
with its reference beside its fast paths, and declares them in its registry
(`harts.exec.ops.registry`: each fast path with the devices, dtypes, settings and package
it needs, and a priority), in `harts.exec.ops.<op>.paths`:

- KDA (`KDA`): fla-core's kernels with our boundary-state kernel (`ops.kda.fla`) on CUDA in
  fp32/bf16/fp16 where fla imports, the chunkwise reference (`ops.kda.chunk`) otherwise.
- ancestor attention (`TREE_ATTENTION`): `ops.attention.tree.FastTreeAttention` on CUDA
  where FlexAttention imports (graph, cuDNN per segment, varlen or flex by
  `tree_attention`), the dense-mask reference (`ops.attention.naive`) otherwise.
- MoE experts (`MOE`): torch's `grouped_mm` over expert-sorted rows on CUDA bf16
  (`ops.moe.grouped`), the per-expert loop (`ops.moe.naive`) otherwise.
- norms (`RMS_NORM`, `L2_NORM`): torch's fused RMSNorm kernel on CUDA in bf16/fp16/fp32
  (`ops.norm.fused`), the elementwise references (`ops.norm.naive`) otherwise.
- short conv (`CONV`): the fused Triton kernels (`ops.conv.triton`) on CUDA, the
  gather-form reference elsewhere or with conv=reference.
- the baseline's causal attention: `ops.attention.causal` (`baseline_attention`).

`force_reference` runs the references everywhere. A path that cannot run a call falls
back and says so per call (`ops.record`). Call sites ask here and never import a GPU
module themselves, so CPU-only machines never touch triton kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harts.config.kernels import ConvKernel, Impl, KernelConfig, TreeAttention
from harts.exec.ops.attention.paths import TREE_ATTENTION, flex_available
from harts.exec.ops.conv.paths import CONV
from harts.exec.ops.kda.paths import FAST_DTYPES, KDA, fla_available
from harts.exec.ops.moe.paths import MOE, grouped_mm_available
from harts.exec.ops.norm.paths import L2_NORM, RMS_NORM
from harts.exec.ops.record import KernelRecord, report, report_fallback

__all__ = ["CONV", "FAST_DTYPES", "KDA", "L2_NORM", "MOE", "RMS_NORM", "TREE_ATTENTION", "Impl", "KernelConfig",
           "KernelRecord", "chunk_kda", "conv_impl", "experts", "fla_available", "flex_available",
           "grouped_mm_available", "kda_impl", "l2_norm", "moe_impl", "norm_impl", "rms_norm", "short_conv",
           "tree_attention", "tree_attention_impl"]

DEFAULT_KERNELS = KernelConfig()


def kda_impl(device: torch.device, dtype: torch.dtype, kernels: KernelConfig = DEFAULT_KERNELS) -> Impl:
    return KDA.select(device, dtype, kernels)


def tree_attention_impl(device: torch.device, kernels: KernelConfig = DEFAULT_KERNELS) -> Impl:
    """FLEX (standing for the fast paths, `FastTreeAttention` picks among them) on CUDA
    where FlexAttention imports, else the dense-mask REFERENCE."""
    return TREE_ATTENTION.select(device, None, kernels)


def moe_impl(device: torch.device, dtype: torch.dtype, kernels: KernelConfig = DEFAULT_KERNELS) -> Impl:
    """MoE experts: grouped matrix products on CUDA bf16 (what grouped_mm's CUDA kernels
    take), the per-expert loop reference otherwise (any dtype, float64 included)."""
    return MOE.select(device, dtype, kernels)


def conv_impl(device: torch.device, kernels: KernelConfig = DEFAULT_KERNELS, dtype: torch.dtype | None = None) -> Impl:
    """Short conv: on CUDA the fused Triton kernels, elsewhere or with conv=reference the
    gather-form reference (`dtype`: the call's, for paths that take only some)."""
    return CONV.select(device, dtype, kernels)


def short_conv(x_TD: Tensor, weight_DW: Tensor, bias_D: Tensor | None, *, window_TW: Tensor,
               activation: str | None = "silu", kernels: KernelConfig = DEFAULT_KERNELS,
               record: KernelRecord | None = None) -> Tensor:
    """`harts.exec.ops.conv.short_conv`'s contract (no carried state), on `conv_impl`'s pick."""
    impl = conv_impl(x_TD.device, kernels, x_TD.dtype)
    if kernels.conv is ConvKernel.TRITON and impl is not Impl.TRITON and not kernels.force_reference:
        report_fallback(record, "conv", ConvKernel.TRITON, impl, f"the fused kernels need CUDA, not {x_TD.device.type}")
    else:
        report(record, "conv", impl)
    return CONV.run(impl)(x_TD, weight_DW, bias_D, window_TW=window_TW, activation=activation, kernels=kernels)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, kernels: KernelConfig = DEFAULT_KERNELS,
              record: KernelRecord | None = None, **kwargs):
    """`harts.exec.ops.kda.chunk_kda`'s contract, on the implementation `kda_impl` picks.

    `cu_seqlens_cpu` (optional): a host copy of cu_seqlens, which the fast path's
    bookkeeping reads without a device-to-host sync; the reference ignores it."""
    cu_cpu = kwargs.pop("cu_seqlens_cpu", None)
    impl = kda_impl(q.device, q.dtype, kernels)
    report(record, "kda", impl)
    return KDA.run(impl)(q, k, v, g, beta, kernels=kernels, record=record, cu_seqlens_cpu=cu_cpu, **kwargs)


def tree_attention(q_local_C: Tensor, end_L: Tensor, device: torch.device, parent_L=None, q_local_host=None, *,
                   kernels: KernelConfig = DEFAULT_KERNELS, record: KernelRecord | None = None):
    """The fast ancestor attention for a layout (`FastTreeAttention`), or None where the
    dense-mask reference runs. parent_L (numpy, local parents) enables the varlen, cuDNN
    and graph paths; q_local_host (numpy, q_local_C's values) spares a device-to-host read
    when a layout's queries are not all its rows."""
    impl = tree_attention_impl(device, kernels)
    return TREE_ATTENTION.run(impl)(q_local_C, end_L, parent_L, q_local_host, kernels=kernels, record=record)


def experts(x_TD: Tensor, top_i_Tk: Tensor, top_w_Tk: Tensor, w_gate_EFD: Tensor, w_up_EFD: Tensor,
            w_down_EDF: Tensor, *, kernels: KernelConfig = DEFAULT_KERNELS,
            record: KernelRecord | None = None) -> Tensor:
    """`harts.exec.ops.moe.experts_loop`'s contract, on the implementation `moe_impl` picks."""
    impl = moe_impl(x_TD.device, x_TD.dtype, kernels)
    report(record, "moe", impl)
    return MOE.run(impl)(x_TD, top_i_Tk, top_w_Tk, w_gate_EFD, w_up_EFD, w_down_EDF, kernels=kernels)


def norm_impl(device: torch.device, dtype: torch.dtype, kernels: KernelConfig = DEFAULT_KERNELS) -> Impl:
    """RMSNorm and L2 norm: torch's fused kernel on CUDA in bf16/fp16/fp32 unless
    norm=reference, the references otherwise."""
    return RMS_NORM.select(device, dtype, kernels)


def rms_norm(x: Tensor, weight: Tensor, eps: float, float32: bool = False, *,
             kernels: KernelConfig = DEFAULT_KERNELS, record: KernelRecord | None = None) -> Tensor:
    """`harts.exec.ops.norm.rms_norm`'s contract, on `norm_impl`'s pick."""
    impl = RMS_NORM.select(x.device, x.dtype, kernels)
    report(record, "rms_norm", impl)
    return RMS_NORM.run(impl)(x, weight, eps, float32)


def l2_norm(x: Tensor, eps: float = 1e-6, *, kernels: KernelConfig = DEFAULT_KERNELS,
            record: KernelRecord | None = None) -> Tensor:
    """`harts.exec.ops.norm.l2_norm`'s contract, on `norm_impl`'s pick."""
    impl = L2_NORM.select(x.device, x.dtype, kernels)
    report(record, "l2_norm", impl)
    return L2_NORM.run(impl)(x, eps)


def reference_attention_reason(device: torch.device, kernels: KernelConfig) -> str | None:
    """Why a tree layout on `device` runs the dense-mask reference although `kernels`
    asks for a fast path (None: it asked for none, or force_reference)."""
    if kernels.force_reference or kernels.tree_attention is TreeAttention.AUTO:
        return None
    if device.type != "cuda":
        return f"the fast paths need CUDA, not {device.type}"
    return "FlexAttention does not import"
