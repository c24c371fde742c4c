"""Run a transformers modeling module in float64 throughout, as the independent reference.

transformers' modules upcast to float32 where bf16 would lose precision (RMSNorms, the
router, the KDA / delta-rule fallbacks, eager attention's softmax), written as
`x.to(torch.float32)` / `x.float()`; fed float64 they would cut it to float32 there. Inside
`float64_reference(module)` those casts keep float64 (the module's `torch.float32` is float64
and `Tensor.float()` leaves a float64 tensor as it is), and the module's hub-kernel
functions run their own pure-torch definitions (what transformers falls back to without
fla / causal-conv1d), so every op is transformers' code, computed in float64.
"""

from __future__ import annotations

import contextlib
import inspect
import types

import torch


class _Float64Torch(types.ModuleType):
    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


@contextlib.contextmanager
def float64_reference(module: types.ModuleType):
    saved = {name: obj for name, obj in vars(module).items()
             if inspect.isfunction(obj) and hasattr(obj, "__wrapped__")}
    old_torch, old_float = module.torch, torch.Tensor.float
    module.torch = _Float64Torch("torch")
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else old_float(self, *a, **k)
    for name, fn in saved.items():
        setattr(module, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        module.torch, torch.Tensor.float = old_torch, old_float
        for name, fn in saved.items():
            setattr(module, name, fn)
