"""Host offload of a sharing window producer's saved tensors.

A window producer's forward runs before its consumers and its backward after the last of
them, so everything its autograd graph saved stays on the device while the consumers
run. With `recompute=True` most of that is each block's checkpointed input (rows x
d_model per layer: about 1 GiB on a 42k-row producer of `tiny-h200`); the stash the
consumers read is separate and stays on the device. `HostOffload` moves the large saved
tensors to host memory as they are saved and copies them back when the producer's
backward unpacks them.

This is `torch.autograd.graph.save_on_cpu` with three differences, which is why it is
not used as is: parameters and leaves that require gradients (the LM head's and a linear
layer's weight, saved by their matmuls, often as a transposed view) and small tensors
stay where they are; the device-to-host copy is
`non_blocking` into pinned memory, so the host does not wait for the device at every
saved tensor (a wait per block would leave the device idle while the host launches the
next kernels; the copies run in stream order, so a source tensor's memory is reused only
after its copy); and it counts what it moved (`bytes`). Values are copied, not changed:
a step with it computes what the step without it does, bit for bit.
"""

from __future__ import annotations

import torch

# tensors below this many bytes stay on the device (norm statistics, routing indices):
# moving them costs more launches than it frees
DEFAULT_MIN_BYTES = 1 << 20


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks holding tensors of at least `min_bytes` (default
    `DEFAULT_MIN_BYTES`, read when constructed) in host memory (pinned
    when the source is on a CUDA device) until autograd unpacks them; parameters are never
    moved. `bytes` / `tensors`: what was moved since construction."""

    def __init__(self, min_bytes: int | None = None):
        self.min_bytes = DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes)
        self.bytes = 0
        self.tensors = 0

        def pack(t: torch.Tensor):
            size = t.numel() * t.element_size()
            base = t if t._base is None else t._base  # a matmul saves its weight as a view
            if size < self.min_bytes or (base.is_leaf and base.requires_grad) or t.layout != torch.strided:
                return t
            cuda = t.device.type == "cuda"
            host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=cuda)
            host.copy_(t, non_blocking=cuda)
            self.bytes += size
            self.tensors += 1
            return (t.device, host)

        def unpack(p):
            if isinstance(p, tuple):
                device, host = p
                return host.to(device, non_blocking=device.type == "cuda")
            return p

        super().__init__(pack, unpack)
