"""Varlen attention on cuDNN's graph API: one call for all sequences, forward and backward.

Legend: T packed rows, B sequences, H heads, D qk dim, E value dim, S a sequence-length
bound (the graph's padded length).

`split` needs a varlen kernel (many sequences in one call). torch 2.11's ragged
cuDNN entry (`_cudnn_attention_forward/_backward` with cumulative lengths) has a wrong
backward on any sequence longer than the head dim: it sizes cuDNN's dQ accumulator by
`query.size(2)`, which on the flat [T, H, D] layout is D (pytorch/pytorch#186142, fixed
upstream after 2.11). So the split ran one dense cuDNN call per sequence, and on a layout of
many short segments (small-treestep tiled to 32k: 39 segments, ~136 calls per forward and
backward) the host spent 29 ms launching 9.5 ms of kernels
(benchmarks/results/attention/2026-11-29-46fd948-attnvar.json).

cuDNN's own frontend (`nvidia-cudnn-frontend`, the library torch vendors for these ops)
builds the same fused flash-attention kernels from a graph whose dims and ragged offsets we
set ourselves, so its buffers are sized from the true bound. We use it as an optional GPU
dependency rather than writing an attention kernel: its backward is cuDNN's, the one the
expanded baseline runs through `scaled_dot_product_attention`.

The graph: q, k, v, o (and dq, dk, dv, dO) as [B, H, S, D] tensors over packed rows, each
row `ts` elements apart and heads `hs` apart (strided views of [T, H, D] rows work as they
are), placed by ragged offsets `cu * ts`; a padding mask from the per-sequence lengths;
causal top-left (the split's parts need no other) or bottom-right; softmax statistics out
as float32, either ragged ([T, H] token-major, read as the log-sum-exp directly) or padded
([B, S, H], rows gathered), whichever passes the self-check. Graphs are cached by shape:
B and S rounded up into buckets (`bucket_batch`: empty sequences pad the batch;
`bucket_len`: the mask uses the true lengths), so a training run with changing layouts
builds a graph per new bucket, not per step (a backward graph takes ~1 s to build).

`GraphKernel.fwd_call` / `bwd_call` build (or fetch) a graph and its variant pack without
running it (`GraphCall.run`); with `all_plans` every plan cuDNN offers is built, and
`plan_table` times each (on the H200 the heuristic's choice was the fastest forward within
3%, and the backward has a single plan:
benchmarks/results/attention/2026-11-30-3967089-attnplans.json).

Host-only pieces (`ragged_metadata`, `padded_rows`, `bucket_len`, `bucket_batch`,
`pad_batch`) are pure numpy and tested on CPU; the
kernel itself is checked on the GPU against the float64 reference by
`split.cudnn_kernel(variant="graph")` before first use.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
from torch import Tensor

from harts.exec.ops.attention.kernel import VarlenKernel
from harts.exec.transfer import to_device

S_ROUND = 256  # the smallest sequence-length bound of a cached graph (bounds are multiples of 64)


def bucket_len(n: int) -> int:
    """A graph's sequence-length bound for sequences of at most n rows: the smallest
    256 * 2^k * (1 + j/4) (j = 0..3) that holds n, so a training run's changing layouts
    share graphs (four bounds per octave; at most 25% over n, the rows past a sequence's
    length are masked). A new graph's backward takes ~1 s to build on the H200
    (benchmarks/results/attention/2026-11-30-3dbd850-graphbuild.json), its forward ~50 ms."""
    n = max(int(n), 1)
    base = S_ROUND
    while base * 2 < n:
        base *= 2
    for j in range(5):
        b = base * (4 + j) // 4
        if b >= n:
            return b
    return base * 2


def bucket_batch(B: int) -> int:
    """A graph's sequence count for B sequences: a multiple of 8 up to 64, then the next
    of 64 * 2^k * {1, 1.5}; the batch is padded with empty sequences (zero rows: checked
    against the reference on the H200,
    benchmarks/results/attention/2026-11-30-3dbd850-graphbuild.json, and in every kernel's
    self-check)."""
    B = max(int(B), 1)
    if B <= 64:
        return -(-B // 8) * 8
    base = 64
    while base * 2 < B:
        base *= 2
    return base * 3 // 2 if base * 3 // 2 >= B else base * 2


def pad_batch(cu: np.ndarray, B: int) -> np.ndarray:
    """Cumulative lengths `cu` padded with empty sequences to B sequences."""
    cu = np.asarray(cu, np.int64)
    return np.concatenate([cu, np.full(B + 1 - cu.size, cu[-1], np.int64)]) if cu.size < B + 1 else cu


def ragged_metadata(cu: np.ndarray, token_stride: int) -> np.ndarray:
    """Ragged offsets (elements) of a packed tensor whose rows are `token_stride` apart."""
    off = np.asarray(cu, np.int64) * int(token_stride)
    if off.size and off[-1] >= 2 ** 31:
        raise ValueError("ragged offsets past int32: too many rows for one graph call")
    return off.astype(np.int32)


def padded_rows(cu: np.ndarray, S: int) -> np.ndarray:
    """For each packed row t of sequence b at position s, its row b * S + s of a padded
    [B, S, ...] buffer."""
    cu = np.asarray(cu, np.int64)
    n = np.diff(cu)
    b = np.repeat(np.arange(n.size, dtype=np.int64), n)
    return b * int(S) + (np.arange(int(cu[-1]) if cu.size else 0, dtype=np.int64) - np.repeat(cu[:-1], n))


@functools.cache
def available() -> bool:
    """Whether the cuDNN frontend imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.backends.cudnn.version()  # loads libcudnn, which the frontend then finds
        import cudnn  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


