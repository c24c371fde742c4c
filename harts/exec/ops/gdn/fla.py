"""Gated DeltaNet on the GPU: fla-core's `chunk_gated_delta_rule`, in this family's packed
contract (`harts.exec.ops.gdn.chunk_gdn`: [T, H, *] tensors, cu_seqlens, initial_state,
`GDNOutput`). fla is imported inside the function, so CPU-only machines never load triton.

fla takes a batch of one for varlen input ([1, T, H, *]), its decay g [1, T, H] in log
space, and returns (o, final_state); its backward returns the initial state's gradient and
consumes the final state's. Chunk sizes are fla's (16, 32 or 64).
"""

from __future__ import annotations

import torch

from harts.exec.ops.gdn.chunk import GDNOutput
from harts.exec.ops.gdn.common import check_inputs


def chunk_gdn_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    output_final_state: bool = True,
) -> GDNOutput:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if not q.is_cuda:
        raise ValueError(f"fla's chunk_gated_delta_rule runs on CUDA, not {q.device.type}")
    # checks only (fla computes in the input dtype with fp32 accumulation)
    _, _, _, _, _, S0, cu, scale = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    o, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None].float(), beta[None], scale=scale,
        initial_state=S0.float() if initial_state is not None else None,
        output_final_state=output_final_state, cu_seqlens=cu, chunk_size=chunk_size,
    )
    return GDNOutput(o[0].to(v.dtype), final if output_final_state else None)
