"""Tree attention's registry: on CUDA where FlexAttention imports, `FastTreeAttention`
(`tree.py`), which picks among the fast paths per call (cuDNN graph, cuDNN per segment,
varlen flash, flex); otherwise the context's dense-mask reference (`naive.py`).

Calling convention of the reference and every fast path: (q_local_C, end_L, parent_L,
q_local_host, *, kernels, record) -> the attention object every layer of a layout calls,
or None where the context runs the dense-mask reference itself.
"""

from __future__ import annotations

import functools

from harts.config.kernels import Impl
from harts.exec.ops.registry import FastPath, OpRegistry


@functools.cache
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def run_reference(q_local_C, end_L, parent_L=None, q_local_host=None, *, kernels, record):
    return None


def run_fast(q_local_C, end_L, parent_L=None, q_local_host=None, *, kernels, record):
    from harts.exec.ops.attention.tree import FastTreeAttention

    return FastTreeAttention(q_local_C, end_L, parent_L, q_local_host, kernels=kernels, record=record)


TREE_ATTENTION = OpRegistry("tree_attention", run_reference)
# FLEX stands for the fast paths together: FastTreeAttention picks among them
TREE_ATTENTION.register(FastPath(Impl.FLEX, run_fast, installed=flex_available))