_LOCK = threading.Lock()
_HANDLES: dict[int, int] = {}


def _handle(device: torch.device) -> int:
    import cudnn

    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        if idx not in _HANDLES:
            with torch.cuda.device(idx):
                _HANDLES[idx] = cudnn.create_handle()
    return _HANDLES[idx]


def _dtype(dt: torch.dtype):
    import cudnn

    return {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dt]


# uids of the graph tensors
Q, K, V, O, STATS, DO, DQ, DK, DV, SEQ_Q, SEQ_K, R_Q, R_K, R_V, R_O, R_STATS, R_DQ, R_DK, R_DV = range(1, 20)


def _layout(x: Tensor) -> tuple[int, int]:
    """(token stride, head stride) of a [T, H, D] tensor with a unit innermost stride."""
    return int(x.stride(0)), int(x.stride(1))


def _fit(x: Tensor) -> Tensor:
    """x as it is when cuDNN can read it (unit innermost stride, 16-byte aligned rows and
    base), else a contiguous copy."""
    ok = (x.stride(2) == 1 and x.stride(0) * x.element_size() % 16 == 0 and x.stride(1) * x.element_size() % 16 == 0
          and x.data_ptr() % 16 == 0)
    return x if ok else x.contiguous()


class GraphCache:
    """Built cuDNN graphs by key (one per shape bucket and layout), with their workspace sizes."""

    def __init__(self):
        self.graphs: dict = {}
        self.builds = 0

    def get(self, key, build):
        g = self.graphs.get(key)
        if g is None:
            with _LOCK:
                g = self.graphs.get(key)
                if g is None:
                    g = build()
                    self.graphs[key] = g
                    self.builds += 1
        return g


def _tensor(g, uid, name, B, H, S, D, ts, hs, dt, ragged=None):
    t = g.tensor(name=name, dim=[B, H, S, D], stride=[S * ts, hs, ts, 1], data_type=dt, uid=uid)
    if ragged is not None:
        t.set_ragged_offset(ragged)
    return t


def _meta(g, uid, name, B):
    import cudnn

    return g.tensor(name=name, dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32, uid=uid)


