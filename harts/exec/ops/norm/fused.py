"""The norms on torch's fused RMSNorm (`F.rms_norm`: on CUDA one kernel forward and a fused
backward, where the reference issues one kernel per elementwise op: 8 forward and about a
dozen backward for a float32-inside bf16 RMSNorm). The same functions as `naive`'s; the
rounding differs in half precision only: the kernel normalises and scales in float32 and
rounds once, where the reference (HF's order) rounds the normalised value and then its
product with the weight.

- `rms_norm_fused`: `naive.rms_norm` (either `float32` setting: the kernel computes in
  float32 for half-precision inputs).
- `l2_norm_fused`: x / sqrt(sum x^2 + eps) = rms_norm(x, eps / K) / sqrt(K) over K channels.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor


def rms_norm_fused(x: Tensor, weight: Tensor, eps: float, float32: bool = False) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


def l2_norm_fused(x: Tensor, eps: float = 1e-6) -> Tensor:
    K = x.shape[-1]
    return F.rms_norm(x, (K,), None, eps / K) * (1.0 / math.sqrt(K))
