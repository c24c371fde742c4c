"""Implementation selection: the fast GPU paths where they can run, the references otherwise.

One registry per op family, keyed by `Impl`: the reference (`harts.exec.ops`, dense masks;
runs anywhere, every dtype) and the GPU paths (`harts.exec.gpu`: fla-core KDA with our
boundary-state kernel; ancestor attention in bf16/fp16 with cuDNN's graph API where
nvidia-cudnn-frontend is installed (forward one bottom-right call over root-to-row paths,
backward the split's two parts), else cuDNN calls per segment merged by log-sum-exp where
the layout's query segments are long and one varlen flash call over root-to-row paths where
they are short; FlexAttention over DFS-interval block masks in fp32;
`HARTS_TREE_ATTENTION=graph|cudnn|varlen|flex` forces one, `HARTS_BASELINE_ATTENTION=graph|flash`
picks the expanded baseline's). A fast path is chosen when the tensors are on CUDA, the
dtype is one it computes (fp32/bf16/fp16, never fp64) and its library imports; `HARTS_FORCE_REFERENCE=1` forces the references everywhere (the
A/B switch for equivalence and speed comparisons). MoE experts: torch's `grouped_mm` over
expert-sorted rows on CUDA bf16, the per-expert loop otherwise. Short conv: our fused
Triton kernels on CUDA, the gather-form reference elsewhere or with `HARTS_CONV=reference`. Call
sites ask here and never import a GPU module themselves, so CPU-only machines never touch
triton kernels.
"""

from __future__ import annotations

import functools
import os
import warnings
from enum import StrEnum

import torch
from torch import Tensor

from harts.exec.transfer import to_device

FORCE_ENV = "HARTS_FORCE_REFERENCE"
TREE_ATTENTION_ENV = "HARTS_TREE_ATTENTION"  # "flex" | "varlen" | "cudnn" | "graph": force one bf16 path
# The expanded baseline's attention: torch's cuDNN SDPA per sequence (default, the faster
# baseline); "flash": the flash kernel with values padded to the qk dim; "graph": one cuDNN
# graph call over a microbatch's sequences, the kernel the tree's graph path runs forward,
# so each row gets the same bits in both modes (the bit-exact fidelity comparison)
BASELINE_ATTENTION_ENV = "HARTS_BASELINE_ATTENTION"
CONV_ENV = "HARTS_CONV"  # "reference": the gather-form short conv instead of the fused kernels
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Impl(StrEnum):
    REFERENCE = "reference"
    FLA = "fla"  # fla-core chunk_kda (+ harts' boundary-state kernel for replay handoffs)
    FLEX = "flex"  # FlexAttention with a block mask from DFS intervals
    VARLEN = "varlen"  # ancestor attention as one varlen flash call over root-to-row paths
    CUDNN = "cudnn"  # ancestor attention as cuDNN calls per query segment merged by log-sum-exp
    GRAPH = "graph"  # cuDNN graph: forward one bottom-right call over root-to-row paths, backward the split
    GROUPED = "grouped"  # MoE experts as grouped matrix products (torch grouped_mm)
    TRITON = "triton"  # our fused Triton kernels (short conv)


def force_reference() -> bool:
    return os.environ.get(FORCE_ENV, "").strip() not in ("", "0", "false", "False")


@functools.cache
def fla_available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


@functools.cache
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def kda_impl(device: torch.device, dtype: torch.dtype) -> Impl:
    if force_reference() or device.type != "cuda" or dtype not in FAST_DTYPES or not fla_available():
        return Impl.REFERENCE
    return Impl.FLA


def tree_attention_impl(device: torch.device) -> Impl:
    if force_reference() or device.type != "cuda" or not flex_available():
        return Impl.REFERENCE
    return Impl.FLEX


@functools.cache
def grouped_mm_available() -> bool:
    import torch.nn.functional as F

    return hasattr(F, "grouped_mm")


def moe_impl(device: torch.device, dtype: torch.dtype) -> Impl:
    """MoE experts: grouped matrix products on CUDA bf16 (what grouped_mm's CUDA kernels
    take), the per-expert loop reference otherwise (any dtype, float64 included)."""
    if force_reference() or device.type != "cuda" or dtype != torch.bfloat16 or not grouped_mm_available():
        return Impl.REFERENCE
    return Impl.GROUPED


