"""Token-wise building blocks: RMSNorm, gated RMSNorm, SwiGLU, rotary embedding.

The norm modules take the mixing context their call runs in (None: the default kernels)
and run `harts.exec.backend`'s pick for it: torch's fused RMSNorm kernel on CUDA, the
references of `harts.exec.ops.norm.naive` (re-exported here) elsewhere.

Shapes: T rows, H heads, D model dim, F FFN dim, R rotary dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harts.config.kernels import KernelConfig
from harts.exec import backend
from harts.exec.backend import DEFAULT_KERNELS
from harts.exec.compiled import region
from harts.exec.ops.norm.naive import l2_norm, offset_rms_norm, rms_norm
from harts.exec.ops.record import KernelRecord

__all__ = ["GatedRMSNorm", "OffsetRMSNorm", "RMSNorm", "SiLUGatedRMSNorm", "SwiGLU", "apply_rope", "l2_norm",
           "l2_norm_of", "norm_kernels", "offset_rms_norm", "rms_norm", "sigmoid_gated", "swiglu_product"]


def norm_kernels(ctx: object) -> tuple[KernelConfig, KernelRecord | None]:
    """The kernels a context asks for and the record it keeps (the defaults for None)."""
    return getattr(ctx, "kernels", None) or DEFAULT_KERNELS, getattr(ctx, "kernel_record", None)


def l2_norm_of(x: Tensor, ctx: object = None, eps: float = 1e-6) -> Tensor:
    """`l2_norm` on the context's kernels."""
    kernels, record = norm_kernels(ctx)
    return backend.l2_norm(x, eps, kernels=kernels, record=record)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, float32: bool = False):
        super().__init__()
        self.eps, self.float32 = eps, float32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, ctx: object = None) -> Tensor:
        kernels, record = norm_kernels(ctx)
        return backend.rms_norm(x, self.weight, self.eps, self.float32, kernels=kernels, record=record)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then times sigmoid(gate) (fla FusedRMSNormGated, sigmoid)."""

    def __init__(self, dim: int, eps: float, float32: bool = False):
        super().__init__()
        self.eps, self.float32 = eps, float32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor, ctx: object = None) -> Tensor:
        kernels, record = norm_kernels(ctx)
        normed = backend.rms_norm(x, self.weight, self.eps, self.float32, kernels=kernels, record=record)
        return region(sigmoid_gated, kernels, normed, gate)(normed, gate)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x_TD: Tensor, ctx: object = None) -> Tensor:
        """down(silu(gate(x)) * up(x)); the product on the context's kernels (`swiglu_product`)."""
        g_TF, u_TF = self.gate_proj(x_TD), self.up_proj(x_TD)
        return self.down_proj(region(swiglu_product, getattr(ctx, "kernels", None), g_TF, u_TF)(g_TF, u_TF))


def swiglu_product(g: Tensor, u: Tensor) -> Tensor:
    """silu(g) * u (a compiled region, `harts.exec.compiled`)."""
    return F.silu(g) * u


def sigmoid_gated(x: Tensor, gate: Tensor) -> Tensor:
    """x * sigmoid(gate) (a compiled region, `harts.exec.compiled`)."""
    return x * torch.sigmoid(gate)


def apply_rope(x_THR: Tensor, position_ids_T: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE on the last dim (R even) at the given positions (tree depths)."""
    R = x_THR.shape[-1]
    inv_freq = theta ** (-torch.arange(0, R, 2, dtype=torch.float64, device=x_THR.device) / R)
    angles_TR2 = position_ids_T.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles_TR2.cos()] * 2, dim=-1).to(x_THR.dtype)[:, None, :]
    sin = torch.cat([angles_TR2.sin()] * 2, dim=-1).to(x_THR.dtype)[:, None, :]
    x1, x2 = x_THR[..., : R // 2], x_THR[..., R // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_THR * cos + rotated * sin


class OffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm (Qwen3-Next): x / rms(x) * (1 + w), the stored weight w an offset
    from one (initialised to zeros). `float32`: normalised and scaled in float32, cast back
    after the weight (Qwen3-Next's order, unlike Llama's); else in x's dtype throughout."""

    def __init__(self, dim: int, eps: float, float32: bool = False):
        super().__init__()
        self.eps, self.float32 = eps, float32
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor, ctx: object = None) -> Tensor:
        return offset_rms_norm(x, self.weight, self.eps, self.float32)


class SiLUGatedRMSNorm(nn.Module):
    """RMSNorm over the last dim times SiLU(gate) (Qwen3-Next's gated norm of the GDN output,
    fla's FusedRMSNormGated with activation silu); the weight is plain (initialised to ones).
    `float32`: normalised in float32, cast back before the weight (as the checkpoint's norm)."""

    def __init__(self, dim: int, eps: float, float32: bool = False):
        super().__init__()
        self.eps, self.float32 = eps, float32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor, ctx: object = None) -> Tensor:
        kernels, record = norm_kernels(ctx)
        return backend.rms_norm(x, self.weight, self.eps, self.float32, kernels=kernels,
                                record=record) * F.silu(gate)
