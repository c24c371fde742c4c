"""Helpers for the KDA tests: random packed problems and fla-core's independent references.

fla's naive functions take [B, T, H, K] tensors, one sequence per batch row; here each packed
sequence is run through them alone (batch of one) and the results are concatenated back.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from unittest import mock

import fla.ops.kda.naive as fla_kda_naive
import torch
import torch.nn.functional as F

from harts.testing import assert_close, rel_err

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
INPUTS = ("q", "k", "v", "g", "beta", "initial_state")


class _TorchWithFloat64:
    """Stand-in for the `torch` module inside fla.ops.kda.naive.

    fla's naive KDA casts its inputs with `.to(torch.float)` and allocates with
    `dtype=torch.float`, i.e. float32. To check our float64 path at 1e-10 we run fla's code
    unchanged but with `torch.float` meaning float64; every other attribute is torch's own.
    """

    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextmanager
def fla_float64():
    with mock.patch.object(fla_kda_naive, "torch", _TorchWithFloat64()):
        yield


@dataclass
class Problem:
    """A packed KDA problem: leaf inputs, cu_seqlens and the upstream gradients."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor
    cu_seqlens: torch.Tensor
    do: torch.Tensor
    dht: torch.Tensor

    def inputs(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in INPUTS}

    def to(self, dtype: torch.dtype) -> Problem:
        """The same numbers in another dtype (cu_seqlens as it is)."""
        return Problem(**{name: getattr(self, name).to(dtype) for name in (*INPUTS, "do", "dht")},
                       cu_seqlens=self.cu_seqlens)

    def leaves(self) -> dict[str, torch.Tensor]:
        return {name: x.detach().clone().requires_grad_() for name, x in self.inputs().items()}

    @property
    def bounds(self) -> list[tuple[int, int]]:
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:], strict=True))