def conv_impl(device: torch.device) -> Impl:
    """Short conv: on CUDA the fused Triton kernels (`harts.exec.gpu.conv`; on the H200 at
    82k rows x 2048 channels 0.32 vs 3.4 ms forward, 6.7 vs 11.2 ms forward+backward),
    elsewhere or with HARTS_CONV=reference the gather-form reference."""
    if force_reference() or device.type != "cuda" or os.environ.get(CONV_ENV, "").strip() == "reference":
        return Impl.REFERENCE
    return Impl.TRITON


def short_conv(x_TD: Tensor, weight_DW: Tensor, bias_D: Tensor | None, *, window_TW: Tensor,
               activation: str | None = "silu") -> Tensor:
    """`harts.exec.ops.conv.short_conv`'s contract (no carried state), on `conv_impl`'s pick."""
    if conv_impl(x_TD.device) is Impl.TRITON:
        from harts.exec.gpu.conv import short_conv_fused

        return short_conv_fused(x_TD, weight_DW, bias_D, window_TW=window_TW, activation=activation)
    from harts.exec.ops.conv import short_conv as reference

    return reference(x_TD, weight_DW, bias_D, window_TW=window_TW, activation=activation)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, **kwargs):
    """`harts.exec.ops.kda.chunk_kda`'s contract, on the implementation `kda_impl` picks.

    `cu_seqlens_cpu` (optional): a host copy of cu_seqlens, which the fast path's
    bookkeeping reads without a device-to-host sync; the reference ignores it."""
    cu_cpu = kwargs.pop("cu_seqlens_cpu", None)
    if kda_impl(q.device, q.dtype) is Impl.FLA:
        from harts.exec.gpu.kda import chunk_kda_fast

        return chunk_kda_fast(q, k, v, g, beta, cu_seqlens_cpu=cu_cpu, **kwargs)
    from harts.exec.ops.kda import chunk_kda as reference

    return reference(q, k, v, g, beta, **kwargs)


def baseline_attention() -> str:
    """HARTS_BASELINE_ATTENTION: "" (torch's cuDNN SDPA per sequence), "flash" or "graph";
    raises on anything else rather than silently running the default."""
    choice = os.environ.get(BASELINE_ATTENTION_ENV, "").strip()
    if choice not in ("", "cudnn", "flash", "graph"):
        raise ValueError(f"{BASELINE_ATTENTION_ENV}={choice!r}: expected cudnn (default), flash or graph")
    return choice


def _cudnn_sdpa_ok() -> bool:
    """cuDNN SDPA for the baseline unless HARTS_BASELINE_ATTENTION=flash (the padded flash
    path the first two sessions' H200 numbers were measured with)."""
    return baseline_attention() != "flash"


# Rows per query segment from which the cuDNN split path (one dense call per segment and
# part) beats the single varlen flash call. Measured on the H200 at 16 heads, qk 192 / v
# 128 (benchmarks/results/h200_session3/attnsplit.json): 10.2k rows per segment (a
# swe-treestep-1 tree) cuDNN 237 vs varlen 397 ms, 32k (one chain) 41 vs 84 ms; 840
# (a bushy small-tree layout, 39 segments) cuDNN 33 vs varlen 21 ms. The threshold sits
# between the measured points.
CUDNN_SPLIT_MIN_ROWS_PER_SEGMENT = 2048


def prefer_cudnn_split(query_rows: int, segments: int) -> bool:
    return segments > 0 and query_rows / segments >= CUDNN_SPLIT_MIN_ROWS_PER_SEGMENT


_CUDNN_SPLIT_STATE: dict = {}


def _cudnn_split_ok(qk_dim: int, v_dim: int) -> bool:
    """Whether the cuDNN kernel passed its self-check at these head dims (once per process;
    a failure is reported once and the varlen path is used instead)."""
    key = (qk_dim, v_dim)
    if key not in _CUDNN_SPLIT_STATE:
        from harts.exec.gpu.split_attention import cudnn_kernel

        try:
            cudnn_kernel(qk_dim, v_dim)
            _CUDNN_SPLIT_STATE[key] = True
        except Exception as err:  # noqa: BLE001 - any failure means: do not use it
            warnings.warn(f"cuDNN split tree attention unavailable ({err}); using the varlen path", stacklevel=2)
            _CUDNN_SPLIT_STATE[key] = False
    return _CUDNN_SPLIT_STATE[key]


# Segments longer than this take the dense per-segment cuDNN backward rather than the
# graph's deterministic one, whose workspace grows with the padded sequence lengths (on the
# H200 it asked for 361 GiB on swe-treestep-1's 27k x 51k ancestor part; fine at 4.4k).
GRAPH_BACKWARD_MAX_ROWS = 8192
# The deterministic graph backward's workspace is 2 bytes per padded score, B x H x Sq x Sk
# (measured on the H200, benchmarks/results/h200_session9/s9a: 31 GiB for 39 segments of up
# to 4.4k rows); past this it runs without the deterministic flag (as torch's SDPA backward
# does unless torch.use_deterministic_algorithms is on; then the dense per-segment kernel).
GRAPH_DETERMINISTIC_WORKSPACE_MAX = 4 * 2 ** 30


