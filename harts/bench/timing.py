"""Timing helpers of the benchmarks: CUDA-event medians (`time_cuda`) and steady-state step
times with the data side prepared one step ahead (`prefetched_steps`)."""

from __future__ import annotations

import statistics
import time

import torch


def sync_cuda() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_cuda(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of fn() with CUDA events."""
    for _ in range(warmup):
        fn()
    sync_cuda()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def prefetched_steps(trainer, trajectories, microbatch_tokens: int, steps: int) -> tuple[list[float], list[float]]:
    """Steady-state step times of `harts.exec.trainer.run_steps` with prefetch: a background
    thread prepares step i+1's partition and layouts (`trainer.prepare`: host numpy work and
    async copies) while step i runs, as a data loader would. Each time runs from the end of
    one step to the end of the next, so any wait for the preparation (and any slowdown of
    kernel launches by the thread) is counted; the first step, whose preparation nothing
    overlaps, is not timed. Returns (step seconds, preparation seconds), `steps` of each."""
    from harts.exec.trainer import run_steps

    prep_seconds = []
    prepare = trainer.prepare

    def timed_prepare(*a, **kw):
        p = prepare(*a, **kw)
        prep_seconds.append(p.seconds)
        return p

    trainer.prepare = timed_prepare
    times, last = [], None
    try:
        for _ in run_steps(trainer, [trajectories] * (steps + 1), microbatch_tokens, prefetch=True):
            sync_cuda()
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
    finally:
        del trainer.prepare
    return times, prep_seconds[1:]
