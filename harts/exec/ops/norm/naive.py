"""The norms' references, over the last dim, any device and every dtype (float64 included).

- `rms_norm`: x / rms(x) * w; with `float32` (a half-precision x) normalised in float32 and
  cast back before the weight (HF Llama's and Kimi-Linear's RMSNorm).
- `offset_rms_norm`: x / rms(x) * (1 + w) (Qwen3-Next's zero-centred weights); with
  `float32` normalised and scaled in float32, cast back after the weight.
- `l2_norm`: x / sqrt(sum x^2 + eps) (fla's l2norm of KDA's and GDN's queries and keys).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, float32: bool = False) -> Tensor:
    """x / rms(x) * weight over the last dim; `float32`: normalised in float32 and cast
    back before the weight (HF Llama's RMSNorm), else in x's dtype throughout."""
    if float32 and x.dtype.itemsize < 4:  # bf16 / fp16; float32 and float64 as they are
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float, float32: bool = False) -> Tensor:
    """x / rms(x) * (1 + weight) over the last dim (`OffsetRMSNorm`); `float32`: normalised
    and scaled in float32, cast back after the weight."""
    if float32 and x.dtype.itemsize < 4:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def l2_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """fla's l2norm: x / sqrt(sum x^2 + eps), over the last (head) dim."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
