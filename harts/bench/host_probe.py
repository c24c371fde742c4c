"""How fast this machine's host dispatches small ops: a few seconds' probe recorded beside
GPU results.

A window step at a 16k budget is bound by its host on some machines and not on others (the
same code and GPU measured 1.14x and 1.39x its unsplit step on two H100 machines, their
hosts fitted at about 39 and 52 us per kernel launch: docs/BENCHMARKS.md). The simulator's
`host_s_per_launch` is that machine property. `probe` times a fixed loop of small autograd
ops (a norm, a product, a gate, a row gather, a cat, a sum and its backward, on tensors so
small that the device finishes each op before the host issues the next) and reports the
wall seconds per dispatched op: a number to set beside each machine's fitted host rate, so
that a result file says which kind of host it ran on. It is not the executor's launch
rate (a real step's ops carry more Python per launch), and nothing here prices a step.
"""

from __future__ import annotations

import platform
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_model() -> str | None:
    """The processor's model name (Linux /proc/cpuinfo), else `platform.processor()`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def probe(device: str | torch.device = "cuda", *, iters: int = 300, warmup: int = 30, width: int = 64,
          rows: int = 256, repeats: int = 3) -> dict[str, Any]:
    """Wall seconds per dispatched op of a fixed small autograd loop on `device`.

    Each iteration runs the same forward and backward over [rows, width] tensors; the ops
    one iteration dispatches (forward, backward and the gradients' accumulation) are counted
    once under a dispatch mode. The loop runs `iters` iterations between two device
    synchronisations, `repeats` times; `s_per_op` is the fastest repeat's wall over its ops.
    Raises ValueError for non-positive sizes."""
    for name, value in (("iters", iters), ("width", width), ("rows", rows), ("repeats", repeats)):
        if value < 1:
            raise ValueError(f"host probe: {name}={value}, expected >= 1")
    if warmup < 0:
        raise ValueError(f"host probe: warmup={warmup}, expected >= 0")
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, width, generator=gen).to(dev)
    w = torch.randn(width, 2 * width, generator=gen).to(dev).requires_grad_()
    norm_w = torch.ones(width, device=dev, requires_grad=True)
    idx = torch.randperm(rows, generator=gen)[: rows // 2].to(dev)

    def step() -> None:
        h = F.rms_norm(x, (width,), norm_w)
        gate, up = F.linear(h, w.t()).chunk(2, dim=-1)
        y = F.silu(gate) * up
        z = torch.cat([y.index_select(0, idx), y], dim=0)
        z.square().mean().backward()

    counter = _CountOps()
    with counter:
        step()
    for _ in range(warmup):
        step()
    walls = []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(dev)
        walls.append(time.perf_counter() - t0)
    best = min(walls)
    return {"s_per_op": best / (iters * counter.ops), "ops_per_iteration": counter.ops, "iterations": iters,
            "repeats_s": walls, "device": str(dev), "cpu": cpu_model(), "python": platform.python_version(),
            "torch": torch.__version__}
