"""Ancestor attention over a tree's compact layout on the GPU: which fast path runs, and
the object every layer of a microbatch calls.

bf16/fp16 with the cuDNN frontend: forward one cuDNN graph call over the segments'
root-to-row paths (bottom-right causal: each query's keys are its trajectory's prefix, so
its bits are the expanded baseline's under baseline_attention=graph), backward the split
(`split`) from that forward's o and lse, its ancestor part grouped by key piece
(`split.piece_segments`), each part on the kernel `split_part_kernel` picks. Without it:
cuDNN's SDPA, two calls per query segment merged by log-sum-exp (`split`) where segments
are long, or one causal varlen flash call over the segments' root-to-row paths (`varlen`)
where they are short. Otherwise (fp32, or no varlen API) compiled FlexAttention over a
block mask from the DFS intervals (`flex`). Every attended pair is computed once on each
path; the dense-mask reference is `naive.tree_attention`.

The self-checks of the cuDNN kernels run once per head dims and process (`graph_kernels`,
`cudnn_split_ok`): they probe what this library and device compute correctly, the same
answer every time; which path a call takes is its `KernelConfig`'s.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from harts.config.kernels import Impl, KernelConfig, TreeAttention
from harts.exec.ops.record import KernelRecord, report, report_fallback
from harts.exec.transfer import to_device

DEFAULT_KERNELS = KernelConfig()
OP = "tree_attention"
HALF_DTYPES = (torch.bfloat16, torch.float16)


def prefer_cudnn_split(query_rows: int, segments: int,
                       min_rows: int = DEFAULT_KERNELS.cudnn_split_min_rows_per_segment) -> bool:
    """Whether the layout's query segments are long enough for the per-segment cuDNN split
    to beat one varlen flash call (`KernelConfig.cudnn_split_min_rows_per_segment`, the
    point between the H200 measurements of both: cuDNN faster at 10.2k and 32k rows per
    segment, varlen at 840)."""
    return segments > 0 and query_rows / segments >= min_rows


_CUDNN_SPLIT_STATE: dict = {}


def cudnn_split_ok(qk_dim: int, v_dim: int) -> bool:
    """Whether the dense cuDNN kernel passed its self-check at these head dims (checked
    once per process; a failure is reported once)."""
    key = (qk_dim, v_dim)
    if key not in _CUDNN_SPLIT_STATE:
        from harts.exec.ops.attention.split import cudnn_kernel

        try:
            cudnn_kernel(qk_dim, v_dim)
            _CUDNN_SPLIT_STATE[key] = True
        except Exception as err:  # noqa: BLE001 - any failure means: do not use it
            warnings.warn(f"cuDNN split tree attention failed its self-check ({err})", stacklevel=2)
            _CUDNN_SPLIT_STATE[key] = False
    return _CUDNN_SPLIT_STATE[key]


def deterministic_graph_workspace(sequences: int, heads: int, max_q: int, max_k: int) -> int:
    """Bytes of workspace cuDNN's deterministic graph backward takes for one call: 2 bytes
    per padded score, B x H x Sq x Sk."""
    from harts.exec.ops.attention.cudnn_graph import bucket_batch, bucket_len

    return bucket_batch(sequences) * heads * bucket_len(max_q) * bucket_len(max_k) * 2


def split_part_kernel(qk_dim: int, v_dim: int, heads: int, query_rows: int, sequences: int, max_q: int,
                      max_k: int, kernels: KernelConfig = DEFAULT_KERNELS):
    """The backward kernel for one part of the split (`split.split_backward`) on the graph
    path: torch's dense cuDNN per sequence where sequences are long (few calls, each near
    SDPA's speed; longer than `kernels.graph_backward_max_rows`, the graph's deterministic
    workspace grows with the padded lengths), else one graph call, deterministic where its
    workspace is at most `kernels.graph_deterministic_workspace_max`, else without the flag
    (as torch's SDPA backward runs unless torch.use_deterministic_algorithms is on; then
    dense per sequence)."""
    from harts.exec.ops.attention.split import cudnn_kernel

    dense_ok = cudnn_split_ok(qk_dim, v_dim)
    long_rows = max(max_q, max_k) > kernels.graph_backward_max_rows
    if dense_ok and (prefer_cudnn_split(query_rows, sequences, kernels.cudnn_split_min_rows_per_segment) or long_rows):
        return cudnn_kernel(qk_dim, v_dim)
    workspace = deterministic_graph_workspace(sequences, heads, max_q, max_k)
    if workspace <= kernels.graph_deterministic_workspace_max:
        return graph_kernels(qk_dim, v_dim)[1]
    if torch.are_deterministic_algorithms_enabled() and dense_ok:
        return cudnn_kernel(qk_dim, v_dim)
    return cudnn_kernel(qk_dim, v_dim, "graph-nondet")


_GRAPH_STATE: dict = {}


def graph_kernels(qk_dim: int, v_dim: int):
    """(bottom-right forward kernel, deterministic split kernel) on cuDNN's graph API, each
    self-checked against the float64 reference at these head dims (once per process), or
    None where the frontend is missing or a check fails (a failure is reported once)."""
    key = (qk_dim, v_dim)
    if key not in _GRAPH_STATE:
        from harts.exec.ops.attention import cudnn_graph

        _GRAPH_STATE[key] = None
        if cudnn_graph.available():
            from harts.exec.ops.attention.split import cudnn_kernel

            try:
                fwd = cudnn_graph.check_bottom_right(cudnn_graph.setup(qk_dim, v_dim, bottom_right=True), qk_dim, v_dim)
                _GRAPH_STATE[key] = (fwd, cudnn_kernel(qk_dim, v_dim, "graph"))
            except Exception as err:  # noqa: BLE001 - any failure means: do not use it
                warnings.warn(f"cuDNN graph tree attention failed its self-check ({err})", stacklevel=2)
    return _GRAPH_STATE[key]


class FastTreeAttention:
    """Ancestor attention for one layout: queries `q_local_C` attend keys by `end_L`, on
    the path `impl` picks from `kernels`. What each path needs (segments, block mask) is
    built on first use and reused by every layer (and recomputation)."""

    def __init__(self, q_local_C: Tensor, end_L: Tensor, parent_L=None, q_local_host=None, *,
                 kernels: KernelConfig = DEFAULT_KERNELS, record: KernelRecord | None = None):
        self.q_local_C = q_local_C
        self.q_local_host = q_local_host  # numpy copy of q_local_C (no device-to-host read)
        self.end_L = end_L
        self.parent_L = parent_L
        self.kernels = kernels
        self.record = record
        self._mask = None
        self._segments = None
        self._split = None
        self._identity = None  # whether the root-to-row paths are the rows in order

    def impl(self, dtype: torch.dtype, qk_dim: int = 0, v_dim: int = 0) -> Impl:
        return self._choose(dtype, qk_dim, v_dim)[0]

    def _choose(self, dtype: torch.dtype, qk_dim: int, v_dim: int) -> tuple[Impl, str | None]:
        """(path, why it is not the requested one or None): FLEX where forced, for fp32 or
        without parents; else the requested path; under auto GRAPH where cuDNN's graph
        kernels passed their self-checks at these head dims, else CUDNN where the layout's
        segments are long enough and cuDNN passes its self-check, else VARLEN."""
        from harts.exec.ops.attention.varlen import flash_varlen_available

        choice = self.kernels.tree_attention
        if choice is TreeAttention.FLEX:
            return Impl.FLEX, None
        if self.parent_L is None:
            return Impl.FLEX, "the layout has no parent pointers"
        if dtype not in HALF_DTYPES:
            return Impl.FLEX, f"{choice} computes bf16/fp16 only, not {dtype}"
        if choice is TreeAttention.CUDNN:
            return Impl.CUDNN, None
        if choice is TreeAttention.GRAPH:
            return Impl.GRAPH, None
        varlen = Impl.VARLEN if flash_varlen_available() else Impl.FLEX
        why = None if varlen is Impl.VARLEN else "this torch has no varlen flash attention"
        if choice is TreeAttention.VARLEN or not self.q_local_C.is_cuda:
            return varlen, why
        if qk_dim > 0 and graph_kernels(qk_dim, v_dim) is not None:
            return Impl.GRAPH, None
        seg = self._segments_for(self.q_local_C.device)[0]
        if qk_dim > 0 and prefer_cudnn_split(int(seg.cu_q[-1]), seg.num_segments,
                                             self.kernels.cudnn_split_min_rows_per_segment) \
                and cudnn_split_ok(qk_dim, v_dim):
            return Impl.CUDNN, None
        return varlen, why

    def _segments_for(self, device):
        if self._segments is None:
            from harts.exec.ops.attention.varlen import segments_of

            full = self.q_local_C.numel() == self.end_L.numel()
            q_host = self.q_local_host if self.q_local_host is not None else self.q_local_C.cpu().numpy()
            seg = segments_of(self.parent_L, None if full else q_host)
            self._segments = (seg, to_device(seg.key_rows, device), full)
        return self._segments

    def prepare(self) -> None:
        """Build the data-only pieces now (the query segments, and their cuDNN split where
        the layout's segments are long enough for that path), so that a step prepared
        ahead does no host layout work in its forward."""
        if self.parent_L is None or not self.q_local_C.is_cuda:
            return
        seg, _, full = self._segments_for(self.q_local_C.device)
        choice = self.kernels.tree_attention
        if choice in (TreeAttention.AUTO, TreeAttention.GRAPH):
            self._split_for(self.q_local_C.device, pieces=True)
        long = prefer_cudnn_split(int(seg.cu_q[-1]), seg.num_segments, self.kernels.cudnn_split_min_rows_per_segment)
        if choice is TreeAttention.CUDNN or (choice is TreeAttention.AUTO and long):
            self._split_for(self.q_local_C.device)

    def _split_for(self, device, pieces: bool = False):
        """The split (`split_segments`; with `pieces`, part A by key piece for the graph
        path's backward: `piece_segments`) and its device index, built once."""
        if self._split is None:
            self._split = {}
        if pieces not in self._split:
            from harts.exec.ops.attention.split import device_index, piece_segments, split_segments

            seg, _, full = self._segments_for(device)
            sp = (piece_segments if pieces else split_segments)(seg, full)
            idx = device_index(sp, device)
            idx["triangles_min_rows"] = self.kernels.rectangle_triangles_min_rows
            self._split[pieces] = (sp, idx)
        return self._split[pieces]

    def __call__(self, q_CHD: Tensor, k_LHD: Tensor, v_LHE: Tensor, scale: float) -> Tensor:
        impl, why = self._choose(q_CHD.dtype, q_CHD.shape[-1], v_LHE.shape[-1])
        requested = self.kernels.tree_attention
        if why is not None and requested is not TreeAttention.AUTO:
            report_fallback(self.record, OP, requested, impl, why)
        else:
            report(self.record, OP, impl)
        if impl is Impl.GRAPH:
            from harts.exec.ops.attention.split import identity_keys, path_split_attention

            D, E = q_CHD.shape[-1], v_LHE.shape[-1]
            kernels = graph_kernels(D, E)
            if kernels is None:
                raise RuntimeError("tree_attention=graph: cuDNN's graph attention is unavailable "
                                   "(needs CUDA and nvidia-cudnn-frontend, and its self-check)")
            seg, key_rows, _ = self._segments_for(q_CHD.device)
            sp, idx = self._split_for(q_CHD.device, pieces=True)
            if self._identity is None:
                self._identity = identity_keys(seg, k_LHD.shape[0])
            H = q_CHD.shape[1]
            cfg = self.kernels
            bwd = (split_part_kernel(D, E, H, int(sp.cu_q[-1]), seg.num_segments, sp.max_q, sp.max_q, cfg),
                   split_part_kernel(D, E, H, int(sp.qa_index.size), int(sp.cu_qa.size - 1), sp.max_qa, sp.max_ka,
                                     cfg)
                   if sp.has_ancestors else None)
            if cfg.rectangle_triangles_min_rows and "triangles_kernel" not in idx:
                # the kernel of the causal squares a context's backward may take, picked
                # for their shape as the parts' are (`harts.exec.ops.attention.triangles`)
                from harts.exec.ops.attention import triangles
                from harts.exec.ops.attention.split import context_first

                n = int(sp.cu_q[-1])
                m = context_first(sp, idx, n, k_LHD.shape[0])
                if m is not None and triangles.fits(n, m, cfg.rectangle_triangles_min_rows):
                    side, s = triangles.squares(n, m)
                    idx["triangles_kernel"] = split_part_kernel(D, E, H, s * side, s, side, side, cfg)
            return path_split_attention(q_CHD, k_LHD, v_LHE, scale, seg, sp, kernels[0],
                                        bwd if bwd[1] is not None else bwd[0],
                                        key_rows=None if self._identity else key_rows, idx=idx)
        if impl is Impl.CUDNN:
            from harts.exec.ops.attention.split import cudnn_kernel, split_attention

            # raises (rather than training on wrong numbers) if cuDNN fails its self-check
            kernel = cudnn_kernel(q_CHD.shape[-1], v_LHE.shape[-1])
            sp, idx = self._split_for(q_CHD.device)
            return split_attention(q_CHD, k_LHD, v_LHE, scale, sp, kernel=kernel, idx=idx)
        if impl is Impl.VARLEN:
            from harts.exec.ops.attention.varlen import flash_varlen, path_attention

            seg, key_rows, _ = self._segments_for(q_CHD.device)
            return path_attention(q_CHD, k_LHD, v_LHE, scale, seg, kernel=flash_varlen, key_rows=key_rows)
        from harts.exec.ops.attention.flex import tree_attention, tree_block_mask

        if self._mask is None:
            full = self.q_local_C.numel() == self.end_L.numel()
            self._mask = tree_block_mask(self.end_L, None if full else self.q_local_C)
        return tree_attention(q_CHD, k_LHD, v_LHE, scale, self._mask)
