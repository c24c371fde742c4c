"""`benchmarks/gpu/window_anatomy.py`'s `op_sources` on a hand-made chrome trace: each
device activity goes to the innermost profiled op around its launch and to the autograd
node whose backward ran it (the node found on the launching thread, whichever thread
that is), memsets and fills and copies apart from other kernels, unlaunched kernels
"unattributed"."""

from benchmarks.gpu.window_anatomy import launch_kind, op_sources


def _op(name, tid, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "tid": tid, "ts": ts, "dur": dur}


def _launch(corr, tid, ts):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "ts": ts, "dur": 1,
            "args": {"correlation": corr}}


def _kernel(corr, name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "tid": 7, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_kernels_go_to_the_op_and_the_autograd_node_that_launched_them():
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
    add = "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<float>>"
    events = [
        # forward, host thread 1: aten::add launches an add kernel
        _op("aten::add", 1, 0, 10), _launch(1, 1, 5),
        # backward, engine thread 2: SliceBackward0 > aten::zeros > aten::fill_ launches a fill,
        # then aten::copy_ a copy; a memset inside aten::zero_ of the same node
        _op("autograd::engine::evaluate_function: SliceBackward0", 2, 100, 50),
        _op("aten::zeros", 2, 101, 10), _op("aten::fill_", 2, 102, 5), _launch(2, 2, 103),
        _op("aten::copy_", 2, 120, 10), _launch(3, 2, 121),
        _op("aten::zero_", 2, 135, 5), _launch(4, 2, 136),
        # a second slice backward: the same key again
        _op("autograd::engine::evaluate_function: SliceBackward0", 2, 200, 50),
        _op("aten::zeros", 2, 201, 10), _op("aten::fill_", 2, 202, 5), _launch(5, 2, 203),
        _kernel(1, add, 6, 4),
        _kernel(2, fill, 104, 2),
        _kernel(3, "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", 122, 3),
        _kernel(4, "Memset (Device)", 137, 1, cat="gpu_memset"),
        _kernel(5, fill, 204, 2),
        _kernel(99, add, 300, 1),  # its launch is not in the trace
    ]
    rows = {(k, op, node): (n, round(s * 1e6)) for k, op, node, n, s in op_sources(events)}
    assert rows == {
        ("memset or fill", "aten::fill_", "SliceBackward0"): (2, 4),
        ("copy or cast", "aten::copy_", "SliceBackward0"): (1, 3),
        ("memset or fill", "aten::zero_", "SliceBackward0"): (1, 1),
        ("elementwise and cat", "aten::add", "forward"): (1, 4),
        ("elementwise and cat", "unattributed", "unattributed"): (1, 1),
    }
    # most launched first, and `top` keeps that many
    assert op_sources(events)[0][:4] == ("memset or fill", "aten::fill_", "SliceBackward0", 2)
    assert len(op_sources(events, top=2)) == 2


def test_launch_kinds():
    assert launch_kind("Memset (Device)") == "memset or fill"
    assert launch_kind("Memcpy DtoD (Device -> Device)") == "copy or cast"
    assert launch_kind("Memcpy HtoD (Pinned -> Device)") == "memory copies"
    assert launch_kind("void at::native::vectorized_elementwise_kernel<4, bfloat16_copy_kernel_cuda>") == "copy or cast"
    assert launch_kind("chunk_kda_bwd_kernel_intra") == "KDA"
