"""Run an independent reference that casts to float32 internally (transformers' Qwen3-Next,
fla's naive GDN) in true float64, so HARTS can be held to it at float64 precision.

`float64_module(module)` swaps the module's global `torch` for a proxy whose `float32` and
`float` are `torch.float64` (every `.to(torch.float32)`, `dtype=torch.float` and
`torch.arange(..., dtype=torch.float)` in that module's functions then stays in float64),
and makes `Tensor.float()` leave float64 tensors as they are. Nothing else of the
reference's code changes: its algorithm is what runs.
"""

from __future__ import annotations

import contextlib
import types

import torch


class _Float64Torch(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        if name in ("float32", "float"):
            return torch.float64
        return getattr(torch, name)


@contextlib.contextmanager
def float64_module(*modules: types.ModuleType):
    saved = [(m, m.__dict__.get("torch")) for m in modules]
    original_float = torch.Tensor.float

    def float_keep64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original_float(self, *args, **kwargs)

    try:
        for m, _ in saved:
            m.torch = _Float64Torch()
        torch.Tensor.float = float_keep64
        yield
    finally:
        torch.Tensor.float = original_float
        for m, t in saved:
            m.torch = t
