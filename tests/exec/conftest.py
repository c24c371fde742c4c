"""`libraries`: stand the fast paths' libraries in or out for a test, so implementation
selection can be checked for a CUDA machine with or without fla, FlexAttention or
torch's grouped_mm on any machine (selection only looks at the device's type)."""

from __future__ import annotations

import sys
import types

import pytest
import torch.nn.functional as F

from harts.exec import backend

FLA_MODULES = ("fla", "fla.ops", "fla.ops.kda", "triton")
FLEX_MODULE = "torch.nn.attention.flex_attention"


class Libraries:
    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.monkeypatch = monkeypatch

    def set(self, *, fla: bool, flex: bool, grouped_mm: bool) -> None:
        """fla (with triton), FlexAttention and F.grouped_mm import or not, as asked."""
        mp = self.monkeypatch
        for name in FLA_MODULES:
            # a stand-in module imports at once; None makes the import fail
            mp.setitem(sys.modules, name, types.ModuleType(name) if fla else None)
        if flex:
            stand_in = types.ModuleType(FLEX_MODULE)
            stand_in.BlockMask = stand_in.flex_attention = object()
            mp.setitem(sys.modules, FLEX_MODULE, stand_in)
        else:
            mp.setitem(sys.modules, FLEX_MODULE, None)
        if grouped_mm:
            mp.setattr(F, "grouped_mm", lambda *a, **k: None, raising=False)
        else:
            mp.delattr(F, "grouped_mm", raising=False)
        clear_availability()


def clear_availability() -> None:
    for probe in (backend.fla_available, backend.flex_available, backend.grouped_mm_available):
        probe.cache_clear()


@pytest.fixture
def libraries(monkeypatch):
    clear_availability()
    yield Libraries(monkeypatch)
    # forget what the stand-ins answered before monkeypatch puts the real modules back
    clear_availability()
