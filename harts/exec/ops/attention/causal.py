"""The expanded baseline's causal attention per packed sequence, on the path its
`KernelConfig.baseline_attention` names.

- cudnn (default): torch's cuDNN SDPA, which takes MLA's 192 / 128 head dims as they are
  (on the H200 at 32k x 16 heads: 39 ms forward+backward, against 61 ms with the values
  zero-padded for the flash kernel); where cuDNN refuses a shape, the flash path below.
- flash: the values zero-padded to the qk dim so the flash kernel runs instead of the math
  fallback that materialises [H, L, L] scores; the padding columns of the output are
  exactly zero and dropped.
- graph: one cuDNN graph call over a microbatch's sequences (`packed_causal_attention`),
  the kernel the tree's graph path runs forward, so each row gets the same bits in both
  modes (the bit-exact fidelity comparison).

Fused kernels need 4-D [B, H, L, D] inputs (3-D ones fall back to math).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from harts.config.kernels import BaselineAttention, Impl, KernelConfig
from harts.exec.ops.attention import naive
from harts.exec.ops.record import KernelRecord, report, report_fallback

DEFAULT_KERNELS = KernelConfig()
OP = "baseline_attention"


def causal_attention(q_HLD: Tensor, k_HLD: Tensor, v_HLE: Tensor, scale: float,
                     kernels: KernelConfig = DEFAULT_KERNELS, record: KernelRecord | None = None) -> Tensor:
    """Causal SDPA for one packed sequence on `kernels.baseline_attention`'s path (CUDA
    bf16/fp16; flash also fp32), torch's plain SDPA elsewhere and under force_reference."""
    D, E = q_HLD.shape[-1], v_HLE.shape[-1]
    if not q_HLD.is_cuda or kernels.force_reference:
        report(record, OP, Impl.REFERENCE)
        return naive.causal_attention(q_HLD, k_HLD, v_HLE, scale)
    choice = kernels.baseline_attention
    if q_HLD.dtype in (torch.bfloat16, torch.float16) and choice is not BaselineAttention.FLASH:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q_HLD[None], k_HLD[None], v_HLE[None], is_causal=True,
                                                   scale=scale)[0]
            report(record, OP, Impl.SDPA)
            return o
        except RuntimeError:  # no cuDNN kernel for this shape: the padded flash path below
            report_fallback(record, OP, choice, Impl.FLASH, "cuDNN SDPA has no kernel for this shape")
    else:
        report(record, OP, Impl.FLASH)
    v_pad = F.pad(v_HLE, (0, D - E)) if E < D else v_HLE
    o = F.scaled_dot_product_attention(q_HLD[None], k_HLD[None], v_pad[None], is_causal=True, scale=scale)
    return o[0, ..., :E]


def packed_causal_attention(q_THD: Tensor, k_THD: Tensor, v_THE: Tensor, cu_seqlens: list[int],
                            scale: float) -> Tensor:
    """Causal attention over packed sequences as one cuDNN graph call (baseline_attention
    graph): the kernel the tree's graph path runs forward, so a row's output has the same
    bits in both modes. Its backward runs without the deterministic flag (long sequences;
    see `KernelConfig.graph_backward_max_rows`). Raises where the graph kernel is unavailable."""
    from harts.exec.ops.attention import cudnn_graph
    from harts.exec.ops.attention.split import cudnn_kernel

    if not (q_THD.is_cuda and cudnn_graph.available()):
        raise RuntimeError("baseline_attention=graph needs CUDA and nvidia-cudnn-frontend")
    cu = np.asarray(cu_seqlens, np.int64)
    kern = cudnn_kernel(q_THD.shape[-1], v_THE.shape[-1], "graph-nondet")
    n = int(np.diff(cu).max())
    return cudnn_graph.varlen_fn(kern)(q_THD, k_THD, v_THE, cu, cu, n, n, scale)
