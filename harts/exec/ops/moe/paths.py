"""The routed experts' registry: grouped matrix products (`grouped.py`) on CUDA in bf16,
what grouped_mm's CUDA kernels take, where torch has `F.grouped_mm`; the per-expert loop
(`naive.py`) otherwise (any dtype, float64 included).

Calling convention of the reference and every fast path: `experts_loop`'s, (x_TD,
top_i_Tk, top_w_Tk, w_gate_EFD, w_up_EFD, w_down_EDF).
"""

from __future__ import annotations

import functools

import torch

from harts.config.kernels import Impl
from harts.exec.ops.moe.naive import experts_loop
from harts.exec.ops.registry import FastPath, OpRegistry


@functools.cache
def grouped_mm_available() -> bool:
    import torch.nn.functional as F

    return hasattr(F, "grouped_mm")


def run_grouped(x_TD, top_i_Tk, top_w_Tk, w_gate_EFD, w_up_EFD, w_down_EDF, kernels=None):
    from harts.exec.ops.moe.grouped import experts_grouped

    return experts_grouped(x_TD, top_i_Tk, top_w_Tk, w_gate_EFD, w_up_EFD, w_down_EDF, kernels=kernels)


def run_loop(x_TD, top_i_Tk, top_w_Tk, w_gate_EFD, w_up_EFD, w_down_EDF, kernels=None):
    """The reference loop (`kernels` has no setting it reads)."""
    return experts_loop(x_TD, top_i_Tk, top_w_Tk, w_gate_EFD, w_up_EFD, w_down_EDF)


MOE = OpRegistry("moe", run_loop)
MOE.register(FastPath(Impl.GROUPED, run_grouped, dtypes=(torch.bfloat16,), installed=grouped_mm_available))