def deterministic_graph_workspace(sequences: int, heads: int, max_q: int, max_k: int) -> int:
    """Bytes of workspace cuDNN's deterministic graph backward takes for one call."""
    from harts.exec.gpu.cudnn_graph import bucket_batch, bucket_len

    return bucket_batch(sequences) * heads * bucket_len(max_q) * bucket_len(max_k) * 2


def split_part_kernel(qk_dim: int, v_dim: int, heads: int, query_rows: int, sequences: int, max_q: int,
                      max_k: int):
    """The backward kernel for one part of the split (`split_attention.split_backward`) on
    the graph path: torch's dense cuDNN per sequence where sequences are long (few calls,
    each near SDPA's speed), else one graph call, deterministic where its workspace is at
    most GRAPH_DETERMINISTIC_WORKSPACE_MAX, else without the flag (or dense per sequence
    under torch.use_deterministic_algorithms)."""
    from harts.exec.gpu.split_attention import cudnn_kernel

    dense_ok = _cudnn_split_ok(qk_dim, v_dim)
    if dense_ok and (prefer_cudnn_split(query_rows, sequences) or max(max_q, max_k) > GRAPH_BACKWARD_MAX_ROWS):
        return cudnn_kernel(qk_dim, v_dim)
    if deterministic_graph_workspace(sequences, heads, max_q, max_k) <= GRAPH_DETERMINISTIC_WORKSPACE_MAX:
        return graph_kernels(qk_dim, v_dim)[1]
    if torch.are_deterministic_algorithms_enabled() and dense_ok:
        return cudnn_kernel(qk_dim, v_dim)
    return cudnn_kernel(qk_dim, v_dim, "graph-nondet")


_GRAPH_STATE: dict = {}


def graph_kernels(qk_dim: int, v_dim: int):
    """(bottom-right forward kernel, deterministic split kernel) on cuDNN's graph API, each
    self-checked against the float64 reference at these head dims (once per process), or
    None where the frontend is missing or a check fails (reported once)."""
    key = (qk_dim, v_dim)
    if key not in _GRAPH_STATE:
        from harts.exec.gpu import cudnn_graph

        _GRAPH_STATE[key] = None
        if cudnn_graph.available():
            from harts.exec.gpu.split_attention import cudnn_kernel

            try:
                fwd = cudnn_graph.check_bottom_right(cudnn_graph.setup(qk_dim, v_dim, bottom_right=True), qk_dim, v_dim)
                _GRAPH_STATE[key] = (fwd, cudnn_kernel(qk_dim, v_dim, "graph"))
            except Exception as err:  # noqa: BLE001 - any failure means: do not use it
                warnings.warn(f"cuDNN graph tree attention unavailable ({err}); using the per-segment paths",
                              stacklevel=2)
    return _GRAPH_STATE[key]


