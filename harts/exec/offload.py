"""Host offload of a sharing window producer's saved tensors.

A window producer's forward runs before its consumers and its backward after the last of
them, so everything its autograd graph saved stays on the device while the consumers
run. With `recompute=True` most of that is each block's checkpointed input (rows x
d_model per layer: about 1 GiB on a 42k-row producer of `tiny-h200`); the stash the
consumers read is separate and stays on the device. `HostOffload` moves the large saved
tensors to host memory as they are saved and copies them back when the producer's
backward unpacks them.

This is `torch.autograd.graph.save_on_cpu` with four differences, which is why it is
not used as is: parameters and leaves that require gradients (the LM head's and a linear
layer's weight, saved by their matmuls, often as a transposed view) and small tensors
stay where they are; the copies are `non_blocking`, into and out of pinned memory, so the
host does not wait for the device at every saved tensor (a wait per block would leave the
device idle while the host launches the next kernels); on a CUDA device they run on a
copy stream of their own, so they overlap the producer's kernels instead of queueing
between them, and the backward's copy of the tensor unpacked next starts when the one
before it is unpacked (a prefetch one tensor deep, in the reverse of the order the
tensors were saved, which is the order a backward unpacks them); and it counts what it
moved (`bytes`). Values are copied, not changed: a step with it computes what the step
without it does, bit for bit.

Stream order, on CUDA: a device-to-host copy waits for everything the compute stream had
queued when the tensor was saved, and the source's memory is not reused before the copy
has run (`Tensor.record_stream`); a host-to-device copy follows its own device-to-host
copy on the copy stream, and the compute stream waits for it (an event) before the
unpacked tensor is used, whose memory then belongs to the compute stream as well.
"""

from __future__ import annotations

import torch

# tensors below this many bytes stay on the device (norm statistics, routing indices):
# moving them costs more launches than it frees
DEFAULT_MIN_BYTES = 1 << 20


class _Moved:
    """One saved tensor held in host memory: `host`, and once copied back (or prefetched)
    the device copy `dev` with the event the compute stream waits on."""

    __slots__ = ("dev", "device", "done", "host", "index")

    def __init__(self, device: torch.device, host: torch.Tensor, index: int):
        self.device, self.host, self.index = device, host, index
        self.dev: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks holding tensors of at least `min_bytes` (default
    `DEFAULT_MIN_BYTES`, read when constructed) in host memory (pinned
    when the source is on a CUDA device) until autograd unpacks them; parameters are never
    moved. `bytes` / `tensors`: what was moved since construction. On CUDA the copies
    run on one copy stream per instance (`stream`), the backward's one tensor ahead."""

    def __init__(self, min_bytes: int | None = None):
        self.min_bytes = DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes)
        self.bytes = 0
        self.tensors = 0
        self.stream: torch.cuda.Stream | None = None
        # moved tensors not yet unpacked, by the order they were saved (for the prefetch)
        self._waiting: dict[int, _Moved] = {}

        def pack(t: torch.Tensor):
            size = t.numel() * t.element_size()
            base = t if t._base is None else t._base  # a matmul saves its weight as a view
            if size < self.min_bytes or (base.is_leaf and base.requires_grad) or t.layout != torch.strided:
                return t
            cuda = t.device.type == "cuda"
            host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=cuda)
            if cuda:
                stream = self._copy_stream(t.device)
                stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(stream):
                    host.copy_(t, non_blocking=True)
                t.record_stream(stream)
            else:
                host.copy_(t)
            moved = _Moved(t.device, host, self.tensors)
            self._waiting[moved.index] = moved
            self.bytes += size
            self.tensors += 1
            return moved

        def unpack(p):
            if not isinstance(p, _Moved):
                return p
            self._waiting.pop(p.index, None)
            if p.device.type != "cuda":
                return p.host.to(p.device)
            if p.dev is None:
                self._fetch(p)
            nxt = self._waiting.get(p.index - 1)
            if nxt is not None and nxt.dev is None:
                self._fetch(nxt)
            dev, p.dev = p.dev, None  # a second unpack (retain_graph) copies again
            current = torch.cuda.current_stream(p.device)
            current.wait_event(p.done)
            dev.record_stream(current)
            return dev

        super().__init__(pack, unpack)

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream

    def _fetch(self, m: _Moved) -> None:
        """Start the host-to-device copy of `m` on the copy stream (after its
        device-to-host copy, which that stream ran first)."""
        stream = self._copy_stream(m.device)
        with torch.cuda.stream(stream):
            m.dev = m.host.to(m.device, non_blocking=True)
            m.done = torch.cuda.Event()
            m.done.record(stream)
