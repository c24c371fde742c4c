"""The model's regions under torch.compile (`harts.config.kernels.KernelConfig.compile`):
the MoE layer's routing and load-balance statistics (`harts.exec.model.moe.route_and_balance`,
plain top-k routers with per-microbatch statistics) and the KDA forget gate
(`harts.exec.model.kda.kda_gate`). Each is a chain of small elementwise ops and
reductions around a matmul, one kernel launch each when eager; compiled, they fuse into a
few (on the CPU the routing's forward and backward go from 47 aten ops to 20 generated
kernels, the matmuls and the top-k). The layers call the same functions eager where the
setting is off, and where a weight is a distributed tensor.

A region is a module-level function of tensors (and constants), so a microbatch's context
objects never reach the tracer. It is compiled once per backend with dynamic shapes: one
graph for every row count a step's microbatches have (plus torch's own specialisations of
sizes 0 and 1, and one graph per grad mode and dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(fn: Callable, backend: str) -> Callable:
    """`fn` under torch.compile with `backend`, dynamic shapes; one compiled function per
    (fn, backend) for the process."""
    return torch.compile(fn, dynamic=True, backend=backend)
