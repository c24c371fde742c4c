"""`HostOffload` on a CUDA device: copies on its own stream, the backward's one tensor ahead,
give the gradients of the same graph with its saved tensors left in place, bit for bit,
while the compute stream overwrites freed memory between save and unpack; a window step
with its producers offloaded equals the one without (float32, the executor's default
kernels)."""

from __future__ import annotations

import pytest
import torch

from harts.exec.model.model import build_model
from harts.exec.offload import HostOffload
from harts.exec.window import PlanTrainer
from tests.exec.test_window_fast import LOSS, _grads, _setup

pytestmark = pytest.mark.cuda


def _chain(x, weights):
    for w in weights:
        x = torch.tanh(x @ w)  # each layer saves its input and its output (large)
    return x.square().sum()


@pytest.mark.parametrize("unpack_twice", [False, True])
def test_offloaded_chain_gives_the_same_gradients(unpack_twice):
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(512, 512, device="cuda", generator=g) / 23).requires_grad_() for _ in range(12)]
    x = torch.randn(8192, 512, device="cuda", generator=g).requires_grad_()
    want = torch.autograd.grad(_chain(x, weights), [x, *weights])
    hooks = HostOffload(min_bytes=1 << 20)
    with hooks:
        loss = _chain(x, weights)
    # the compute stream reuses the freed blocks while the copies may still run
    junk = [torch.full((8192, 512), float("nan"), device="cuda") for _ in range(24)]
    del junk
    got = torch.autograd.grad(loss, [x, *weights], retain_graph=unpack_twice)
    if unpack_twice:  # a second backward unpacks every saved tensor again
        again = torch.autograd.grad(loss, [x, *weights])
        for a, b in zip(got, again, strict=True):
            assert torch.equal(a, b)
    assert hooks.tensors == 24 and hooks.stream is not None  # tanh's input and output per layer
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_window_step_with_offloaded_producers_equals_the_step_without(monkeypatch):
    import harts.exec.offload as offload

    # this model's activations are small: move every saved tensor of 1 KiB or more
    monkeypatch.setattr(offload, "DEFAULT_MIN_BYTES", 1 << 10)
    trajs, plan, cfg = _setup(chunk_size=64)
    runs = {}
    for moved in (False, True):
        model = build_model(cfg, seed=3, dtype=torch.float32, device="cuda", recompute=True)
        trainer = PlanTrainer(model, plan, loss=LOSS, offload_producers=moved)
        res = trainer.forward_backward(trajs, 1 << 20)
        runs[moved] = (res.losses, _grads(model), trainer.windows)
    assert runs[True][2] and all(w.offloaded_bytes > 0 for w in runs[True][2])
    for a, b in zip(runs[False][1], runs[True][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
