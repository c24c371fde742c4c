"""The optimizer settings a trainer builds its AdamW from."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OptimizerConfig"]


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0  # applied to matrices only (not norms, biases, A_log, dt_bias)
    grad_clip: float | None = 1.0  # max global L2 norm; None = no clipping

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig.lr must be > 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas must be two values in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"OptimizerConfig.eps must be > 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"OptimizerConfig.grad_clip must be > 0 or None, got {self.grad_clip!r}")
