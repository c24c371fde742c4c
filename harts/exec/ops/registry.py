"""Op dispatch: one registry per op family, in which each fast path registers the
situations it runs in and its priority; the family's reference runs everywhere else.

fla's `BackendRegistry` (fla/backends.py) is the model. A `FastPath` names what it runs (an
`Impl`), the function that runs it (the family's calling convention, which its reference
shares), the device types and dtypes it computes, the `KernelConfig` settings that allow
it, the import probe of the package it needs, and a priority (lower is tried first; equal
priorities keep their registration order). `OpRegistry.select` returns the first path
whose conditions all hold for a call's (device, dtype, KernelConfig): the reference where
none does, and always under `force_reference`. The conditions are tested cheapest first
(configuration, device, dtype, then the import probe), so a call on the CPU never imports
a GPU library.

Each family declares its registry and its fast paths in its `paths` module
(`harts.exec.ops.<family>.paths`); `harts.exec.backend` selects through them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from harts.config.kernels import Impl, KernelConfig


@dataclass(frozen=True)
class FastPath:
    impl: StrEnum
    run: Callable[..., Any]
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] | None = None  # None: any dtype
    allowed: Callable[[KernelConfig], bool] | None = None  # the settings that allow it; None: any
    installed: Callable[[], bool] | None = None  # whether its package imports (cached); None: nothing to import
    priority: int = 0

    def accepts(self, device: torch.device, dtype: torch.dtype | None, kernels: KernelConfig) -> bool:
        if self.allowed is not None and not self.allowed(kernels):
            return False
        if device.type not in self.devices:
            return False
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        return self.installed is None or self.installed()


class OpRegistry:
    """The fast paths of one op family (`op`, as `KernelRecord` names it) and its reference."""

    def __init__(self, op: str, reference: Callable[..., Any]):
        self.op = op
        self.reference = reference
        self._paths: list[FastPath] = []

    def register(self, path: FastPath) -> FastPath:
        if not isinstance(path.impl, StrEnum):
            raise TypeError(f"{self.op}: a fast path is named by a StrEnum member (an Impl), got {path.impl!r}")
        if path.impl == Impl.REFERENCE or any(p.impl == path.impl for p in self._paths):
            raise ValueError(f"{self.op} fast path {path.impl.value!r} registered twice")
        self._paths.append(path)
        # stable: equal priorities keep their registration order
        self._paths.sort(key=lambda p: p.priority)
        return path

    def unregister(self, impl: str) -> FastPath:
        path = self.path(impl)
        self._paths.remove(path)
        return path

    def path(self, impl: str) -> FastPath:
        for p in self._paths:
            if p.impl == impl:
                return p
        raise KeyError(f"unknown {self.op} fast path {impl!r}; registered: "
                       f"{', '.join(p.impl.value for p in self._paths)}")

    @property
    def paths(self) -> tuple[FastPath, ...]:
        """The fast paths in the order `select` tries them."""
        return tuple(self._paths)

    def select(self, device: torch.device, dtype: torch.dtype | None, kernels: KernelConfig) -> StrEnum:
        """What a call on `device` in `dtype` under `kernels` runs: the first fast path that
        accepts it, else `Impl.REFERENCE`."""
        if kernels.force_reference:
            return Impl.REFERENCE
        for path in self._paths:
            if path.accepts(device, dtype, kernels):
                return path.impl
        return Impl.REFERENCE

    def run(self, impl: str) -> Callable[..., Any]:
        """The function that runs `impl` (the reference for `Impl.REFERENCE`)."""
        return self.reference if impl == Impl.REFERENCE else self.path(impl).run
