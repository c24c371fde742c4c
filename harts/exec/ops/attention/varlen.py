"""Ancestor attention as one variable-length causal attention call over root-to-row paths.

Legend: L local rows (keys), C query rows, H heads, D qk dim, E value dim, S query
segments, Tk gathered key rows.

In the DFS layout a query row attends its ancestors and itself. Cut the query rows into
segments: maximal runs of consecutive query rows in which each row is a child of the
previous one (in DFS order that is the previous row's first child; a jump in the DFS order,
i.e. a later sibling, or a context/query boundary starts a new segment). A segment thus
runs from a row down its first-child chain to a leaf, so there are about as many segments
as leaves, and a fork's first branch continues its parent's segment instead of gathering
the parent's path again. For a segment with n rows whose first row's ancestors are the path P (root
first), every query i of the segment attends exactly P followed by the segment's rows
0..i. So the segment is one sequence of a packed attention call with queries = its n rows
and keys = P + its rows (m = |P| + n keys), causal with the diagonal aligned to the bottom
right: query i sees keys 0..m-n+i. A single varlen call (flash attention) then computes
every attended (query, key) pair exactly once, with no masked-out work, which is what
FlexAttention's block-sparse kernel at qk dim 192 (rounded up to 256 inside) cannot match
(measured on an H200: Flex 1.7-2.7x SDPA per attended pair).

The price is the key/value gather: the segments' paths hold Tk = sum of (|P| + n) rows
(for swe-treestep-1: 361k for 82k compact rows, its expanded token count; 641k when every
fork ended a segment), a transient copy per layer. The gather's backward accumulates the
gradients of a key row's copies in fp32 (index_add into an fp32 buffer), then rounds once.

`segments_of` is host-side numpy over the local parent array, O(L + S * depth).
`path_attention` takes the varlen kernel as an argument: `flash_varlen` (CUDA, bf16/fp16,
torch's flash-attention varlen) or `reference_varlen` (any device and dtype, float64
included: per segment, dense scores with the bottom-right causal mask), which is how CPU
tests check the decomposition against the dense ancestor mask.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from harts.exec.transfer import to_device


@dataclass(frozen=True)
class PathSegments:
    cu_q: np.ndarray  # int64 [S + 1]: segment boundaries in query order
    cu_k: np.ndarray  # int64 [S + 1]: boundaries of each segment's gathered keys
    key_rows: np.ndarray  # int64 [Tk]: local key row of each gathered key
    max_q: int
    max_k: int

    @property
    def num_segments(self) -> int:
        return int(self.cu_q.size - 1)

    @property
    def attended_pairs(self) -> int:
        """(query, key) pairs attended: each segment's n queries see its a = m - n ancestors
        and a causal triangle of its own rows."""
        n = np.diff(self.cu_q)
        return int(((np.diff(self.cu_k) - n) * n + n * (n + 1) // 2).sum())


def segments_of(parent_L: np.ndarray, q_local_C: np.ndarray | None = None) -> PathSegments:
    """The query segments and their gathered key rows (see the module docstring).

    parent_L: local parent of each row (-1 for roots), rows in DFS order (a parent before
    its children, every subtree contiguous); q_local_C: ascending local rows that are
    queries (None = all rows).
    """
    parent = np.asarray(parent_L, dtype=np.int64)
    L = parent.size
    is_q = np.ones(L, bool) if q_local_C is None else np.zeros(L, bool)
    if q_local_C is not None:
        is_q[np.asarray(q_local_C, np.int64)] = True
    idx = np.arange(L)
    # chains over all rows: r continues r-1's chain iff r-1 is r's parent (r is then its
    # first child; later siblings start chains of their own)
    cont = np.zeros(L, bool)
    if L > 1:
        cont[1:] = parent[1:] == idx[1:] - 1
    chain_first = np.flatnonzero(~cont)
    chain_of = np.cumsum(~cont) - 1
    # per chain: the ranges (first, last-row-on-path) of its ancestors' chains, root first.
    # A chain's first row's parent p may sit anywhere in its chain: the path takes that
    # chain's rows up to p.
    anc_ranges: list[list[tuple[int, int]]] = []
    for f in chain_first.tolist():
        p = int(parent[f])
        if p < 0:
            anc_ranges.append([])
        else:
            pc = int(chain_of[p])
            anc_ranges.append(anc_ranges[pc] + [(int(chain_first[pc]), p)])
    # query segments: runs of query rows inside one chain
    q_start = is_q & ~(np.r_[False, is_q[:-1]] & cont) if L else np.zeros(0, bool)
    seg_first = np.flatnonzero(q_start)
    q_rows = np.flatnonzero(is_q)
    # each segment ends where the next segment starts (in query order)
    seg_pos = np.searchsorted(q_rows, seg_first)
    cu_q = np.r_[seg_pos, q_rows.size].astype(np.int64)
    parts: list[np.ndarray] = []
    cu_k = [0]
    for s, f in enumerate(seg_first.tolist()):
        last = int(q_rows[cu_q[s + 1] - 1])
        c = int(chain_of[f])
        ranges = anc_ranges[c] + [(int(chain_first[c]), last)]
        for a, b in ranges:
            parts.append(np.arange(a, b + 1, dtype=np.int64))
        cu_k.append(cu_k[-1] + sum(b - a + 1 for a, b in ranges))
    key_rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    cu_k_arr = np.asarray(cu_k, np.int64)
    max_q = int(np.diff(cu_q).max()) if seg_first.size else 0
    max_k = int(np.diff(cu_k_arr).max()) if seg_first.size else 0
    return PathSegments(cu_q, cu_k_arr, key_rows, max_q, max_k)


class _GatherRows(torch.autograd.Function):
    """x[index] whose backward sums the copies' gradients in at least fp32 (then rounds once)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        wide = torch.promote_types(grad.dtype, torch.float32)  # fp32 for bf16/fp16, else as is
        acc = torch.zeros(ctx.rows, *grad.shape[1:], dtype=wide, device=grad.device)
        acc.index_add_(0, index, grad.to(wide))
        return acc.to(grad.dtype), None


