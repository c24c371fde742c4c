"""`step_benchmark` (behind `harts bench`) runs end to end on CPU with the CUDA memory
calls stubbed: both modes train, the limits are consistent, the speedup is a ratio of the
measured times (no number here is asserted about speed)."""

import pytest
import torch

from harts.exec.bench import step_benchmark
from harts.tree.workload import generate, preset


def test_step_benchmark_on_cpu(monkeypatch):
    for name, value in (("reset_peak_memory_stats", None), ("max_memory_allocated", 0), ("empty_cache", None)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, value=value, **k: value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    trajs = generate(preset("tiny-treestep", vocab_size=512)).trajectories()
    r = step_benchmark(trajs, model="tiny-cpu", dtype=torch.float32, microbatch_tokens=4096, steps=1,
                       warmup=0, device="cpu")
    assert r["expanded_tokens"] == sum(len(t) for t in trajs)
    assert r["speedup"] == pytest.approx(r["expanded"]["seconds"] / r["tree"]["seconds"])
    assert r["speedup_inline"] == pytest.approx(r["expanded"]["inline_seconds"] / r["tree"]["inline_seconds"])
    for mode in ("expanded", "tree"):  # one timed step each way, the data side prepared ahead or inline
        assert len(r[mode]["all_seconds"]) == len(r[mode]["all_inline_seconds"]) == 1
        assert r[mode]["prepare_seconds"] > 0
    assert r["speedup_over_limit"] == pytest.approx(r["speedup"] / r["flop_limit"])
    # GEMM FLOPs follow the row ratio, attention less: the FLOP limit lies between
    parts = r["flop_limit_parts"]
    assert parts["attention_ratio"] <= r["flop_limit"] <= parts["gemm_ratio"]
    assert parts["gemm_ratio"] == pytest.approx(r["expanded_tokens"] / r["tree"]["rows"])
    assert r["tree"]["loss"] == pytest.approx(r["expanded"]["loss"], rel=1e-4)
