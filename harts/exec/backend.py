"""Implementation selection: the fast GPU paths where they can run, the references otherwise.

One registry per op family, keyed by `Impl`: the reference (`harts.exec.ops`, dense masks;
runs anywhere, every dtype) and the GPU paths (`harts.exec.gpu`: fla-core KDA with our
boundary-state kernel; ancestor attention as one varlen flash call over root-to-row paths
in bf16/fp16, FlexAttention over DFS-interval block masks otherwise or with
`HARTS_TREE_ATTENTION=flex`). A fast path is chosen when the tensors are on CUDA, the
dtype is one it computes (fp32/bf16/fp16, never fp64) and its library imports; `HARTS_FORCE_REFERENCE=1` forces the references everywhere (the
A/B switch for equivalence and speed comparisons). MoE experts: torch's `grouped_mm` over
expert-sorted rows on CUDA bf16, the per-expert loop otherwise. Short conv: the gather-form
reference, or our fused Triton kernels with `HARTS_CONV=triton` (opt-in until timed). Call
sites ask here and never import a GPU module themselves, so CPU-only machines never touch
triton kernels.
"""

from __future__ import annotations

import functools
import os
from enum import StrEnum

import torch
from torch import Tensor

FORCE_ENV = "HARTS_FORCE_REFERENCE"
TREE_ATTENTION_ENV = "HARTS_TREE_ATTENTION"  # "flex" forces FlexAttention over the varlen path
CONV_ENV = "HARTS_CONV"  # "triton": the fused short-conv kernels (not timed on the GPU yet)
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Impl(StrEnum):
    REFERENCE = "reference"
    FLA = "fla"  # fla-core chunk_kda (+ harts' boundary-state kernel for replay handoffs)
    FLEX = "flex"  # FlexAttention with a block mask from DFS intervals
    VARLEN = "varlen"  # ancestor attention as one varlen flash call over root-to-row paths
    GROUPED = "grouped"  # MoE experts as grouped matrix products (torch grouped_mm)
    TRITON = "triton"  # our fused Triton kernel (short conv; opt-in until timed on the GPU)


def force_reference() -> bool:
    return os.environ.get(FORCE_ENV, "").strip() not in ("", "0", "false", "False")


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


def kda_impl(device: torch.device, dtype: torch.dtype) -> Impl:
    if force_reference() or device.type != "cuda" or dtype not in FAST_DTYPES or not fla_available():
        return Impl.REFERENCE
    return Impl.FLA


def tree_attention_impl(device: torch.device) -> Impl:
    if force_reference() or device.type != "cuda" or not flex_available():
        return Impl.REFERENCE
    return Impl.FLEX


@functools.cache
def grouped_mm_available() -> bool:
    import torch.nn.functional as F

    return hasattr(F, "grouped_mm")


def moe_impl(device: torch.device, dtype: torch.dtype) -> Impl:
    """MoE experts: grouped matrix products on CUDA bf16 (what grouped_mm's CUDA kernels
    take), the per-expert loop reference otherwise (any dtype, float64 included)."""
    if force_reference() or device.type != "cuda" or dtype != torch.bfloat16 or not grouped_mm_available():
        return Impl.REFERENCE
    return Impl.GROUPED


def conv_impl(device: torch.device) -> Impl:
    """Short conv: the gather-form reference, or with HARTS_CONV=triton on CUDA the fused
    kernels (`harts.exec.gpu.conv`; opt-in: correct under the interpreter, not yet timed)."""
    if force_reference() or device.type != "cuda" or os.environ.get(CONV_ENV, "").strip() != "triton":
        return Impl.REFERENCE
    return Impl.TRITON


def short_conv(x_TD: Tensor, weight_DW: Tensor, bias_D: Tensor | None, *, window_TW: Tensor,
               activation: str | None = "silu") -> Tensor:
    """`harts.exec.ops.conv.short_conv`'s contract (no carried state), on `conv_impl`'s pick."""
    if conv_impl(x_TD.device) is Impl.TRITON:
        from harts.exec.gpu.conv import short_conv_fused

        return short_conv_fused(x_TD, weight_DW, bias_D, window_TW=window_TW, activation=activation)
    from harts.exec.ops.conv import short_conv as reference

    return reference(x_TD, weight_DW, bias_D, window_TW=window_TW, activation=activation)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, **kwargs):
    """`harts.exec.ops.kda.chunk_kda`'s contract, on the implementation `kda_impl` picks.

    `cu_seqlens_cpu` (optional): a host copy of cu_seqlens, which the fast path's
    bookkeeping reads without a device-to-host sync; the reference ignores it."""
    cu_cpu = kwargs.pop("cu_seqlens_cpu", None)
    if kda_impl(q.device, q.dtype) is Impl.FLA:
        from harts.exec.gpu.kda import chunk_kda_fast

        return chunk_kda_fast(q, k, v, g, beta, cu_seqlens_cpu=cu_cpu, **kwargs)
    from harts.exec.ops.kda import chunk_kda as reference

    return reference(q, k, v, g, beta, **kwargs)


