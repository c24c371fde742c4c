"""Ancestor attention as two ordinary attention calls per segment merged by log-sum-exp.

Legend: C query rows, L local rows (keys), H heads, D qk dim, E value dim.

`path_attention` needs a causal mask aligned to the *bottom right* (a segment's queries
are the last rows of its key sequence). torch's flash varlen kernel has that, but needs
one head dim for q, k and v, so MLA's values (128) are padded to the qk dim (192). cuDNN's
SDPA takes 192 / 128 as they are and is the fastest attention on the H200 at this shape
(causal 32k x 16 heads: 39 ms forward+backward against 61 ms with padded values and 82 ms
for flash varlen; benchmarks/results/attention/2026-11-29-9006abf-attnprobe.json), but its
varlen entry aligns causal masks top-left. So split each query segment (see `varlen.segments_of`) into

  part A: its n queries x the a rows of its ancestor path, no mask (a rectangle);
  part B: its n queries x its own n rows, causal (a square, where top-left and
          bottom-right alignment coincide; its keys are the queries' own rows).

Both are plain varlen calls. The softmax over the union follows from the parts' outputs
and log-sum-exps: lse = logaddexp(lse_A, lse_B), o = o_A exp(lse_A - lse) + o_B
exp(lse_B - lse) (rows with no ancestors take part B as is). In the backward each part's
kernel, given the *merged* o and lse, returns that part's exact share of dq, dk and dv:
the probabilities exp(s - lse) and the row term rowsum(dO * o) are those of the union
(the identity ring attention relies on). Every attended pair is computed once; only the
ancestor keys are gathered (for swe-treestep-1: 280k rows instead of the 361k a gather of
whole paths takes).

`path_split_attention` keeps this backward but takes the forward from one bottom-right
call over the segments' root-to-row paths (`path_attention`'s layout), whose per-row bits
are the expanded baseline's when both run cuDNN's graph kernel (`cudnn_graph`): the
backward needs only the union's o and lse, whichever forward produced them. Because
part A's pairs only need partitioning, not a per-query merge, the backward may group them
by key instead (`piece_segments`: one rectangle per run of rows the same segments attend),
which makes cuDNN's backward, parallel over key blocks, efficient where short branches
share a long prompt.

Kernels (`VarlenKernel`): `REFERENCE` (float64-capable, any device: dense math per
sequence, forward and the explicit backward formulas) is how CPU tests check the merge
against the dense ancestor mask. `cudnn_kernel()` (default variant "dense-strided") runs
torch's private `_scaled_dot_product_cudnn_attention` and its backward once per sequence,
the kernel `scaled_dot_product_attention` itself picks, on [1, H, n, D] views of the rows
(variant "dense" copies them first: on the H200 the views took a whole SWE tree from 1.33x
to 1.25x causal SDPA's time per pair,
benchmarks/results/attention/2026-11-29-46fd948-attnvar.json); sequences under
`MIN_CUDNN_ROWS` take the reference's math. Variant "ragged" (`_cudnn_attention_forward`
with cumulative lengths, one call for all sequences) is kept for when torch fixes it: on
torch 2.11 / the H200 its backward is wrong on any sequence longer than the head dim
(pytorch/pytorch#186142; right at <= 192 query rows, also with long keys). Every variant checks
itself against the reference on first use (log-sum-exp layout and base, outputs, every
gradient, short and long sequences) and raises on a mismatch, so callers fall back
rather than train on wrong numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from harts.exec.ops.attention import triangles
from harts.exec.ops.attention.kernel import REFERENCE, REFERENCE_BOTTOM_RIGHT, VarlenKernel, _case  # noqa: F401
from harts.exec.ops.attention.varlen import PathSegments
from harts.exec.transfer import to_device


@dataclass(frozen=True)
class SplitSegments:
    """What the two calls read, derived from a `PathSegments` (host numpy)."""

    cu_q: np.ndarray  # part B: query segments (keys are the queries' own rows)
    max_q: int
    own_rows: np.ndarray | None  # local rows of the queries (None: all rows, in order)
    qa_index: np.ndarray  # part A: query indices of segments with ancestors (ascending)
    cu_qa: np.ndarray
    anc_rows: np.ndarray  # part A: gathered ancestor key rows
    cu_ka: np.ndarray
    max_qa: int
    max_ka: int
    # False where part A's rectangles share query rows (`piece_segments`): valid for the
    # backward only (each part's share is per pair; the forward's merge needs each query once)
    qa_unique: bool = True

    @property
    def has_ancestors(self) -> bool:
        return self.qa_index.size > 0


def split_segments(seg: PathSegments, all_rows_are_queries: bool) -> SplitSegments:
    n = np.diff(seg.cu_q)
    m = np.diff(seg.cu_k)
    a = m - n
    own = [seg.key_rows[seg.cu_k[s] + a[s]: seg.cu_k[s + 1]] for s in range(n.size)]
    own_rows = None if all_rows_are_queries else (np.concatenate(own) if own else np.zeros(0, np.int64))
    with_anc = np.flatnonzero(a > 0)
    qa = [np.arange(seg.cu_q[s], seg.cu_q[s + 1], dtype=np.int64) for s in with_anc]
    anc = [seg.key_rows[seg.cu_k[s]: seg.cu_k[s] + a[s]] for s in with_anc]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return SplitSegments(
        cu_q=seg.cu_q, max_q=int(n.max()) if n.size else 0, own_rows=own_rows,
        qa_index=cat(qa), cu_qa=np.r_[0, np.cumsum(n[with_anc])].astype(np.int64), anc_rows=cat(anc),
        cu_ka=np.r_[0, np.cumsum(a[with_anc])].astype(np.int64),
        max_qa=int(n[with_anc].max()) if with_anc.size else 0, max_ka=int(a[with_anc].max()) if with_anc.size else 0)


def piece_segments(seg: PathSegments, all_rows_are_queries: bool) -> SplitSegments:
    """The split with part A grouped by *key piece* rather than by query segment, for the
    backward only (`path_split_attention`).

    Part A's pairs are (query, ancestor key) pairs. `split_segments` groups them by query
    segment: each segment's n queries x its whole ancestor path. Where segments are short
    and paths long (branches off a long prompt) those rectangles are short and wide, and
    cuDNN's backward, which gives each block of 64 keys to one program looping over the
    query tiles, runs many programs of a few tiles each (on the H200, ~1.5x causal SDPA's
    time per pair). Here the pairs are grouped by key instead: a piece is a maximal run of
    consecutive key rows attended by the same segments, and in the DFS layout those
    segments are consecutive (the queries in a row's subtree past its own segment), so a
    piece's rectangle is (those segments' queries) x (its rows): tall where a prompt is
    shared, each key row in one rectangle (for swe-treestep-1: 75k gathered keys instead
    of 280k, 61k gathered queries instead of 43k). Query rows then repeat across
    rectangles (`qa_unique` False): the backward's shares sum over them like the keys'.
    Part B (each segment's causal square) is `split_segments`'s. Falls back to it if a
    key's segments are not consecutive (not a DFS layout)."""
    base = split_segments(seg, all_rows_are_queries)
    if not base.has_ancestors:
        return base
    n = np.diff(seg.cu_q)
    a = np.diff(seg.cu_k) - n
    with_anc = np.flatnonzero(a > 0)
    seg_id = np.repeat(with_anc, a[with_anc])  # the segment of each ancestor entry (base.anc_rows order)
    rows = int(base.anc_rows.max()) + 1
    lo = np.full(rows, np.iinfo(np.int64).max, np.int64)
    hi = np.full(rows, -1, np.int64)
    np.minimum.at(lo, base.anc_rows, seg_id)
    np.maximum.at(hi, base.anc_rows, seg_id)
    count = np.bincount(base.anc_rows, minlength=rows)
    keys = np.flatnonzero(count)
    lo, hi, count = lo[keys], hi[keys], count[keys]
    if not (count == hi - lo + 1).all():
        return base
    # pieces: runs of consecutive rows with the same (first, last) attending segment
    new = np.r_[True, (np.diff(keys) != 1) | (np.diff(lo) != 0) | (np.diff(hi) != 0)]
    start = np.flatnonzero(new)
    size = np.diff(np.r_[start, keys.size])
    q0, q1 = seg.cu_q[lo[start]], seg.cu_q[hi[start] + 1]
    nq = q1 - q0
    qa = np.repeat(q0 - np.cumsum(np.r_[0, nq])[:-1], nq) + np.arange(int(nq.sum()), dtype=np.int64)
    return dataclasses.replace(
        base, qa_index=qa, cu_qa=np.r_[0, np.cumsum(nq)].astype(np.int64), anc_rows=keys,
        cu_ka=np.r_[0, np.cumsum(size)].astype(np.int64), max_qa=int(nq.max()), max_ka=int(size.max()),
        qa_unique=False)


class _CuDNN(VarlenKernel):
    """torch's private cuDNN varlen SDPA ops ([T, H, D] rows, int32 cumulative lengths)."""

    name = "cudnn"

    def __init__(self):
        self.lse_from_native = None  # set by the self-check
        self.lse_to_native = None
        self.bias_arg = None
        self.lse_layout = None

    @staticmethod
    def _cu(cu, dev):
        return to_device(cu, dev, torch.int32)

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        cq, ck = self._cu(cu_q, q.device), self._cu(cu_k, q.device)
        r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cq, ck, int(max_q), int(max_k), True, 0.0,
                                                    bool(causal), False, scale=scale)
        o, lse_native, seed, offset = r[0], r[1], r[6], r[7]
        return o, self.lse_from_native(lse_native, T=q.shape[0], H=q.shape[1]), (seed, offset, cq, ck, lse_native)

    def bwd(self, do, q, k, v, o, lse, aux, cu_q, cu_k, max_q, max_k, causal, scale):
        seed, offset, cq, ck, like = aux
        native = self.lse_to_native(lse, like)
        return torch.ops.aten._cudnn_attention_backward(
            do.contiguous(), q, k, v, o.contiguous(), native, seed, offset, self.bias_arg(q), cq, ck, int(max_q),
            int(max_k), 0.0, bool(causal), scale=scale)