def _stats_attrs(B, H, S):
    # token-major within a sequence: row s of head h at s * H + h (ragged: sequence b at cu[b] * H)
    return [B, H, S, 1], [S * H, 1, H, 1]


def _mask_args(causal: bool, bottom_right: bool):
    import cudnn

    if not causal:
        return {}
    return {"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT if bottom_right else
            cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}


def _finish(g, all_plans: bool = False):
    """Validate and build `g`: the heuristic's first supported plan (cuDNN's choice, the
    one torch's SDPA takes too), or with `all_plans` every plan heuristics A, B and the
    fallback list (for `plan_table`: `GraphCall.run(index=i)` runs plan i)."""
    import cudnn

    g.validate()
    g.build_operation_graph()
    modes = [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
    if all_plans:
        try:
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        except Exception:  # noqa: BLE001 - heuristic B is not offered for every graph
            g.create_execution_plans(modes)
    else:
        g.create_execution_plans(modes)
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL if all_plans else cudnn.build_plan_policy.HEURISTICS_CHOICE)
    return g, int(g.get_workspace_size())


def _build_fwd(handle, dt, B, H, Sq, Sk, D, E, lq, lk, lv, scale, causal, bottom_right, stats_ragged,
               all_plans=False):
    import cudnn

    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    rq, rk, rv, ro = (_meta(g, u, n, B + 1) for u, n in ((R_Q, "rq"), (R_K, "rk"), (R_V, "rv"), (R_O, "ro")))
    q = _tensor(g, Q, "q", B, H, Sq, D, *lq, dt, rq)
    k = _tensor(g, K, "k", B, H, Sk, D, *lk, dt, rk)
    v = _tensor(g, V, "v", B, H, Sk, E, *lv, dt, rv)
    sq, sk = _meta(g, SEQ_Q, "seq_q", B), _meta(g, SEQ_K, "seq_k", B)
    o, st = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale, use_padding_mask=True,
                   seq_len_q=sq, seq_len_kv=sk, **_mask_args(causal, bottom_right))
    o.set_output(True).set_dim([B, H, Sq, E]).set_stride([Sq * H * E, E, H * E, 1]).set_ragged_offset(ro)
    dims, strides = _stats_attrs(B, H, Sq)
    st.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(dims).set_stride(strides).set_uid(STATS)
    if stats_ragged:
        st.set_ragged_offset(_meta(g, R_STATS, "rs", B + 1))
    o.set_uid(O)
    return _finish(g, all_plans)


def _build_bwd(handle, dt, B, H, Sq, Sk, D, E, lq, lk, lv, lo, scale, causal, bottom_right, stats_ragged,
               deterministic, all_plans=False):
    import cudnn

    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    names = ((R_Q, "rq"), (R_K, "rk"), (R_V, "rv"), (R_O, "ro"), (R_DQ, "rdq"), (R_DK, "rdk"), (R_DV, "rdv"))
    rq, rk, rv, ro, rdq, rdk, rdv = (_meta(g, u, n, B + 1) for u, n in names)
    q = _tensor(g, Q, "q", B, H, Sq, D, *lq, dt, rq)
    k = _tensor(g, K, "k", B, H, Sk, D, *lk, dt, rk)
    v = _tensor(g, V, "v", B, H, Sk, E, *lv, dt, rv)
    o = _tensor(g, O, "o", B, H, Sq, E, *lo, dt, ro)
    do = _tensor(g, DO, "do", B, H, Sq, E, *lo, dt, ro)
    dims, strides = _stats_attrs(B, H, Sq)
    st = g.tensor(name="stats", dim=dims, stride=strides, data_type=cudnn.data_type.FLOAT, uid=STATS)
    if stats_ragged:
        st.set_ragged_offset(_meta(g, R_STATS, "rs", B + 1))
    sq, sk = _meta(g, SEQ_Q, "seq_q", B), _meta(g, SEQ_K, "seq_k", B)
    dq, dk, dv = g.sdpa_backward(name="sdpa_bwd", q=q, k=k, v=v, o=o, dO=do, stats=st, attn_scale=scale,
                                 use_padding_mask=True, seq_len_q=sq, seq_len_kv=sk,
                                 use_deterministic_algorithm=deterministic, **_mask_args(causal, bottom_right))
    dq.set_output(True).set_dim([B, H, Sq, D]).set_stride([Sq * H * D, D, H * D, 1]).set_ragged_offset(rdq).set_uid(DQ)
    dk.set_output(True).set_dim([B, H, Sk, D]).set_stride([Sk * H * D, D, H * D, 1]).set_ragged_offset(rdk).set_uid(DK)
    dv.set_output(True).set_dim([B, H, Sk, E]).set_stride([Sk * H * E, E, H * E, 1]).set_ragged_offset(rdv).set_uid(DV)
    return _finish(g, all_plans)


