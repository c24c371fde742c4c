"""Hypothesis profiles (`quick` for local runs, the default; `ci` when CI=true), and the
parallel workers' size: pytest-xdist runs test files on `-n auto` workers (pyproject's
addopts), here as many as the CPUs this process may use, at most 4, each with its share
of them as threads."""

import os

# torch-free; the `harts` CLI sizes its threads with the same share (harts.config.env.thread_settings)
from harts.config.env import available_cpus as _cpus
from harts.config.env import cpu_share

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS:
    # before torch is imported (it sizes its thread pool from these) and inherited by every
    # subprocess a test starts: workers x threads stays within the CPUs, since OpenMP's
    # spinning threads slow everything down when they are oversubscribed (the suite took
    # over twice as long on 2 workers x 2 threads as on 2 x 1, on 2 cores)
    _share = str(cpu_share(_cpus(), _WORKERS))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _share)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "quick", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "quick"))


def pytest_ignore_collect(collection_path, config):
    """tests/cuda imports the GPU kernels (and so triton) when it is collected; a run that does
    not select the `cuda` marker does not collect it, so the TRITON_INTERPRET=1 tests of
    tests/exec/gpu still find triton unimported and run interpreted."""
    if collection_path.name != "cuda" or collection_path.parent.name != "tests":
        return None
    return None if _cuda_selected(config) else True


def _cuda_selected(config) -> bool:
    """Whether the run's -m expression selects the `cuda` marker."""
    expr = (config.getoption("markexpr") or "").replace(" ", "")
    return "cuda" in expr and "notcuda" not in expr


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: the CPUs this process may use, at most 4 (each worker holds a torch and
    the distributed tests start 2-4 processes of their own); none (in-process) for the GPU
    tests, which share one device."""
    return 0 if _cuda_selected(config) else min(_cpus(), 4)
