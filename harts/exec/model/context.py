"""Sequence mixing behind one interface, so one model serves packed sequences and trees.

Shapes: T rows, H heads, D/K/E/V feature dims, W conv window, N packed sequences.

The model runs every token-wise part (embeddings, projections, norms, FFN, MoE, LM head)
once per row; the only places where rows see each other are the three methods of a
`MixingContext`: full attention, the short convolution, and the KDA recurrence. A
`PackedContext` mixes within each of N packed, independent sequences (the trajectory-
expanded baseline); the tree executor supplies a context that mixes along each row's path
through a rollout tree. `layer` and `name` identify the call so a context may keep
per-layer state (the packed one ignores them). Under activation recomputation a layer's
context calls run a second time during backward with the same arguments, so a context
must give the same answer when called again. A context may also define `kda_mixing` (see
`harts.exec.model.kda.kda_mixing`) to run a KDA layer's convs, gate and recurrence as one
unit, with the same result as the three methods (the tree context does, to avoid
gathering wide inputs into its KDA rounds' order).

Which kernels a context's calls run is its `kernels` (a `KernelConfig`, by default built
from the environment once, when the context is built); what they ran goes to its
`kernel_record` (a `KernelRecord`, shared with the trainer that built the context).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from harts.config.kernels import BaselineAttention, Impl, KernelConfig
from harts.exec.ops.record import KernelRecord, report, report_fallback
from harts.exec.transfer import to_device


@runtime_checkable
class MixingContext(Protocol):
    num_rows: int
    # [T] float: occurrence count of each row (ones for packed sequences); MoE routing
    # statistics (f_i, P_i, expert loads) weight rows by it.
    row_weight: Tensor
    # [T] int64: depth of each row in its sequence (the RoPE position when enabled).
    position_ids: Tensor
    # Optional attribute read with getattr(ctx, "allows_token_dropping", False): only a
    # context whose rows are plain tokens (packed) may let MoE drop over-capacity tokens.
    # Optional attribute read with getattr(ctx, "recompute", True) (`run_blocks`): False
    # runs the blocks without activation checkpointing even where the model recomputes.

    def attention(self, layer: int, q_THD: Tensor, k_THD: Tensor, v_THE: Tensor, scale: float) -> Tensor:
        """o_THE: each row attends the rows before it on its own path (and itself)."""
        ...

    def short_conv(self, layer: int, name: str, x_TD: Tensor, weight_DW: Tensor, bias_D: Tensor | None) -> Tensor:
        """SiLU(causal depthwise conv) along each row's path."""
        ...

    def kda(self, layer: int, q_THK: Tensor, k_THK: Tensor, v_THV: Tensor, g_THK: Tensor, beta_TH: Tensor, scale: float) -> Tensor:
        """o_THV of the KDA recurrence along each row's path."""
        ...