class GraphKernel(VarlenKernel):
    """A `kernel.VarlenKernel` on cuDNN graphs: one forward and one backward call
    for all sequences. `bottom_right` aligns causal masks to the bottom right (a sequence
    with fewer queries than keys: `path_attention`'s layout). `factor` (natural log per
    unit of cuDNN's statistics) and `stats_ragged` are set by the self-check."""

    def __init__(self, bottom_right: bool = False, stats_ragged: bool = True, deterministic: bool = True):
        self.bottom_right = bottom_right
        self.stats_ragged = stats_ragged
        self.deterministic = deterministic
        self.factor = 1.0
        self.cache = GraphCache()
        self.name = (f"cudnn-graph{'-br' if bottom_right else ''}-{'ragged' if stats_ragged else 'padded'}-stats"
                     f"{'' if deterministic else '-nondet'}")
        self._meta: dict = {}

    # per-layout metadata on the device, keyed by the cumulative lengths' bytes
    def _device_meta(self, cu_q, cu_k, Sq, layouts, device):
        key = (cu_q.tobytes(), cu_k.tobytes(), Sq, layouts, str(device))
        m = self._meta.get(key)
        if m is None:
            if len(self._meta) > 256:
                self._meta.clear()
            cu_q, cu_k = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
            lq, lk, lv, lo, H = layouts
            host = {SEQ_Q: np.diff(cu_q).astype(np.int32), SEQ_K: np.diff(cu_k).astype(np.int32),
                    R_Q: ragged_metadata(cu_q, lq[0]), R_K: ragged_metadata(cu_k, lk[0]),
                    R_V: ragged_metadata(cu_k, lv[0]), R_O: ragged_metadata(cu_q, lo[0]),
                    R_STATS: ragged_metadata(cu_q, H)}
            m = {u: to_device(a, device) for u, a in host.items()}
            if not self.stats_ragged:
                m["rows"] = to_device(padded_rows(cu_q, Sq), device)
            self._meta[key] = m
        return m

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        call = self.fwd_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        if call.graph is not None:
            call.run()
        o, stats, aux, rows = call.outputs
        lse = stats if rows is None else stats.index_select(0, rows)
        if self.factor != 1.0:
            lse = lse * self.factor
        return o, lse, aux

    def fwd_call(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, all_plans: bool = False) -> GraphCall:
        """The forward's graph and variant pack, not run: outputs (o, stats, aux, padded
        rows or None). `all_plans`: a fresh, uncached graph with every plan built."""
        q, k, v = _fit(q), _fit(k), _fit(v)
        T, H, D = q.shape
        E = v.shape[-1]
        o = torch.empty(T, H, E, dtype=q.dtype, device=q.device)
        if np.asarray(cu_q).size < 2 or T == 0:
            return GraphCall(None, 0, {}, 0, (o, torch.empty(T, H, dtype=torch.float32, device=q.device), None, None))
        B = bucket_batch(np.asarray(cu_q).size - 1)
        cu_q, cu_k = pad_batch(cu_q, B), pad_batch(cu_k, B)
        Sq, Sk = bucket_len(max_q), bucket_len(max_k)
        lq, lk, lv, lo = _layout(q), _layout(k), _layout(v), (H * E, E)
        handle = _handle(q.device)
        dt = _dtype(q.dtype)
        build = lambda: _build_fwd(handle, dt, B, H, Sq, Sk, D, E, lq, lk, lv, float(scale),  # noqa: E731
                                   bool(causal), self.bottom_right, self.stats_ragged, all_plans)
        g, ws = build() if all_plans else self.cache.get(
            ("fwd", q.dtype, B, H, Sq, Sk, D, E, lq, lk, lv, float(scale), bool(causal)), build)
        meta = self._device_meta(cu_q, cu_k, Sq, (lq, lk, lv, lo, H), q.device)
        stats = torch.empty(T if self.stats_ragged else B * Sq, H, dtype=torch.float32, device=q.device)
        pack = {Q: q.data_ptr(), K: k.data_ptr(), V: v.data_ptr(), O: o.data_ptr(), STATS: stats.data_ptr()}
        pack.update({u: meta[u].data_ptr() for u in (SEQ_Q, SEQ_K, R_Q, R_K, R_V, R_O)})
        if self.stats_ragged:
            pack[R_STATS] = meta[R_STATS].data_ptr()
        # the inputs are kept alive with the pack (their pointers are in it)
        return GraphCall(g, ws, pack, handle, (o, stats, (Sq, Sk), None if self.stats_ragged else meta["rows"]),
                         keep=(q, k, v, meta))

    def bwd(self, do, q, k, v, o, lse, aux, cu_q, cu_k, max_q, max_k, causal, scale):
        call = self.bwd_call(do, q, k, v, o, lse, aux, cu_q, cu_k, max_q, max_k, causal, scale)
        if call.graph is not None:
            call.run()
        return call.outputs

    def bwd_call(self, do, q, k, v, o, lse, aux, cu_q, cu_k, max_q, max_k, causal, scale,
                 all_plans: bool = False) -> GraphCall:
        """The backward's graph and variant pack, not run: outputs (dq, dk, dv)."""
        q, k, v, o, do = _fit(q), _fit(k), _fit(v), _fit(o), _fit(do)
        if _layout(do) != _layout(o):
            do = do.contiguous()
            o = o.contiguous()
        T, H, D = q.shape
        E = v.shape[-1]
        n_q, n_k = np.diff(np.asarray(cu_q)), np.diff(np.asarray(cu_k))
        # rows of k, v that no query reads keep a zero gradient (cuDNN writes only its rows)
        full_k = n_k.size > 0 and int(np.asarray(cu_k)[-1]) == k.shape[0]
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        make = torch.zeros if (not full_k or ((n_q == 0) & (n_k > 0)).any()) else torch.empty
        dk = make(k.shape, dtype=k.dtype, device=k.device)
        dv = make(v.shape, dtype=v.dtype, device=v.device)
        if n_q.size == 0 or T == 0:
            return GraphCall(None, 0, {}, 0, (dq.zero_(), dk.zero_(), dv.zero_()))
        B = bucket_batch(n_q.size)
        cu_q, cu_k = pad_batch(cu_q, B), pad_batch(cu_k, B)
        Sq, Sk = aux if aux is not None else (bucket_len(max_q), bucket_len(max_k))
        lq, lk, lv, lo = _layout(q), _layout(k), _layout(v), _layout(o)
        handle = _handle(q.device)
        dt = _dtype(q.dtype)
        build = lambda: _build_bwd(handle, dt, B, H, Sq, Sk, D, E, lq, lk, lv, lo, float(scale),  # noqa: E731
                                   bool(causal), self.bottom_right, self.stats_ragged, self.deterministic, all_plans)
        g, ws = build() if all_plans else self.cache.get(
            ("bwd", q.dtype, B, H, Sq, Sk, D, E, lq, lk, lv, lo, float(scale), bool(causal), self.deterministic), build)
        meta = self._device_meta(cu_q, cu_k, Sq, (lq, lk, lv, lo, H), q.device)
        packed = self._device_meta(cu_q, cu_k, Sq, ((H * D, D), (H * D, D), (H * E, E), lo, H), q.device)
        st = (lse.float() / self.factor) if self.factor != 1.0 else lse.float()
        if self.stats_ragged:
            st = st.contiguous()
        else:
            st = torch.zeros(B * Sq, H, dtype=torch.float32, device=q.device).index_copy_(0, meta["rows"], st)
        pack = {Q: q.data_ptr(), K: k.data_ptr(), V: v.data_ptr(), O: o.data_ptr(), DO: do.data_ptr(),
                STATS: st.data_ptr(), DQ: dq.data_ptr(), DK: dk.data_ptr(), DV: dv.data_ptr()}
        pack.update({u: meta[u].data_ptr() for u in (SEQ_Q, SEQ_K, R_Q, R_K, R_V, R_O)})
        pack.update({R_DQ: packed[R_Q].data_ptr(), R_DK: packed[R_K].data_ptr(), R_DV: packed[R_V].data_ptr()})
        if self.stats_ragged:
            pack[R_STATS] = meta[R_STATS].data_ptr()
        return GraphCall(g, ws, pack, handle, (dq, dk, dv), keep=(q, k, v, o, do, st, meta, packed))


