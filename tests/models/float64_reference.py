"""Run an independent reference (transformers' Kimi-Linear, Qwen3-Next and Qwen3.5 modeling
code, fla's naive GDN) in true float64, so HARTS can be held to it at float64 precision.

`torch_only_modeling(name)` executes a private copy of transformers' modeling module `name`
(in `sys.modules` only while it executes) while `fla` and `causal_conv1d` cannot be imported. Each
`use_kernel_func_from_hub_with_fallback(func, package)` in it then selects the module's own
pure-torch function (transformers' documented "torch only path"), whatever the version and
however it wraps that function, and whatever the device of the inputs. The copy's model and
layer classes are its own; its configuration classes (and everything else it imports) are
transformers' shared ones. Build the reference model from the copy's classes.

`float64_module(module)` swaps the module's global `torch` for a proxy whose `float32` and
`float` are `torch.float64` (every `.to(torch.float32)`, `dtype=torch.float` and
`torch.arange(..., dtype=torch.float)` in that module's functions then stays in float64),
and makes `Tensor.float()` leave float64 tensors as they are. Nothing else of the
reference's code changes: its algorithm is what runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import sys
import types

import torch

# the packages transformers' modeling modules take kernels from when they import
BLOCKED_PACKAGES = ("fla", "causal_conv1d")


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


@contextlib.contextmanager
def _unimportable(packages: tuple[str, ...]):
    """`import p` (and of any submodule) raises ImportError for every p in `packages`."""
    names = [n for n in sys.modules if n.split(".")[0] in packages] + list(packages)
    saved = {n: sys.modules[n] for n in names if n in sys.modules}
    try:
        for n in names:
            sys.modules[n] = None  # type: ignore[assignment]
        yield
    finally:
        for n in names:
            if n in saved:
                sys.modules[n] = saved[n]
            else:
                sys.modules.pop(n, None)


@functools.cache
def torch_only_modeling(name: str) -> types.ModuleType:
    """A private copy of transformers' modeling module `name` on its pure-torch functions."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(name)
    source = spec.loader.get_source(name) or ""
    # every package a kernel function may come from must be one made unimportable here
    wanted = set(re.findall(r"use_kernel_func_from_hub_with_fallback\(\s*\"[^\"]+\",\s*\"([^\"]+)\"", source))
    assert wanted <= set(BLOCKED_PACKAGES), f"{name} takes kernels from {sorted(wanted - set(BLOCKED_PACKAGES))}"
    module = importlib.util.module_from_spec(spec)
    public = sys.modules.get(name)
    # registered while it runs: class decorators look their module up by name
    sys.modules[name] = module
    try:
        with _unimportable(BLOCKED_PACKAGES):
            spec.loader.exec_module(module)
    finally:
        if public is None:
            del sys.modules[name]
        else:
            sys.modules[name] = public
    return module


@torch.no_grad()
def perturb_from_init(model: torch.nn.Module) -> None:
    """A transformers hybrid model moved off its initialisation where it would hide layout
    errors: norms, `dt_bias` and `A_log` offset by 0.1 N(0, 1), the zero-initialised MoE
    router (`mlp.gate.weight`) spread to N(0, 0.5), in one pass over the parameters."""
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(("dt_bias", "A_log")):
            p.add_(0.1 * torch.randn_like(p))
        if name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.5)