class FastTreeAttention:
    """Ancestor attention for one layout: queries `q_local_C` attend keys by `end_L`.

    bf16/fp16 with the cuDNN frontend: forward one cuDNN graph call over the segments'
    root-to-row paths (bottom-right causal: each query's keys are its trajectory's prefix,
    so its bits are the expanded baseline's under HARTS_BASELINE_ATTENTION=graph), backward
    the split below from that forward's o and lse, its ancestor part grouped by key piece
    (`split_attention.piece_segments`), each part on the kernel `split_part_kernel` picks.
    Without it: cuDNN's SDPA, two calls per query segment merged by log-sum-exp
    (`harts.exec.gpu.split_attention`) where segments are long, or one causal varlen flash
    call over the segments' root-to-row paths (`harts.exec.gpu.path_attention`) where they
    are short (see `impl`); every attended pair is computed once either way. Otherwise
    (fp32, or no varlen API) compiled FlexAttention over a block mask from the DFS
    intervals. What each needs (segments, block mask) is built on first use and reused by
    every layer (and recomputation)."""

    def __init__(self, q_local_C: Tensor, end_L: Tensor, parent_L=None, q_local_host=None):
        self.q_local_C = q_local_C
        self.q_local_host = q_local_host  # numpy copy of q_local_C (no device-to-host read)
        self.end_L = end_L
        self.parent_L = parent_L
        self._mask = None
        self._segments = None
        self._split = None
        self._identity = None  # whether the root-to-row paths are the rows in order

    def impl(self, dtype: torch.dtype, qk_dim: int = 0, v_dim: int = 0) -> Impl:
        """FLEX (fp32, no parents, or forced), else GRAPH where cuDNN's graph kernels passed
        their self-checks at these head dims, else CUDNN where the layout's segments are long
        enough and cuDNN passes its self-check, else VARLEN;
        HARTS_TREE_ATTENTION=graph|cudnn|varlen|flex forces one."""
        from harts.exec.gpu.path_attention import flash_varlen_available

        choice = os.environ.get(TREE_ATTENTION_ENV, "").strip()
        if choice not in ("", "graph", "cudnn", "varlen", "flex"):
            raise ValueError(f"{TREE_ATTENTION_ENV}={choice!r}: expected graph, cudnn, varlen or flex")
        if choice == "flex":
            return Impl.FLEX
        if self.parent_L is None or dtype not in (torch.bfloat16, torch.float16):
            return Impl.FLEX
        if choice == "cudnn":
            return Impl.CUDNN
        if choice == "graph":
            return Impl.GRAPH
        varlen = Impl.VARLEN if flash_varlen_available() else Impl.FLEX
        if choice == "varlen" or not self.q_local_C.is_cuda:
            return varlen
        if qk_dim > 0 and graph_kernels(qk_dim, v_dim) is not None:
            return Impl.GRAPH
        seg = self._segments_for(self.q_local_C.device)[0]
        if qk_dim > 0 and prefer_cudnn_split(int(seg.cu_q[-1]), seg.num_segments) and _cudnn_split_ok(qk_dim, v_dim):
            return Impl.CUDNN
        return varlen

    def _segments_for(self, device):
        if self._segments is None:
            from harts.exec.gpu.path_attention import segments_of

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
        choice = os.environ.get(TREE_ATTENTION_ENV, "").strip()
        if choice in ("", "graph"):
            self._split_for(self.q_local_C.device, pieces=True)
        if choice == "cudnn" or (choice == "" and prefer_cudnn_split(int(seg.cu_q[-1]), seg.num_segments)):
            self._split_for(self.q_local_C.device)

    def _split_for(self, device, pieces: bool = False):
        """The split (`split_segments`; with `pieces`, part A by key piece for the graph
        path's backward: `piece_segments`) and its device index, built once."""
        if self._split is None:
            self._split = {}
        if pieces not in self._split:
            from harts.exec.gpu.split_attention import device_index, piece_segments, split_segments

            seg, _, full = self._segments_for(device)
            sp = (piece_segments if pieces else split_segments)(seg, full)
            self._split[pieces] = (sp, device_index(sp, device))
        return self._split[pieces]

    def __call__(self, q_CHD: Tensor, k_LHD: Tensor, v_LHE: Tensor, scale: float) -> Tensor:
        impl = self.impl(q_CHD.dtype, q_CHD.shape[-1], v_LHE.shape[-1])
        if impl is Impl.GRAPH:
            from harts.exec.gpu.split_attention import cudnn_kernel, path_split_attention

            D, E = q_CHD.shape[-1], v_LHE.shape[-1]
            kernels = graph_kernels(D, E)
            if kernels is None:
                raise RuntimeError("HARTS_TREE_ATTENTION=graph: cuDNN's graph attention is unavailable "
                                   "(needs CUDA and nvidia-cudnn-frontend, and its self-check)")
            seg, key_rows, _ = self._segments_for(q_CHD.device)
            sp, idx = self._split_for(q_CHD.device, pieces=True)
            if self._identity is None:
                from harts.exec.gpu.split_attention import identity_keys

                self._identity = identity_keys(seg, k_LHD.shape[0])
            H = q_CHD.shape[1]
            bwd = (split_part_kernel(D, E, H, int(sp.cu_q[-1]), seg.num_segments, sp.max_q, sp.max_q),
                   split_part_kernel(D, E, H, int(sp.qa_index.size), int(sp.cu_qa.size - 1), sp.max_qa, sp.max_ka)
                   if sp.has_ancestors else None)
            return path_split_attention(q_CHD, k_LHD, v_LHE, scale, seg, sp, kernels[0],
                                        bwd if bwd[1] is not None else bwd[0],
                                        key_rows=None if self._identity else key_rows, idx=idx)
        if impl is Impl.CUDNN:
            from harts.exec.gpu.split_attention import cudnn_kernel, split_attention

            # raises (rather than training on wrong numbers) if cuDNN fails its self-check
            kernel = cudnn_kernel(q_CHD.shape[-1], v_LHE.shape[-1])
            sp, idx = self._split_for(q_CHD.device)
            return split_attention(q_CHD, k_LHD, v_LHE, scale, sp, kernel=kernel, idx=idx)
        if impl is Impl.VARLEN:
            from harts.exec.gpu.path_attention import flash_varlen, path_attention

            seg, key_rows, _ = self._segments_for(q_CHD.device)
            return path_attention(q_CHD, k_LHD, v_LHE, scale, seg, kernel=flash_varlen, key_rows=key_rows)
        from harts.exec.gpu.attention import tree_attention, tree_block_mask

        if self._mask is None:
            full = self.q_local_C.numel() == self.end_L.numel()
            self._mask = tree_block_mask(self.end_L, None if full else self.q_local_C)
        return tree_attention(q_CHD, k_LHD, v_LHE, scale, self._mask)