class GraphCall:
    """A built graph with its variant pack (tensor pointers by uid) and outputs, ready to
    run: `run()` the graph's chosen plan, `run(index=i)` plan i of a graph built with
    `all_plans` (`plan_table`). `keep` holds the tensors whose pointers the pack has."""

    def __init__(self, graph, ws: int, pack: dict, handle, outputs, keep=()):
        self.graph, self.ws, self.pack, self.handle, self.outputs, self.keep = graph, ws, pack, handle, outputs, keep

    def run(self, index: int | None = None) -> None:
        import cudnn

        dev = self.outputs[0].device  # o or dq
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(dev).cuda_stream)
        ws = self.ws if index is None else int(self.graph.get_workspace_size_plan_at_index(index))
        work = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
        if index is None:
            self.graph._execute(self.pack, work.data_ptr(), self.handle)
        else:
            self.graph._execute_plan_at_index(self.pack, work.data_ptr(), int(index), self.handle)


def plan_table(call: GraphCall, time_fn) -> list[dict]:
    """Every plan of a graph built with `all_plans`: its index, name, workspace bytes,
    seconds per run (`time_fn(fn)`), and the largest relative difference of its outputs
    from plan 0's (the heuristic's first choice); a plan that fails to run records its error."""
    g = call.graph
    out, ref = [], None
    for i in range(int(g.get_execution_plan_count())):
        row = {"index": i}
        try:
            row["name"] = str(g.get_plan_name_at_index(i))
            row["workspace_bytes"] = int(g.get_workspace_size_plan_at_index(i))
            outs = [x for x in call.outputs if isinstance(x, Tensor) and x.is_floating_point()]
            for x in outs:
                x.zero_()
            call.run(i)
            torch.cuda.synchronize()
            got = [x.detach().double().clone() for x in outs]
            if ref is None:
                ref = got
            row["max_rel_diff_vs_plan0"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                                               for a, b in zip(got, ref, strict=True))
            row["s"] = time_fn(lambda i=i: call.run(i))
        except Exception as err:  # noqa: BLE001 - record and try the next plan
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        out.append(row)
    return out


