"""`harts.exec.stash.StashPart`: a stash's keys and values read through an autograd
function, on the device or from host memory, with the gradient of every read accumulated
where the part lives when that read's backward runs."""

from __future__ import annotations

import numpy as np
import torch

from harts.exec.stash import Stash, StashPart


def _producer(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 10, dtype=torch.float64, generator=g, requires_grad=True)
    kv = w * 3.0  # keys and values as views of one projection's output
    return w, kv[:, :4], kv[:, 4:]


def _readers(parts, host_after: int | None, stash: Stash):
    """Three readers in turn, each a forward and its backward; the parts moved to host
    memory after reader `host_after`'s forward (before its backward)."""
    weights = [torch.linspace(0.5, 2.0, 24, dtype=torch.float64).reshape(6, 4),
               torch.linspace(-1.0, 1.0, 36, dtype=torch.float64).reshape(6, 6)]
    for r in range(3):
        k, v = (p.read() for p in parts)
        loss = ((k * weights[0]) ** (r + 1)).sum() + (v * weights[1] * (r - 1)).sum()
        if r == host_after:
            assert stash.parts_to_host() == sum(p.nbytes() for p in parts)
        loss.backward()


def test_reads_and_gradients_do_not_depend_on_where_the_parts_live():
    results = []
    for host_after in (None, 0, 1, 2):
        w, k, v = _producer()
        stash = Stash(np.arange(6))
        stash.inputs[(0, "attention")] = (k, v)
        view = stash.leaves()
        parts = view.inputs[(0, "attention")]
        assert all(isinstance(p, StashPart) for p in parts)
        _readers(parts, host_after, stash)
        if host_after is not None:
            # the shared projection output's storage is released only after both were copied
            assert k.untyped_storage().size() == 0 and v.untyped_storage().size() == 0
        outs, grads = stash.producer_backward_pairs()
        assert [o is t for o, t in zip(outs, (k, v), strict=True)] == [True, True]
        torch.autograd.backward(outs, grads)
        results.append(w.grad.clone())
    for got in results[1:]:
        assert torch.equal(got, results[0])


def test_a_part_read_in_no_grad_mode_has_no_graph():
    w, k, _ = _producer()
    part = StashPart(k)
    with torch.no_grad():
        x = part.read()
    assert not x.requires_grad and torch.equal(x, k.detach())
    part.copy_to_host()
    part.free()
    assert torch.equal(part.read(), w.detach()[:, :4] * 3.0)
    assert part.take_grad() is None