def reference_varlen(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu_q: np.ndarray, cu_k: np.ndarray,
                     max_q: int, max_k: int, scale: float) -> Tensor:
    """Per segment: dense scores, bottom-right-aligned causal mask (any device and dtype)."""
    outs = []
    for s in range(cu_q.size - 1):
        q = q_THD[cu_q[s]:cu_q[s + 1]].transpose(0, 1)
        k = k_THD[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        v = v_THD[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        n, m = q.shape[1], k.shape[1]
        allowed = torch.arange(m, device=q.device)[None, :] <= (m - n + torch.arange(n, device=q.device))[:, None]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1))
    return torch.cat(outs) if outs else q_THD.new_zeros(0, *q_THD.shape[1:-1], v_THD.shape[-1])


@functools.cache
def _varlen_api():
    """torch's public varlen flash attention and how it spells causal, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - older torch: no varlen API
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0)}
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True}
    return None


def flash_varlen_available() -> bool:
    return _varlen_api() is not None


def flash_varlen(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu_q: np.ndarray, cu_k: np.ndarray,
                 max_q: int, max_k: int, scale: float) -> Tensor:
    """torch's flash-attention varlen (CUDA, bf16/fp16); causal is bottom-right aligned when
    a sequence has fewer queries than keys (flash-attention >= 2.1), which the GPU checks
    verify against the dense mask."""
    api = _varlen_api()
    if api is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn")
    fn, causal = api
    dev = q_THD.device
    cq = to_device(cu_q, dev, torch.int32)
    ck = to_device(cu_k, dev, torch.int32)
    return fn(q_THD, k_THD, v_THD, cq, ck, max_q, max_k, scale=scale, **causal)


def path_attention(q_CHD: Tensor, k_LHD: Tensor, v_LHE: Tensor, scale: float, segments: PathSegments,
                   kernel=reference_varlen, key_rows: Tensor | None = None) -> Tensor:
    """o_CHE: each query row attends its ancestors and itself (queries in ascending local order).

    Values are zero-padded to the qk dim when smaller and the kernel needs it (flash needs
    one head dim; the padding columns of the output are exactly zero and dropped; a kernel
    with `pads_values = False`, cuDNN's graph, takes them as they are)."""
    D, E = q_CHD.shape[-1], v_LHE.shape[-1]
    if key_rows is None:
        key_rows = to_device(segments.key_rows, q_CHD.device)
    pad = getattr(kernel, "pads_values", True) and E < D
    v_pad = F.pad(v_LHE, (0, D - E)) if pad else v_LHE
    k_g = _GatherRows.apply(k_LHD, key_rows)
    v_g = _GatherRows.apply(v_pad, key_rows)
    o = kernel(q_CHD, k_g, v_g, segments.cu_q, segments.cu_k, segments.max_q, segments.max_k, scale)
    return o[..., :E]