class PackedContext:
    """Independent sequences packed back to back: rows [cu[n], cu[n+1]) form sequence n.

    Attention runs per sequence (causal SDPA on its own slice), so no row can see another
    sequence and a packed sequence computes exactly what it computes alone. The conv uses
    windows that stop at sequence starts; KDA runs chunkwise with chunks restarting at
    each sequence start (`cu_seqlens`).
    """

    allows_token_dropping = True

    def __init__(self, cu_seqlens: Tensor, row_weight: Tensor | None = None, *, chunk_size: int = 64,
                 kernels: KernelConfig | None = None, kernel_record: KernelRecord | None = None):
        self.kernels = kernels if kernels is not None else KernelConfig.from_env()
        self.kernel_record = kernel_record if kernel_record is not None else KernelRecord()
        cu = torch.as_tensor(cu_seqlens).to(torch.int64).cpu()
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must rise strictly from 0; got {cu.tolist()}")
        self.cu_seqlens = cu
        self.num_rows = int(cu[-1])
        self.chunk_size = chunk_size
        lengths = cu[1:] - cu[:-1]
        starts = torch.repeat_interleave(cu[:-1], lengths)
        self.position_ids = torch.arange(self.num_rows, dtype=torch.int64) - starts
        if row_weight is None:
            row_weight = torch.ones(self.num_rows, dtype=torch.float64)
        if row_weight.shape != (self.num_rows,):
            raise ValueError(f"row_weight must be [T={self.num_rows}]; got {tuple(row_weight.shape)}")
        self.row_weight = row_weight
        self._bounds = [int(b) for b in cu]
        self._cu_cpu = torch.tensor(self._bounds, dtype=torch.int64)  # host copy: no sync per KDA call
        self._windows: dict[int, Tensor] = {}
        self._cu_dev: dict[torch.device, Tensor] = {}

    def to(self, device: torch.device | str) -> PackedContext:
        self.position_ids = to_device(self.position_ids, device)
        self.row_weight = to_device(self.row_weight, device)
        self._windows = {w: to_device(t, device) for w, t in self._windows.items()}
        return self

    def _cu_on(self, device: torch.device) -> Tensor:
        """cu_seqlens on `device`, copied once (the same tensor object every layer, so fla's
        identity cache of its chunk indices hits after the first KDA layer)."""
        cached = self._cu_dev.get(device)
        if cached is None:
            cached = self._cu_dev[device] = to_device(self.cu_seqlens, device)
        return cached

    def attention(self, layer: int, q_THD: Tensor, k_THD: Tensor, v_THE: Tensor, scale: float) -> Tensor:
        from harts.exec.ops.attention.causal import OP, causal_attention, packed_causal_attention

        kernels = self.kernels
        if kernels.baseline_attention is BaselineAttention.GRAPH and not kernels.force_reference:
            if q_THD.is_cuda and q_THD.dtype in (torch.bfloat16, torch.float16):
                report(self.kernel_record, OP, Impl.GRAPH)
                return packed_causal_attention(q_THD, k_THD, v_THE, self._bounds, scale)
            report_fallback(self.kernel_record, OP, BaselineAttention.GRAPH, "per-sequence attention",
                            f"the graph kernel runs bf16/fp16 on CUDA, not {q_THD.dtype} on {q_THD.device.type}")
        outs = []
        for start, end in zip(self._bounds[:-1], self._bounds[1:], strict=True):
            q, k, v = (x[start:end].transpose(0, 1) for x in (q_THD, k_THD, v_THE))
            o_HLE = causal_attention(q, k, v, scale, kernels, self.kernel_record)
            outs.append(o_HLE.transpose(0, 1))
        return torch.cat(outs, dim=0)

    def short_conv(self, layer: int, name: str, x_TD: Tensor, weight_DW: Tensor, bias_D: Tensor | None) -> Tensor:
        from harts.exec.backend import short_conv
        from harts.exec.ops.conv import window_from_cu_seqlens

        W = weight_DW.shape[1]
        window_TW = self._windows.get(W)
        if window_TW is None:
            # built from the host copy and uploaded once: on the device, its bounds checks and
            # repeat_interleave would each synchronise the stream, once per microbatch
            window_TW = to_device(window_from_cu_seqlens(self._cu_cpu, W, self.num_rows), x_TD.device)
            self._windows[W] = window_TW
        return short_conv(x_TD, weight_DW, bias_D, window_TW=window_TW, activation="silu", kernels=self.kernels,
                          record=self.kernel_record)

    def kda(self, layer: int, q_THK: Tensor, k_THK: Tensor, v_THV: Tensor, g_THK: Tensor, beta_TH: Tensor, scale: float) -> Tensor:
        from harts.exec.backend import chunk_kda

        out = chunk_kda(
            q_THK, k_THK, v_THV, g_THK, beta_TH, scale=scale,
            cu_seqlens=self._cu_on(q_THK.device), cu_seqlens_cpu=self._cu_cpu, chunk_size=self.chunk_size,
            output_final_state=False, kernels=self.kernels, record=self.kernel_record,
        )
        return out.o
