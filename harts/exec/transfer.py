"""Host-to-device copies that do not stall the GPU.

`tensor.to("cuda")` from ordinary (pageable) host memory synchronises the stream: the host
waits until the GPU has finished everything queued so far, and then the GPU idles while
the host queues the next kernels. Index arrays built on the host (layouts, KDA chunk
bookkeeping, gather lists) are copied in the middle of forward and backward passes, so
each such copy costs an idle gap. `to_device` stages them in pinned memory and copies
asynchronously on the current stream instead: stream order still puts the copy before any
kernel queued after it, and torch's caching host allocator keeps the pinned buffer alive
until the copy has run (it records an event on the stream). On a CPU target it is a plain
`torch.as_tensor`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device(x: np.ndarray | Tensor | list | tuple, device: torch.device | str,
              dtype: torch.dtype | None = None) -> Tensor:
    """`x` as a tensor on `device` (and `dtype`, converted on the host first), without a
    stream synchronisation when `device` is a GPU and `x` lives on the host."""
    dev = torch.device(device)
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(x))
    else:
        t = torch.as_tensor(x)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if dev.type != "cuda" or t.device.type == "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)