def tree_attention(q_local_C: Tensor, end_L: Tensor, device: torch.device,
                   parent_L=None, q_local_host=None) -> FastTreeAttention | None:
    """The fast ancestor attention for a layout, or None where the dense-mask reference runs.
    parent_L (numpy, local parents) enables the varlen path; q_local_host (numpy, q_local_C's
    values) spares a device-to-host read when a layout's queries are not all its rows."""
    if tree_attention_impl(device) is Impl.REFERENCE:
        return None
    return FastTreeAttention(q_local_C, end_L, parent_L, q_local_host)


def expanded_graph_attention() -> bool:
    """Whether the expanded baseline runs its attention on cuDNN's graph (HARTS_BASELINE_ATTENTION=graph)."""
    return baseline_attention() == "graph"


def packed_causal_attention(q_THD: Tensor, k_THD: Tensor, v_THE: Tensor, cu_seqlens: list[int],
                            scale: float) -> Tensor:
    """Causal attention over packed sequences as one cuDNN graph call (HARTS_BASELINE_ATTENTION=graph):
    the kernel the tree's graph path runs forward, so a row's output has the same bits in
    both modes. Its backward runs without the deterministic flag (long sequences; see
    GRAPH_BACKWARD_MAX_ROWS). Raises where the graph kernel is unavailable."""
    import numpy as np

    from harts.exec.gpu import cudnn_graph
    from harts.exec.gpu.split_attention import cudnn_kernel

    if not (q_THD.is_cuda and cudnn_graph.available()):
        raise RuntimeError("HARTS_BASELINE_ATTENTION=graph needs CUDA and nvidia-cudnn-frontend")
    cu = np.asarray(cu_seqlens, np.int64)
    kern = cudnn_kernel(q_THD.shape[-1], v_THE.shape[-1], "graph-nondet")
    n = int(np.diff(cu).max())
    return cudnn_graph.varlen_fn(kern)(q_THD, k_THD, v_THE, cu, cu, n, n, scale)


def causal_attention(q_HLD: Tensor, k_HLD: Tensor, v_HLE: Tensor, scale: float) -> Tensor:
    """Causal SDPA for one packed sequence (the expanded baseline's attention).

    On CUDA in bf16/fp16, cuDNN's kernel first: it takes MLA's 192 / 128 head dims as they
    are (on the H200 at 32k x 16 heads: 39 ms forward+backward, against 61 ms with the
    values zero-padded for the flash kernel). Where cuDNN refuses, the values are
    zero-padded to the qk dim so the flash kernel runs instead of the math fallback that
    materialises [H, L, L] scores; the padding columns of the output are exactly zero and
    dropped. Fused kernels need 4-D [B, H, L, D] inputs (3-D ones fall back to math)."""
    import torch.nn.functional as F

    D, E = q_HLD.shape[-1], v_HLE.shape[-1]
    if q_HLD.is_cuda and not force_reference():
        if q_HLD.dtype in (torch.bfloat16, torch.float16) and _cudnn_sdpa_ok():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q_HLD[None], k_HLD[None], v_HLE[None], is_causal=True,
                                                          scale=scale)[0]
            except RuntimeError:  # no cuDNN kernel for this shape: the padded flash path below
                pass
        v_pad = F.pad(v_HLE, (0, D - E)) if E < D else v_HLE
        o = F.scaled_dot_product_attention(q_HLD[None], k_HLD[None], v_pad[None], is_causal=True, scale=scale)
        return o[0, ..., :E]
    return F.scaled_dot_product_attention(q_HLD, k_HLD, v_HLE, is_causal=True, scale=scale)
