"""KDA's registry: fla-core's chunk kernels with the boundary-state kernel (`fla.py`) on
CUDA in fp32/bf16/fp16 where fla and triton import; the chunkwise reference (`chunk.py`)
otherwise.

Calling convention of the reference and every fast path: `harts.exec.ops.kda.chunk_kda`'s,
plus the keywords `kernels`, `record` and `cu_seqlens_cpu` (a host copy of cu_seqlens,
which the fast path's bookkeeping reads without a device-to-host sync).
"""

from __future__ import annotations

import functools

import torch

from harts.config.kernels import Impl
from harts.exec.ops.kda.chunk import chunk_kda
from harts.exec.ops.registry import FastPath, OpRegistry

FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def fla_available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def run_reference(q, k, v, g, beta, *, kernels, record, cu_seqlens_cpu=None, **kwargs):
    return chunk_kda(q, k, v, g, beta, **kwargs)


def run_fla(q, k, v, g, beta, *, kernels, record, cu_seqlens_cpu=None, **kwargs):
    from harts.exec.ops.kda.fla import chunk_kda_fast

    return chunk_kda_fast(q, k, v, g, beta, cu_seqlens_cpu=cu_seqlens_cpu, kernels=kernels, record=record, **kwargs)


KDA = OpRegistry("kda", run_reference)
KDA.register(FastPath(Impl.FLA, run_fla, dtypes=FAST_DTYPES, installed=fla_available))