class FastTreeAttention:
    """Ancestor attention for one layout: queries `q_local_C` attend keys by `end_L`.

    bf16/fp16 with torch's varlen flash attention: one causal varlen call over the query
    segments' root-to-row paths (`harts.exec.gpu.path_attention`, every attended pair
    computed once); otherwise (fp32, or no varlen API) compiled FlexAttention over a block
    mask from the DFS intervals. What each needs (segments, block mask) is built on first
    use and reused by every layer (and recomputation)."""

    def __init__(self, q_local_C: Tensor, end_L: Tensor, parent_L=None):
        self.q_local_C = q_local_C
        self.end_L = end_L
        self.parent_L = parent_L
        self._mask = None
        self._segments = None

    def impl(self, dtype: torch.dtype) -> Impl:
        from harts.exec.gpu.path_attention import flash_varlen_available

        if os.environ.get(TREE_ATTENTION_ENV, "").strip() == "flex":
            return Impl.FLEX
        if self.parent_L is not None and dtype in (torch.bfloat16, torch.float16) and flash_varlen_available():
            return Impl.VARLEN
        return Impl.FLEX

    def __call__(self, q_CHD: Tensor, k_LHD: Tensor, v_LHE: Tensor, scale: float) -> Tensor:
        if self.impl(q_CHD.dtype) is Impl.VARLEN:
            from harts.exec.gpu.path_attention import flash_varlen, path_attention, segments_of

            if self._segments is None:
                full = self.q_local_C.numel() == self.end_L.numel()
                seg = segments_of(self.parent_L, None if full else self.q_local_C.cpu().numpy())
                self._segments = (seg, torch.as_tensor(seg.key_rows, device=q_CHD.device))
            seg, key_rows = self._segments
            return path_attention(q_CHD, k_LHD, v_LHE, scale, seg, kernel=flash_varlen, key_rows=key_rows)
        from harts.exec.gpu.attention import tree_attention, tree_block_mask

        if self._mask is None:
            full = self.q_local_C.numel() == self.end_L.numel()
            self._mask = tree_block_mask(self.end_L, None if full else self.q_local_C)
        return tree_attention(q_CHD, k_LHD, v_LHE, scale, self._mask)


def tree_attention(q_local_C: Tensor, end_L: Tensor, device: torch.device,
                   parent_L=None) -> FastTreeAttention | None:
    """The fast ancestor attention for a layout, or None where the dense-mask reference runs.
    parent_L (numpy, local parents) enables the varlen path."""
    if tree_attention_impl(device) is Impl.REFERENCE:
        return None
    return FastTreeAttention(q_local_C, end_L, parent_L)


def causal_attention(q_HLD: Tensor, k_HLD: Tensor, v_HLE: Tensor, scale: float) -> Tensor:
    """Causal SDPA for one packed sequence. On CUDA with a value dim below the qk dim (MLA:
    192 vs 128) the values are zero-padded to the qk dim so the fused flash kernel runs
    instead of the math fallback that materialises [H, L, L] scores; the padding columns
    of the output are exactly zero and dropped."""
    import torch.nn.functional as F

    D, E = q_HLD.shape[-1], v_HLE.shape[-1]
    if q_HLD.is_cuda and not force_reference():
        # fused kernels need 4-D [B, H, L, D] inputs (3-D ones fall back to math)
        v_pad = F.pad(v_HLE, (0, D - E)) if E < D else v_HLE
        o = F.scaled_dot_product_attention(q_HLD[None], k_HLD[None], v_pad[None], is_causal=True, scale=scale)
        return o[0, ..., :E]
    return F.scaled_dot_product_attention(q_HLD, k_HLD, v_HLE, is_causal=True, scale=scale)