class _CuDNNDense(VarlenKernel):
    """torch's private dense cuDNN SDPA ops, one call per sequence ([1, H, n, D] each).
    The ragged (varlen) cuDNN entry fails on long sequences on the H200 (see
    `cudnn_kernel`); the dense one is the kernel `scaled_dot_product_attention` runs, so
    a layout with few long segments (a tree's first-child chains) pays a handful of calls."""

    name = "cudnn-dense"

    def __init__(self, strided: bool = False):
        self.factor = None  # log-sum-exp base, set by the self-check
        # strided: hand cuDNN [1, H, n, D] *views* of the [n, H, D] rows (the layout a
        # model's [B, S, H, D] -> transpose(1, 2) gives SDPA) instead of contiguous copies
        self.strided = strided
        if strided:
            self.name = "cudnn-dense-strided"

    def _bhsd(self, x):
        x = x.transpose(0, 1).unsqueeze(0)
        return x if self.strided else x.contiguous()

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        outs, lses, aux = [], [], []
        for s in range(cu_q.size - 1):
            a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            if min(b - a, d - c) < MIN_CUDNN_ROWS:  # a few rows: the reference's dense math
                o_s, lse_s, _ = REFERENCE.fwd(q[a:b], k[c:d], v[c:d], np.array([0, b - a]), np.array([0, d - c]),
                                              b - a, d - c, causal, scale)
                outs.append(o_s)
                lses.append(lse_s.float())
                aux.append(None)
                continue
            r = torch.ops.aten._scaled_dot_product_cudnn_attention(
                self._bhsd(q[a:b]), self._bhsd(k[c:d]), self._bhsd(v[c:d]), None, True, 0.0, bool(causal), False,
                scale=scale)
            outs.append(r[0][0].transpose(0, 1))
            native = r[1]
            lses.append(native.float().reshape(q.shape[1], b - a).transpose(0, 1) * self.factor)
            aux.append((native.shape, native.dtype, r[2], r[3], r[4], r[5], r[6], r[7]))
        return torch.cat(outs), torch.cat(lses), aux

    def aux_for(self, cu_q, cu_k, heads: int, device):
        # what the forward would have kept per sequence: None below MIN_CUDNN_ROWS (the
        # reference's math), else the native log-sum-exp's shape and dtype and the
        # arguments torch's dense forward returns (dropout is off: its seed and offset
        # and the cumulative lengths are not read); `_dense_setup` records them
        cq, ck, seed, offset, dtype = self.forward_extras
        aux = []
        for s in range(cu_q.size - 1):
            n, m = int(cu_q[s + 1] - cu_q[s]), int(cu_k[s + 1] - cu_k[s])
            aux.append(None if min(n, m) < MIN_CUDNN_ROWS else ((1, heads, n, 1), dtype, cq, ck, n, m, seed, offset))
        return aux

    def bwd(self, do, q, k, v, o, lse, aux, cu_q, cu_k, max_q, max_k, causal, scale):
        dqs, dks, dvs = [], [], []
        for s in range(cu_q.size - 1):
            a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            if aux[s] is None:
                dq, dk, dv = REFERENCE.bwd(do[a:b], q[a:b], k[c:d], v[c:d], o[a:b], lse[a:b], None,
                                           np.array([0, b - a]), np.array([0, d - c]), b - a, d - c, causal, scale)
                dqs.append(dq)
                dks.append(dk)
                dvs.append(dv)
                continue
            shape, dtype, cq, ck, mq, mk, seed, offset = aux[s]
            native = (lse[a:b] / self.factor).transpose(0, 1).to(dtype).contiguous().reshape(shape)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                self._bhsd(do[a:b]), self._bhsd(q[a:b]), self._bhsd(k[c:d]), self._bhsd(v[c:d]), self._bhsd(o[a:b]),
                native, seed, offset, None, cq, ck, mq, mk, 0.0, bool(causal), scale=scale)
            dqs.append(dq[0].transpose(0, 1))
            dks.append(dk[0].transpose(0, 1))
            dvs.append(dv[0].transpose(0, 1))
        return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)


