"""Host-side pieces of the cuDNN graph attention (`harts.exec.ops.attention.cudnn_graph`): ragged
offsets, padded-row maps and shape buckets. The kernel itself needs CUDA and the cuDNN
frontend; it checks itself against the float64 reference before first use (on the GPU:
tests/cuda/test_attention.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.exec.ops.attention import cudnn_graph


@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(1, 4096), st.integers(1, 2))
def test_padded_rows_and_ragged_offsets(lengths, S_extra, token_stride):
    cu = np.r_[0, np.cumsum(lengths)]
    S = max(lengths) + S_extra - 1
    rows = cudnn_graph.padded_rows(cu, S)
    assert rows.size == cu[-1]
    # row t of sequence b at position s lands at b * S + s: distinct, inside [0, B * S)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(rows[cu[b]:cu[b + 1]], b * S + np.arange(n))
    assert np.unique(rows).size == rows.size and (rows < len(lengths) * S).all()
    off = cudnn_graph.ragged_metadata(cu, token_stride * 192)
    assert off.dtype == np.int32
    np.testing.assert_array_equal(off, cu * token_stride * 192)


def test_ragged_offsets_refuse_int32_overflow():
    with pytest.raises(ValueError, match="int32"):
        cudnn_graph.ragged_metadata(np.array([0, 2 ** 22]), 16 * 192)


@given(st.integers(0, 1_000_000))
def test_bucket_len_holds_n_within_a_quarter_and_few_values(n):
    b = cudnn_graph.bucket_len(n)
    assert b >= max(n, 1) and b % 64 == 0
    assert b <= max(cudnn_graph.S_ROUND, 1.25 * n)
    assert cudnn_graph.bucket_len(b) == b  # a bucket is its own bucket


def test_bucket_len_values_per_octave():
    # four bounds per octave: a run's layouts share few graphs
    values = {cudnn_graph.bucket_len(n) for n in range(1, 65_537)}
    assert len(values) == 4 * 8 + 1  # 256..65536


@given(st.integers(1, 5000))
def test_bucket_batch_and_padding(B):
    b = cudnn_graph.bucket_batch(B)
    assert b >= B and (b % 8 == 0) and (b - B < 8 if B <= 64 else b <= 1.5 * B)
    assert cudnn_graph.bucket_batch(b) == b
    cu = np.r_[0, np.cumsum(np.arange(B) % 5)]
    padded = cudnn_graph.pad_batch(cu, b)
    assert padded.size == b + 1
    np.testing.assert_array_equal(padded[:cu.size], cu)
    assert (np.diff(padded)[B:] == 0).all()  # empty sequences after the real ones


def test_unavailable_without_cuda():
    # CPU-only machines (CI) never reach the frontend
    import torch

    if not torch.cuda.is_available():
        assert not cudnn_graph.available()
