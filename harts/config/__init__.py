"""Configurations as data (no torch): the simulator, the planner and the executor share them."""

from harts.config.kernels import BaselineAttention, ConvKernel, Impl, KernelConfig, TreeAttention

__all__ = ["BaselineAttention", "ConvKernel", "Impl", "KernelConfig", "TreeAttention"]