# Sequences shorter than this (queries or keys) take the reference's dense math in the
# dense cuDNN kernel: negligible work, and no reliance on cuDNN's smallest shapes.
MIN_CUDNN_ROWS = 16


def _read_lse(x: Tensor, layout: str, factor: float, T: int, H: int) -> Tensor:
    x = x.float()
    return (x.reshape(T, H) if layout == "token_major" else x.reshape(H, T).transpose(0, 1)) * factor


def _write_lse(lse: Tensor, like: Tensor, layout: str, factor: float) -> Tensor:
    x = lse / factor
    x = x if layout == "token_major" else x.transpose(0, 1)
    return x.to(like.dtype).contiguous().reshape(like.shape)


@functools.cache
def cudnn_kernel(qk_dim: int, v_dim: int, variant: str = "dense-strided") -> VarlenKernel:
    """A cuDNN kernel ("dense": one dense call per sequence on contiguous copies;
    "dense-strided": the same on strided views; "graph": one call for all sequences on
    cuDNN's graph API (`cudnn_graph`, needs nvidia-cudnn-frontend), "graph-nondet" its
    backward without the deterministic flag; "ragged": torch's varlen entry),
    self-checked against the float64 reference on causal square and non-causal
    rectangular cases, short and long (outputs, the log-sum-exp's layout and base, every
    gradient); raises if anything does not match. On the H200 (torch 2.11) the ragged
    variant fails the long causal case (its backward reads out of bounds): torch's
    `_cudnn_attention_backward` sizes cuDNN's dQ accumulator by `query.size(2)`, which on
    the flat [T, H, D] varlen layout is the head dim, not the longest sequence (upstream
    pytorch/pytorch#186142), so any sequence over D rows runs past it."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuDNN attention needs CUDA")
    if variant in ("dense", "dense-strided"):
        return _check(_dense_setup(qk_dim, v_dim, variant == "dense-strided"), qk_dim, v_dim)
    if variant in ("graph", "graph-nondet"):
        from harts.exec.ops.attention import cudnn_graph

        return _check(cudnn_graph.setup(qk_dim, v_dim, deterministic=variant == "graph"), qk_dim, v_dim)
    if variant != "ragged":
        raise ValueError(f"unknown cuDNN variant {variant!r}; known: dense, dense-strided, graph, graph-nondet, ragged")
    kern = _CuDNN()
    scale = qk_dim ** -0.5
    # 1. find the log-sum-exp's layout and base on a causal square case
    n = [5, 19, 40]
    q, k, v, do, cu, _ = _case(qk_dim, v_dim, n, n, 0)
    T, H = q.shape[:2]
    _, lse_ref, _ = REFERENCE.fwd(*(x.double() for x in (q, k, v)), cu, cu, max(n), max(n), True, scale)
    cq = _CuDNN._cu(cu, "cuda")
    native = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cq, cq, max(n), max(n), True, 0.0, True, False,
                                                     scale=scale)[1]
    found = None
    if native.numel() == T * H:
        for layout in ("token_major", "head_major"):
            for factor in (1.0, math.log(2.0)):  # natural log, or base 2
                if (_read_lse(native, layout, factor, T, H).double() - lse_ref).abs().max() < 2e-2:
                    found = (layout, factor)
                    break
            if found:
                break
    if found is None:
        raise RuntimeError(f"cuDNN log-sum-exp layout not recognised (shape {tuple(native.shape)})")
    layout, factor = found
    kern.lse_from_native = functools.partial(_read_lse, layout=layout, factor=factor)
    kern.lse_to_native = functools.partial(_write_lse, layout=layout, factor=factor)
    kern.lse_layout = f"{layout}, base {'e' if factor == 1.0 else 2}, native shape {tuple(native.shape)}"
    # 2. how this torch spells "no bias" in the backward, then both cases in full
    err = None
    for bias in (lambda q: None, lambda q: torch.empty(0, device=q.device, dtype=q.dtype)):
        kern.bias_arg = bias
        try:
            o, lse, aux = kern.fwd(q, k, v, cu, cu, max(n), max(n), True, scale)
            kern.bwd(do, q, k, v, o, lse, aux, cu, cu, max(n), max(n), True, scale)
            err = None
            break
        except Exception as e:  # noqa: BLE001 - try the other spelling
            err = e
    if err is not None:
        raise RuntimeError(f"cuDNN varlen attention backward failed: {err}")
    return _check(kern, qk_dim, v_dim)


def _dense_setup(qk_dim: int, v_dim: int, strided: bool = False) -> _CuDNNDense:
    kern = _CuDNNDense(strided)
    n = [37]
    q, k, v, _, cu, _ = _case(qk_dim, v_dim, n, n, 0)
    scale = qk_dim ** -0.5
    _, lse_ref, _ = REFERENCE.fwd(*(x.double() for x in (q, k, v)), cu, cu, 37, 37, True, scale)
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(
        kern._bhsd(q), kern._bhsd(k), kern._bhsd(v), None, True, 0.0, True, False, scale=scale)
    native = r[1]
    kern.forward_extras = (r[2], r[3], r[6], r[7], native.dtype)
    if native.numel() != q.shape[0] * q.shape[1] or tuple(native.shape) != (1, q.shape[1], 37, 1):
        raise RuntimeError(f"cuDNN log-sum-exp layout not recognised (shape {tuple(native.shape)})")
    for factor in (1.0, math.log(2.0)):
        got = native.double().reshape(q.shape[1], 37).transpose(0, 1) * factor
        if (got - lse_ref).abs().max() < 2e-2:
            kern.factor = factor
            kern.lse_layout = f"head-major per sequence, base {'e' if factor == 1.0 else 2}, shape {tuple(native.shape)}"
            return kern
    raise RuntimeError("cuDNN log-sum-exp base not recognised")


@torch.no_grad()
def _check(kern: VarlenKernel, qk_dim: int, v_dim: int) -> VarlenKernel:
    scale = qk_dim ** -0.5
    n = [5, 19, 40]
    # small and realistic lengths: on the H200 (torch 2.11, cuDNN 9) the small cases pass
    # while the backward on thousands of rows per sequence reads out of bounds
    cases = ((True, n, n), (False, [5, 19, 40], [9, 50, 41]), (True, [300, 1000, 2500], [300, 1000, 2500]),
             (False, [700, 1500], [3000, 2000]), (True, [1, 3, 70], [1, 3, 70]), (False, [1, 2, 40], [3, 1, 60]))
    for causal, nq, nk in cases:
        q, k, v, do, cu_q, cu_k = _case(qk_dim, v_dim, nq, nk, 1)
        wide = [x.double() for x in (q, k, v)]
        o_ref, lse_ref, _ = REFERENCE.fwd(*wide, cu_q, cu_k, max(nq), max(nk), causal, scale)
        ref = REFERENCE.bwd(do.double(), *wide, o_ref, lse_ref, None, cu_q, cu_k, max(nq), max(nk), causal, scale)
        o, lse, aux = kern.fwd(q, k, v, cu_q, cu_k, max(nq), max(nk), causal, scale)
        grads = kern.bwd(do, q, k, v, o, lse, aux, cu_q, cu_k, max(nq), max(nk), causal, scale)
        torch.cuda.synchronize()  # an out-of-bounds access surfaces here, not later in training
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), (o_ref, lse_ref, *ref), strict=True):
            if not torch.isfinite(a).all() or (a.double() - b).norm() > 3e-2 * b.norm():
                raise RuntimeError(f"cuDNN varlen attention does not match the reference ({name}, causal={causal})")
    return kern


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, sp: SplitSegments, kernel: VarlenKernel, idx: dict):
        if not sp.qa_unique:
            raise ValueError("split_attention's forward needs each query once in part A (split_segments, "
                             "not piece_segments)")
        own = idx.get("own")
        kB = k if own is None else k.index_select(0, own)
        vB = v if own is None else v.index_select(0, own)
        o, lse, auxB = kernel.fwd(q, kB, vB, sp.cu_q, sp.cu_q, sp.max_q, sp.max_q, True, scale)
        auxA = None
        if sp.has_ancestors:
            qa, anc = idx["qa"], idx["anc"]
            qA, kA, vA = q.index_select(0, qa), k.index_select(0, anc), v.index_select(0, anc)
            oA, lseA, auxA = kernel.fwd(qA, kA, vA, sp.cu_qa, sp.cu_ka, sp.max_qa, sp.max_ka, False, scale)
            lseB = lse.index_select(0, qa)
            merged = torch.logaddexp(lseA, lseB)
            wA = torch.exp(lseA - merged)[..., None]
            wB = torch.exp(lseB - merged)[..., None]
            wide = torch.promote_types(o.dtype, torch.float32)
            o_at = oA.to(wide) * wA + o.index_select(0, qa).to(wide) * wB
            o = o.index_copy(0, qa, o_at.to(o.dtype))
            lse = lse.index_copy(0, qa, merged)
        ctx.scale, ctx.sp, ctx.kernel, ctx.idx, ctx.aux = scale, sp, kernel, idx, (auxB, auxA)
        ctx.rows = k.shape[0]
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*split_backward(do, q, k, v, o, lse, ctx.scale, ctx.sp, ctx.kernel, ctx.idx, ctx.aux),
                None, None, None, None)


def split_backward(do, q, k, v, o, lse, scale, sp: SplitSegments, kernel: VarlenKernel, idx: dict, aux=None):
    """dq, dk, dv of ancestor attention from the union's o and lse, as the two parts' shares
    (each part's kernel given the merged o and lse returns its exact share: see the module
    docstring). `aux` = the parts' forward aux (auxB, auxA), or None when o and lse came
    from another forward (`path_split_attention`): then the kernel's `aux_for`. `kernel` may
    be a pair (part B's, part A's)."""
    kernB, kernA = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    if aux is None:
        H = q.shape[1]
        aux = (kernB.aux_for(sp.cu_q, sp.cu_q, H, q.device),
               kernA.aux_for(sp.cu_qa, sp.cu_ka, H, q.device) if sp.has_ancestors else None)
    auxB, auxA = aux
    m = context_first(sp, idx, q.shape[0], k.shape[0])
    if m is not None:
        # [context | own] keys, every query over all of the context (a piece of a chain of
        # windows; segments under one shared prompt): the parts read row ranges, and each
        # key row's gradient is one part's share, so nothing is gathered, zero-filled or
        # summed by index. The same values as the general path below: dq's one addition
        # in float32 (or wider), dk and dv each row's single share
        dqB, dkB, dvB = kernB.bwd(do, q, k[m:], v[m:], o, lse, auxB, sp.cu_q, sp.cu_q, sp.max_q, sp.max_q, True,
                                  scale)
        if triangles.fits(q.shape[0], m, idx.get("triangles_min_rows", 0)):
            dqA, dkA, dvA = triangles.rectangle_backward(idx.get("triangles_kernel", kernB), do, q, k[:m], v[:m], o,
                                                         lse, scale)
        else:
            dqA, dkA, dvA = kernA.bwd(do, q, k[:m], v[:m], o, lse, auxA, sp.cu_qa, sp.cu_ka, sp.max_qa, sp.max_ka,
                                      False, scale)
        wide = torch.promote_types(q.dtype, torch.float32)
        return ((dqB.to(wide) + dqA.to(wide)).to(q.dtype), torch.cat([dkA, dkB]).to(k.dtype),
                torch.cat([dvA, dvB]).to(v.dtype))
    own = idx.get("own")
    kB = k if own is None else k.index_select(0, own)
    vB = v if own is None else v.index_select(0, own)
    dqB, dkB, dvB = kernB.bwd(do, q, kB, vB, o, lse, auxB, sp.cu_q, sp.cu_q, sp.max_q, sp.max_q, True, scale)
    wide = torch.promote_types(q.dtype, torch.float32)
    if own is None and not sp.has_ancestors:
        return dqB, dkB, dvB
    if sp.has_ancestors:
        qa, anc = idx["qa"], idx["anc"]
        qA, kA, vA = q.index_select(0, qa), k.index_select(0, anc), v.index_select(0, anc)
        dqA, dkA, dvA = kernA.bwd(do.index_select(0, qa), qA, kA, vA, o.index_select(0, qa),
                                   lse.index_select(0, qa), auxA, sp.cu_qa, sp.cu_ka, sp.max_qa, sp.max_ka,
                                   False, scale)
        if idx.get("gather_add", q.is_cuda) and q.dtype != torch.float64:
            # the ancestors' shares summed onto their rows by gathers (fixed order, bf16
            # read as it is; `segment_sum`), not by index_add_ on float32 copies. Where some
            # key rows are not queries (a window consumer's stashed context), the own
            # rows' shares are first placed on the key rows (each own row once: exact)
            from harts.exec.ops import segment_sum

            inv_q, inv_k = _inverses(idx, q.shape[0], k.shape[0])
            if own is not None:
                dkB = dkB.new_zeros(k.shape).index_copy_(0, own, dkB)
                dvB = dvB.new_zeros(v.shape).index_copy_(0, own, dvB)
            return (segment_sum.gather_add(dqB, dqA, inv_q, dtype=q.dtype),
                    segment_sum.gather_add(dkB, dkA, inv_k, dtype=k.dtype),
                    segment_sum.gather_add(dvB, dvA, inv_k, dtype=v.dtype))
    dk = torch.zeros(k.shape, dtype=wide, device=k.device)
    dv = torch.zeros(v.shape, dtype=wide, device=v.device)
    if own is None:
        dk += dkB
        dv += dvB
    else:
        dk.index_add_(0, own, dkB.to(wide))
        dv.index_add_(0, own, dvB.to(wide))
    dq = dqB
    if sp.has_ancestors:
        dq = dqB.to(wide).index_add_(0, qa, dqA.to(wide)).to(q.dtype)
        dk.index_add_(0, anc, dkA.to(wide))
        dv.index_add_(0, anc, dvA.to(wide))
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def context_first(sp: SplitSegments, idx: dict, queries: int, rows: int) -> int | None:
    """m where the keys are [m context rows | the queries' own rows, in order] and part A is
    one rectangle, every query over all of the context: a piece of a chain of windows, or
    (with `piece_segments`) a consumer whose segments all read the whole of one shared
    prompt. Part A then reads rows [0, m), part B rows [m, rows). Else None. Decided once
    per layout on the host arrays and kept in the layout's index dict."""
    if "context_first" not in idx:
        m = rows - queries
        idx["context_first"] = m if (
            m > 0 and sp.own_rows is not None and np.array_equal(sp.own_rows, np.arange(m, rows))
            and np.array_equal(sp.qa_index, np.arange(queries)) and np.array_equal(sp.cu_qa, [0, queries])
            and np.array_equal(sp.anc_rows, np.arange(m)) and np.array_equal(sp.cu_ka, [0, m])) else None
    return idx["context_first"]


def _inverses(idx: dict, queries: int, rows: int):
    """The inverses of the query and ancestor indices for `segment_sum.gather_add`, built
    on first use and kept in the layout's index dict (the layers share them)."""
    from harts.exec.ops import segment_sum

    key = ("inverses", queries, rows, segment_sum.BT)
    if key not in idx:
        idx[key] = (segment_sum.inverse(idx["qa"], queries, segment_sum.BT),
                    segment_sum.inverse(idx["anc"], rows, segment_sum.BT))
    return idx[key]


def device_index(sp: SplitSegments, device) -> dict:
    """The index tensors of a layout on a device (built once per layout, reused by layers)."""
    idx = {"qa": to_device(sp.qa_index, device), "anc": to_device(sp.anc_rows, device)}
    if sp.own_rows is not None:
        idx["own"] = to_device(sp.own_rows, device)
    return idx


def split_attention(q_CHD: Tensor, k_LHD: Tensor, v_LHE: Tensor, scale: float, sp: SplitSegments,
                    kernel: VarlenKernel = REFERENCE, idx: dict | None = None) -> Tensor:
    """o_CHE: each query row attends its ancestors and itself (queries in ascending local order)."""
    if idx is None:
        idx = device_index(sp, q_CHD.device)
    return _SplitAttention.apply(q_CHD, k_LHD, v_LHE, scale, sp, kernel, idx)


class _PathSplitAttention(torch.autograd.Function):
    """Forward: one bottom-right call over the gathered root-to-row paths (`path_attention`'s
    layout: each query's keys are its trajectory's prefix, in its order, from position 0);
    backward: the split's two parts from that forward's o and lse (`split_backward`)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, seg: PathSegments, key_rows, fwd_kernel: VarlenKernel, sp: SplitSegments,
                kernel: VarlenKernel, idx: dict):
        if key_rows is None:  # the paths are the rows as they are (one chain, all rows queried)
            kg, vg = k, v
        else:
            kg, vg = k.index_select(0, key_rows), v.index_select(0, key_rows)
        o, lse, _ = fwd_kernel.fwd(q, kg, vg, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, True, scale)
        del kg, vg
        ctx.scale, ctx.sp, ctx.kernel, ctx.idx = scale, sp, kernel, idx
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*split_backward(do, q, k, v, o, lse, ctx.scale, ctx.sp, ctx.kernel, ctx.idx),
                None, None, None, None, None, None, None)


def identity_keys(seg: PathSegments, rows: int) -> bool:
    """Whether the gathered paths are the local rows in order (one chain, every row a query):
    the forward then reads k and v as they are."""
    return seg.key_rows.size == rows and bool((seg.key_rows == np.arange(rows)).all())


def path_split_attention(q_CHD: Tensor, k_LHD: Tensor, v_LHE: Tensor, scale: float, seg: PathSegments,
                         sp: SplitSegments, fwd_kernel: VarlenKernel, kernel: VarlenKernel,
                         key_rows: Tensor | None = None, idx: dict | None = None) -> Tensor:
    """o_CHE: ancestor attention whose forward is one bottom-right varlen call over root-to-row
    paths (`fwd_kernel`, e.g. cuDNN's graph: `cudnn_graph.setup(..., bottom_right=True)`)
    and whose backward is the split's (`kernel` for both parts).

    Why: a query's keys in that forward are exactly its trajectory's prefix, in order, from
    position 0, so a kernel whose per-row arithmetic depends only on the key sequence gives
    the bits the expanded baseline gets running the same kernel over the trajectory (on the
    H200: every row identical with cuDNN's graph kernel,
    benchmarks/results/attention/2026-11-30-dfa084a-attnbits.json),
    while the split's merge of two partial softmaxes cannot. The backward needs no such
    property (gradients of shared rows sum over branches in any case), and the split's is
    the cheaper one where segments are long (no gathered-key gradients to scatter).
    `key_rows` (the gathered key rows on the device) is built when None, unless the paths
    are the rows themselves (`identity_keys`)."""
    if key_rows is None and not identity_keys(seg, k_LHD.shape[0]):
        key_rows = to_device(seg.key_rows, q_CHD.device)
    if idx is None:
        idx = device_index(sp, q_CHD.device)
    return _PathSplitAttention.apply(q_CHD, k_LHD, v_LHE, scale, seg, key_rows, fwd_kernel, sp, kernel, idx)
