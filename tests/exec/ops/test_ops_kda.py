"""KDA ops against fla-core's independent naive references, and the chunk-grid properties the
tree executor relies on (boundary states, hand-off at chunk boundaries).

Worst errors seen per comparison are printed at the end of the module (run with -s).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from fla.ops.kda.naive import naive_chunk_kda as fla_naive_chunk_kda
from fla.ops.kda.naive import naive_recurrent_kda as fla_naive_recurrent_kda
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.exec.ops.kda import KDAOutput, chunk_kda, naive_recurrent_kda
from harts.testing import assert_close
from tests.exec.ops.kda_reference import (
    INPUTS,
    TOL,
    compare,
    compare_float32,
    make_problem,
    run_fla,
    run_ours,
)
from tests.strategies import kda_problem_shapes

DTYPES = [torch.float64, torch.float32]
WORST: dict[str, float] = defaultdict(float)


@pytest.fixture(scope="module", autouse=True)
def _few_threads_and_report():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    print("\nworst errors seen (relative RMS unless labelled):")
    for key in sorted(WORST):
        print(f"  {key:60s} {WORST[key]:.2e}")


def _record(label: str, errors: dict[str, float]) -> None:
    for name, err in errors.items():
        WORST[f"{label} {name}"] = max(WORST[f"{label} {name}"], err)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_name)
@given(data=st.data())
def test_naive_recurrent_matches_fla(dtype, data):
    lens, H, K, V, seed, decay = data.draw(kda_problem_shapes(dtype, max_len=80))
    p = make_problem(lens, H, K, V, seed, dtype, decay)
    ours = run_ours(naive_recurrent_kda, p)
    assert ours["o"].dtype == dtype and ours["final_state"].dtype == dtype
    _record(
        f"naive_recurrent vs fla recurrent {_dtype_name(dtype)}",
        compare("naive", ours, run_fla(fla_naive_recurrent_kda, p), TOL[dtype]) if dtype == torch.float64
        else compare_float32("naive", ours, p, fla_naive_recurrent_kda),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_name)
@given(data=st.data(), chunk_size=st.sampled_from([16, 64]))
def test_chunk_matches_fla_recurrent(dtype, data, chunk_size):
    lens, H, K, V, seed, decay = data.draw(kda_problem_shapes(dtype, max_len=80))
    p = make_problem(lens, H, K, V, seed, dtype, decay)
    ours = run_ours(chunk_kda, p, chunk_size=chunk_size)
    assert ours["o"].dtype == dtype and ours["final_state"].dtype == dtype
    _record(
        f"chunk_kda vs fla recurrent {_dtype_name(dtype)}",
        compare("chunk", ours, run_fla(fla_naive_recurrent_kda, p), TOL[dtype]) if dtype == torch.float64
        else compare_float32("chunk", ours, p, fla_naive_recurrent_kda),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_name)
@given(data=st.data())
def test_chunk_matches_fla_chunk(dtype, data):
    # chunk 64 with lengths up to 150: under one chunk, and several with a ragged tail
    lens, H, K, V, seed, decay = data.draw(kda_problem_shapes(dtype, max_len=150, max_seqs=2))
    # against fla's naive chunk form in float64 on the same numbers; a float32 run as the
    # other float32 comparisons hold it (`compare_float32`): one token of one head has a
    # beta gradient of K x V cancelling terms (lens [1], H 1, K 4, V 8, seed 31, decay 0.3:
    # ours 3.1e-5 from the float64 truth), where fla's own float32 form is not within 1e-5
    p = make_problem(lens, H, K, V, seed, dtype, decay)
    ours = run_ours(chunk_kda, p, chunk_size=64)
    _record(
        f"chunk_kda vs fla chunk {_dtype_name(dtype)}",
        compare("chunk", ours, run_fla(fla_naive_chunk_kda, p, chunk_size=64), TOL[dtype]) if dtype == torch.float64
        else compare_float32("chunk", ours, p, fla_naive_chunk_kda, chunk_size=64),
    )


def test_defaults_and_empty_sequences():
    # no cu_seqlens / initial_state / scale; and zero-length sequences keep their state
    p = make_problem([37], 2, 8, 4, seed=1, dtype=torch.float64)
    out = chunk_kda(p.q, p.k, p.v, p.g, p.beta, chunk_size=16)
    o_ref, s_ref = naive_recurrent_kda(p.q, p.k, p.v, p.g, p.beta)
    assert isinstance(out, KDAOutput) and out.chunk_states is None
    assert_close("o", out.o, o_ref, 1e-12)
    assert_close("final_state", out.final_state, s_ref, 1e-12)
    assert chunk_kda(p.q, p.k, p.v, p.g, p.beta, output_final_state=False).final_state is None

    h0 = torch.randn(3, 2, 8, 4, dtype=torch.float64)
    cu = torch.tensor([0, 0, 37, 37])
    out = chunk_kda(
        p.q,
        p.k,
        p.v,
        p.g,
        p.beta,
        initial_state=h0,
        cu_seqlens=cu,
        chunk_size=16,
        output_chunk_states=True,
    )
    assert torch.equal(out.final_state[0], h0[0]) and torch.equal(out.final_state[2], h0[2])
    assert out.chunk_state_offsets.tolist() == [0, 0, 2, 2]
    o_ref, s_ref = naive_recurrent_kda(p.q, p.k, p.v, p.g, p.beta, initial_state=h0, cu_seqlens=cu)
    assert_close("o", out.o, o_ref, 1e-12)
    assert_close("final_state", out.final_state, s_ref, 1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_name)
@given(data=st.data())
def test_chunk_states_are_prefix_final_states(dtype, data):
    """Row offsets[i] + j is the state after the first (j+1)*B tokens of sequence i: the same
    bits as running that prefix alone, and (checked in float64, where summation order does
    not blur the comparison) the same gradient in every input."""
    lens, H, K, V, seed, decay = data.draw(kda_problem_shapes(dtype, max_len=70))
    B = 16
    p = make_problem(lens, H, K, V, seed, dtype, decay)
    x = p.leaves()
    out = chunk_kda(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        initial_state=x["initial_state"],
        cu_seqlens=p.cu_seqlens,
        chunk_size=B,
        output_chunk_states=True,
    )
    offsets = out.chunk_state_offsets
    assert offsets.dtype == torch.int64
    assert offsets.tolist() == [0, *torch.tensor([n // B for n in lens]).cumsum(0).tolist()]
    assert out.chunk_states.shape == (int(offsets[-1]), H, K, V)
    if not out.chunk_states.numel():
        return
    weights = torch.randn(
        out.chunk_states.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    ).to(dtype)
    y = p.leaves()
    loss = 0.0
    for i, (start, _) in enumerate(p.bounds):
        for j in range(lens[i] // B):
            end = start + (j + 1) * B
            prefix = chunk_kda(
                y["q"][start:end],
                y["k"][start:end],
                y["v"][start:end],
                y["g"][start:end],
                y["beta"][start:end],
                initial_state=y["initial_state"][i : i + 1],
                chunk_size=B,
            )
            row = int(offsets[i]) + j
            assert torch.equal(out.chunk_states[row], prefix.final_state[0])
            loss = loss + (prefix.final_state[0] * weights[row]).sum()
    if dtype != torch.float64:
        return
    grads = torch.autograd.grad(
        (out.chunk_states * weights).sum(), list(x.values()), materialize_grads=True
    )
    ref_grads = torch.autograd.grad(loss, list(y.values()), materialize_grads=True)
    for name, got, ref in zip(y, grads, ref_grads, strict=True):
        if name == "q":
            # states do not depend on the queries
            assert not got.any() and not ref.any()
        else:
            assert_close(f"d{name} through chunk_states", got, ref, TOL[dtype])


@settings(max_examples=15)
@given(data=st.data(), as_tensor=st.booleans())
def test_chunk_state_index_selects_states_and_their_gradients(data, as_tensor):
    """With a chunk_state_index the call returns exactly those rows of the full list (any
    order, repeats allowed), and every gradient equals the full call's with the same
    cotangents on the selected rows (float64)."""
    lens, H, K, V, seed, decay = data.draw(kda_problem_shapes(torch.float64, max_len=70))
    B = 16
    p = make_problem(lens, H, K, V, seed, torch.float64, decay)
    num_states = sum(n // B for n in lens)
    index = data.draw(st.lists(st.integers(0, num_states - 1), max_size=6)) if num_states else []
    index_arg = torch.tensor(index, dtype=torch.int64) if as_tensor else np.asarray(index, np.int64)
    x, y = p.leaves(), p.leaves()
    kw = dict(cu_seqlens=p.cu_seqlens, chunk_size=B, output_chunk_states=True)
    full = chunk_kda(*(x[n] for n in INPUTS[:5]), initial_state=x["initial_state"], **kw)
    part = chunk_kda(*(y[n] for n in INPUTS[:5]), initial_state=y["initial_state"], chunk_state_index=index_arg, **kw)
    assert torch.equal(part.o, full.o) and torch.equal(part.final_state, full.final_state)
    assert torch.equal(part.chunk_state_offsets, full.chunk_state_offsets)
    assert part.chunk_states.shape == (len(index), H, K, V)
    assert torch.equal(part.chunk_states, full.chunk_states[torch.tensor(index, dtype=torch.int64)])
    weights = torch.randn(len(index), H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))

    def loss(out, states):
        return (out.o * p.do).sum() + (out.final_state * p.dht).sum() + (states * weights).sum()

    want = torch.autograd.grad(loss(full, full.chunk_states[torch.tensor(index, dtype=torch.int64)]), list(x.values()))
    got = torch.autograd.grad(loss(part, part.chunk_states), list(y.values()))
    for name, a, b in zip(x, got, want, strict=True):
        assert_close(f"d{name} with chunk_state_index", a, b, TOL[torch.float64])


def test_chunk_state_index_is_checked():
    p = make_problem([40], 1, 4, 2, seed=2, dtype=torch.float64)
    args = (p.q, p.k, p.v, p.g, p.beta)
    with pytest.raises(ValueError, match="output_chunk_states"):
        chunk_kda(*args, chunk_size=16, chunk_state_index=np.array([0]))
    with pytest.raises(IndexError):
        chunk_kda(*args, chunk_size=16, output_chunk_states=True, chunk_state_index=np.array([2]))
    with pytest.raises(IndexError):
        chunk_kda(*args, chunk_size=16, output_chunk_states=True, chunk_state_index=torch.tensor([-1]))
    empty = chunk_kda(*args, chunk_size=16, output_chunk_states=True, chunk_state_index=np.zeros(0, np.int64))
    assert empty.chunk_states.shape == (0, 1, 4, 2)


@given(
    shape=kda_problem_shapes(torch.float32, max_len=40),
    num_chunks=st.integers(1, 3),
    tail=st.integers(1, 40),
    offset=st.integers(1, 15),
)
@settings(max_examples=15)
def test_split_at_chunk_boundary_is_bit_identical(shape, num_chunks, tail, offset):
    """Split sequence 0 at a chunk boundary, hand its boundary state (from chunk_states) to a
    second call packed with different neighbours: float32 outputs and final state are the same
    bits as the unsplit run, and gradients flow back through the handed-over state.
    Splitting mid-chunk (same lengths, cut `offset` tokens later) is only close: printed."""
    lens, H, K, V, seed, decay = shape
    B = 16
    cut = num_chunks * B
    lens = [cut + tail, *lens]
    p = make_problem(lens, H, K, V, seed, torch.float32, decay)
    x = p.leaves()
    do, dht = p.do, p.dht
    whole = chunk_kda(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        initial_state=x["initial_state"],
        cu_seqlens=p.cu_seqlens,
        chunk_size=B,
    )
    ref_grads = torch.autograd.grad(
        (whole.o * do).sum() + (whole.final_state * dht).sum(), list(x.values())
    )

    # call 1: sequence 0's head alone; call 2: its tail packed after the other sequences
    y = p.leaves()
    L0 = lens[0]
    head = chunk_kda(
        y["q"][:cut],
        y["k"][:cut],
        y["v"][:cut],
        y["g"][:cut],
        y["beta"][:cut],
        initial_state=y["initial_state"][:1],
        chunk_size=B,
        output_chunk_states=True,
    )
    order = torch.cat([torch.arange(L0, sum(lens)), torch.arange(cut, L0)])
    cu2 = torch.tensor([0, *torch.tensor(lens[1:] + [tail]).cumsum(0).tolist()])
    h2 = torch.cat([y["initial_state"][1:], head.chunk_states[-1:]])
    rest = chunk_kda(
        y["q"][order],
        y["k"][order],
        y["v"][order],
        y["g"][order],
        y["beta"][order],
        initial_state=h2,
        cu_seqlens=cu2,
        chunk_size=B,
    )
    o_split = torch.empty_like(whole.o)
    o_split[:cut] = head.o
    o_split[order] = rest.o
    final_split = torch.cat([rest.final_state[-1:], rest.final_state[:-1]])
    assert torch.equal(o_split, whole.o)
    assert torch.equal(final_split, whole.final_state)
    split_grads = torch.autograd.grad(
        (o_split * do).sum() + (final_split * dht).sum(), list(y.values())
    )
    for name, got, ref in zip(y, split_grads, ref_grads, strict=True):
        err = assert_close(f"d{name} split at boundary", got, ref, TOL[torch.float32])
        WORST[f"split at chunk boundary float32 d{name}"] = max(
            WORST[f"split at chunk boundary float32 d{name}"], err
        )

    mid = cut + min(offset, tail)
    first = chunk_kda(
        p.q[:mid],
        p.k[:mid],
        p.v[:mid],
        p.g[:mid],
        p.beta[:mid],
        initial_state=p.initial_state[:1],
        chunk_size=B,
    )
    second = chunk_kda(
        p.q[mid:L0],
        p.k[mid:L0],
        p.v[mid:L0],
        p.g[mid:L0],
        p.beta[mid:L0],
        initial_state=first.final_state,
        chunk_size=B,
    )
    o_mid = torch.cat([first.o, second.o])
    for key, got, ref in (
        ("o", o_mid, whole.o[:L0]),
        ("final_state", second.final_state, whole.final_state[:1]),
    ):
        err = (got - ref).abs().max().item()
        WORST[f"split mid-chunk float32 max abs diff {key}"] = max(
            WORST[f"split mid-chunk float32 max abs diff {key}"], err
        )
