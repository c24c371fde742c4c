"""The norms' registries: torch's fused RMSNorm (`fused.py`) on CUDA in bf16, fp16 and
fp32 unless the config asks for the reference (`norm=reference`); the references
(`naive.py`) otherwise, float64 included. The zero-centred norm (`offset_rms_norm`) has
no fast path: its (1 + w) rounded to a half-precision weight would move w's low bits.

Calling convention: `naive.rms_norm`'s (x, weight, eps, float32) and `naive.l2_norm`'s
(x, eps).
"""

from __future__ import annotations

import torch

from harts.config.kernels import Impl, NormKernel
from harts.exec.ops.norm.fused import l2_norm_fused, rms_norm_fused
from harts.exec.ops.norm.naive import l2_norm, rms_norm
from harts.exec.ops.registry import FastPath, OpRegistry

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _allowed(kernels) -> bool:
    return kernels.norm is not NormKernel.REFERENCE


RMS_NORM = OpRegistry("rms_norm", rms_norm)
RMS_NORM.register(FastPath(Impl.FUSED, rms_norm_fused, dtypes=_DTYPES, allowed=_allowed))
L2_NORM = OpRegistry("l2_norm", l2_norm)
L2_NORM.register(FastPath(Impl.FUSED, l2_norm_fused, dtypes=_DTYPES, allowed=_allowed))