def make_problem(
    lens: list[int], H: int, K: int, V: int, seed: int, dtype: torch.dtype, decay: float = 1.0
) -> Problem:
    """Realistic magnitudes: q, k L2-normalised (as the layer does), beta in (0, 1),
    g = decay * logsigmoid(normal) <= 0. Drawn in float64 and cast, so both dtypes see the
    same numbers."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = dict(
        q=F.normalize(randn(T, H, K), dim=-1),
        k=F.normalize(randn(T, H, K), dim=-1),
        v=randn(T, H, V),
        g=decay * F.logsigmoid(randn(T, H, K)),
        beta=torch.sigmoid(randn(T, H)),
        initial_state=randn(N, H, K, V),
        do=randn(T, H, V),
        dht=randn(N, H, K, V),
    )
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    return Problem(**{name: x.to(dtype) for name, x in tensors.items()}, cu_seqlens=cu)


def grads_of(o, final_state, do, dht, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    loss = (o * do).sum() + (final_state * dht).sum()
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return dict(zip(names, grads, strict=True))


def run_ours(fn, p: Problem, **kwargs) -> dict[str, torch.Tensor]:
    """Run a packed op of ours (chunk_kda or naive_recurrent_kda); outputs and all gradients."""
    x = p.leaves()
    result = fn(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        initial_state=x["initial_state"],
        cu_seqlens=p.cu_seqlens,
        **kwargs,
    )
    o, final_state = result[0], result[1]
    return {"o": o, "final_state": final_state, **grads_of(o, final_state, p.do, p.dht, x)}


def run_fla(fla_fn, p: Problem, chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """fla's naive reference run on each packed sequence alone, results concatenated.

    naive_chunk_kda needs a multiple of chunk_size: the sequence is zero-padded at the end,
    which is exact (k = v = g = beta = 0 leaves the state as it is; padded outputs dropped).
    """
    dtype = p.q.dtype
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in ("o", "final_state", *INPUTS)}
    for n, (start, end) in enumerate(p.bounds):
        x = {name: p.inputs()[name][start:end] for name in INPUTS[:-1]}
        x["initial_state"] = p.initial_state[n : n + 1]
        x = {name: t.detach().clone().requires_grad_() for name, t in x.items()}
        batched = {name: x[name][None] for name in INPUTS[:-1]}
        kwargs = {}
        if chunk_size is not None:
            pad = (-(end - start)) % chunk_size
            batched = {
                name: torch.cat([t, t.new_zeros(1, pad, *t.shape[2:])], dim=1)
                for name, t in batched.items()
            }
            kwargs["chunk_size"] = chunk_size
        with fla_float64() if dtype == torch.float64 else nullcontext():
            o, final_state = fla_fn(
                **batched, initial_state=x["initial_state"], output_final_state=True, **kwargs
            )
        o = o[0, : end - start]
        assert o.dtype == dtype and final_state.dtype == dtype
        grads = grads_of(o, final_state[0], p.do[start:end], p.dht[n], x)
        outs["o"].append(o)
        outs["final_state"].append(final_state[0])
        for name in INPUTS:
            outs[name].append(grads[name])
    stacked = {"final_state": torch.stack(outs["final_state"])}
    stacked["initial_state"] = torch.cat(outs["initial_state"])
    for name in ("o", *INPUTS[:-1]):
        stacked[name] = torch.cat(outs[name])
    return stacked


def compare(label: str, ours: dict, ref: dict, tol: float) -> dict[str, float]:
    """assert_close on outputs, final states and every gradient; returns the errors."""
    errors = {}
    for name in ("o", "final_state", *INPUTS):
        key = name if name in ("o", "final_state") else f"d{name}"
        errors[key] = assert_close(f"{label} {key}", ours[name], ref[name], tol)
    return errors


# A float32 result is held to the float64 truth (fla's reference run in float64): within
# TOL[float32], or, on draws whose conditioning keeps float32 from that, within
# FLOAT32_FACTOR x the larger error of fla's two float32 forms (its naive recurrence and its
# naive chunk form, at 64) on the same draw. One token of one head: its beta gradient sums
# K x V terms that cancel; at lens [1], H 1, K 4, V 3 fla's float32 recurrence is 2.7e-5
# from float64, ours 4.5e-5 (chunk 16); at lens [1], H 1, K 4, V 8, seed 31, decay 0.3,
# fla's float32 recurrence 1.6e-4 and its chunk form 5.0e-6, ours 3.1e-5 (chunk 64). Either
# of fla's forms alone can be lucky on a draw; the worse of the two is what float32 gives.
FLOAT32_FACTOR = 4.0


def compare_float32(label: str, ours: dict, p: Problem, fla_fn, chunk_size: int | None = None) -> dict[str, float]:
    """Outputs, final states and every gradient of a float32 run (`ours`) against `fla_fn`
    in float64 on the same numbers, each within max(TOL[float32], FLOAT32_FACTOR x the
    larger float32 error of fla's naive recurrence and naive chunk form there); returns the
    errors."""
    forms = [(fla_kda_naive.naive_recurrent_kda, None), (fla_kda_naive.naive_chunk_kda, 64)]
    refs32 = {(fn, cs): (run_fla(fn, p, cs), run_fla(fn, p.to(torch.float64), cs)) for fn, cs in forms}
    ref64 = refs32[(fla_fn, chunk_size)][1] if (fla_fn, chunk_size) in refs32 else \
        run_fla(fla_fn, p.to(torch.float64), chunk_size)
    errors = {}
    for name in ("o", "final_state", *INPUTS):
        key = name if name in ("o", "final_state") else f"d{name}"
        float32_err = max(rel_err(r32[name], r64[name]) for r32, r64 in refs32.values())
        bound = max(TOL[torch.float32], FLOAT32_FACTOR * float32_err)
        errors[key] = assert_close(f"{label} {key}", ours[name], ref64[name], bound)
    return errors
