"""Host-to-device copies and host-side chunk bookkeeping (the GPU path's sync-free pieces)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from harts.exec.transfer import to_device


def test_to_device_keeps_values_and_converts_dtype_on_the_host():
    x = np.arange(7, dtype=np.int64)[::2]  # non-contiguous
    t = to_device(x, "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [0, 2, 4, 6]
    f = to_device(x, torch.device("cpu"), torch.float64)
    assert f.dtype == torch.float64 and f.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert to_device([1, 2], "cpu", torch.int32).dtype == torch.int32
    src = torch.arange(3)
    assert torch.equal(to_device(src, "cpu"), src)


@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.sampled_from([16, 64]))
def test_chunk_index_pairs_equal_fla_prepare_chunk_indices(lengths, chunk_size):
    from fla.ops.utils import prepare_chunk_indices

    from harts.exec.ops.kda.fla import chunk_index_pairs

    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ours = chunk_index_pairs(cu, chunk_size)
    theirs = prepare_chunk_indices(torch.from_numpy(cu), chunk_size).numpy()
    assert ours.dtype == np.int64 and ours.shape == (theirs.shape[0], 2)
    assert np.array_equal(ours, theirs)