@torch.no_grad()
def setup(qk_dim: int, v_dim: int, bottom_right: bool = False, deterministic: bool = True) -> GraphKernel:
    """A graph kernel whose statistics layout (ragged first, then padded) and base (e or 2)
    match the float64 reference on a causal case; raises if neither does. The caller runs
    the full self-check (`split._check`) on the result."""
    from harts.exec.ops.attention.kernel import REFERENCE, _case

    if not available():
        raise RuntimeError("the cuDNN frontend (nvidia-cudnn-frontend) or CUDA is not available")
    errors = []
    n = [5, 19, 40]
    q, k, v, _, cu, _ = _case(qk_dim, v_dim, n, n, 0)
    scale = qk_dim ** -0.5
    _, lse_ref, _ = REFERENCE.fwd(*(x.double() for x in (q, k, v)), cu, cu, 40, 40, True, scale)
    for ragged in (True, False):
        kern = GraphKernel(bottom_right, ragged, deterministic)
        try:
            _, lse, _ = kern.fwd(q, k, v, cu, cu, 40, 40, True, scale)
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - this layout is not supported: try the next
            errors.append(f"{kern.name}: {type(err).__name__}: {err}"[:300])
            continue
        for factor in (1.0, math.log(2.0)):
            if (lse.double() * factor - lse_ref).abs().max() < 2e-2:
                kern.factor = factor
                return kern
        errors.append(f"{kern.name}: log-sum-exp does not match in base e or 2")
    raise RuntimeError("cuDNN graph attention unusable: " + "; ".join(errors))


