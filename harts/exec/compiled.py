"""The model's regions under torch.compile (`harts.config.kernels.KernelConfig.compile`):
the MoE layer's routing and load-balance statistics (`harts.exec.model.moe.route_and_balance`,
plain top-k routers with per-microbatch statistics), the KDA forget gate
(`harts.exec.model.kda.kda_gate`), the SwiGLU product (`harts.exec.model.layers.swiglu_product`),
the gated norm's gate (`layers.sigmoid_gated`) and the routed experts' weighted SwiGLU
product (`harts.exec.ops.moe.grouped.expert_hidden`). Each is a chain of small elementwise
ops and reductions after a matmul or a norm, one kernel launch each when eager; compiled,
they fuse into a few (on the CPU the routing's forward and backward go from 47 aten ops
to 20 generated kernels, the matmuls and the top-k). The layers call the same functions
eager where the setting is off, and where an input is a distributed tensor (`region`).
Measured on one H200 (docs/BENCHMARKS.md, "Compiled regions and producers that store,
timed"): 12-14% fewer launches, a device-bound step 3% faster, a host-bound window step
7% slower (a compiled call costs the host more than the eager launches it replaces).

A region is a module-level function of tensors (and constants), so a microbatch's context
objects never reach the tracer. It is compiled once per backend with dynamic shapes: one
graph for every row count a step's microbatches have (plus torch's own specialisations of
sizes 0 and 1, and one graph per grad mode and dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


@functools.cache
def compiled(fn: Callable, backend: str) -> Callable:
    """`fn` under torch.compile with `backend`, dynamic shapes; one compiled function per
    (fn, backend) for the process."""
    return torch.compile(fn, dynamic=True, backend=backend)


def region(fn: Callable, kernels, *tensors: torch.Tensor) -> Callable:
    """`fn` as `kernels.compile` asks: compiled (`compiled`), or `fn` itself where it is
    off, where there is no config, or where one of `tensors` (what the call passes, or the
    weights behind it) is not a plain tensor or parameter (a DTensor under tensor
    parallelism)."""
    backend = str(getattr(kernels, "compile", "off"))
    if backend == "off" or any(type(t) not in (torch.Tensor, nn.Parameter) for t in tensors):
        return fn
    return compiled(fn, backend)
