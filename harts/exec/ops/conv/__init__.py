"""Short causal depthwise convolution (KDA's q/k/v conv) for packed sequences and trees."""

from harts.exec.ops.conv.gather import (
    final_conv_state,
    short_conv,
    short_conv_varlen,
    window_from_cu_seqlens,
    window_from_parents,
)
from harts.exec.ops.conv.naive import naive_short_conv

__all__ = [
    "final_conv_state",
    "naive_short_conv",
    "short_conv",
    "short_conv_varlen",
    "window_from_cu_seqlens",
    "window_from_parents",
]