class _Varlen(torch.autograd.Function):
    """o = attention(q, k, v) over packed sequences with one graph call each way."""

    @staticmethod
    def forward(ctx, q, k, v, kern, cu_q, cu_k, max_q, max_k, scale, causal):
        o, lse, aux = kern.fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (kern, cu_q, cu_k, max_q, max_k, scale, causal, aux)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        kern, cu_q, cu_k, max_q, max_k, scale, causal, aux = ctx.args
        dq, dk, dv = kern.bwd(do, q, k, v, o, lse, aux, cu_q, cu_k, max_q, max_k, causal, scale)
        return dq, dk, dv, None, None, None, None, None, None, None


def varlen_fn(kern: GraphKernel, causal: bool = True):
    """`path_attention`'s kernel signature (q, k, v, cu_q, cu_k, max_q, max_k, scale) -> o
    on a bottom-right graph kernel (values need no padding to the qk dim)."""
    def fn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return _Varlen.apply(q, k, v, kern, cu_q, cu_k, max_q, max_k, scale, causal)

    fn.pads_values = False
    return fn


@torch.no_grad()
def check_bottom_right(kern: GraphKernel, qk_dim: int, v_dim: int) -> GraphKernel:
    """Bottom-right causal sequences with fewer queries than keys (short and long) against
    the float64 reference's explicit formulas (`kernel.REFERENCE_BOTTOM_RIGHT`):
    outputs, log-sum-exp and every gradient; raises on a mismatch. No autograd: it runs
    wherever the first forward runs (under no_grad, inside activation checkpointing)."""
    from harts.exec.ops.attention.kernel import REFERENCE_BOTTOM_RIGHT, _case

    scale = qk_dim ** -0.5
    for nq, nk in (([5, 19, 40], [9, 50, 41]), ([300, 1000, 700], [1300, 1000, 2500]), ([1, 3, 70], [4, 3, 200])):
        q, k, v, do, cu_q, cu_k = _case(qk_dim, v_dim, nq, nk, 2)
        wide = [x.double() for x in (q, k, v)]
        o_ref, lse_ref, _ = REFERENCE_BOTTOM_RIGHT.fwd(*wide, cu_q, cu_k, max(nq), max(nk), True, scale)
        ref = REFERENCE_BOTTOM_RIGHT.bwd(do.double(), *wide, o_ref, lse_ref, None, cu_q, cu_k, max(nq), max(nk), True,
                                         scale)
        o, lse, aux = kern.fwd(q, k, v, cu_q, cu_k, max(nq), max(nk), True, scale)
        grads = kern.bwd(do, q, k, v, o, lse, aux, cu_q, cu_k, max(nq), max(nk), True, scale)
        torch.cuda.synchronize()
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), (o_ref, lse_ref, *ref), strict=True):
            if not torch.isfinite(a).all() or (a.double() - b).norm() > 3e-2 * b.norm():
                raise RuntimeError(f"cuDNN graph attention (bottom-right) does not match the reference ({name})")
    return kern
