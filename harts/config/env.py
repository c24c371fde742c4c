"""The one module of harts that reads or writes process environment variables.

Everything else takes its settings as arguments. The variables below are an optional way
to build the default configuration (`KernelConfig.from_env`, read once when a config is
built, never per call), plus the mlflow variables the tracking code needs, the revision
a result's provenance names when the tree is a copy without its own git, and the CPU
thread policy of a `harts` process (`thread_settings`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

# kernel selection (harts.config.kernels.KernelConfig fields they build)
FORCE_REFERENCE = "HARTS_FORCE_REFERENCE"  # force_reference: "1"/"true" runs the references everywhere
TREE_ATTENTION = "HARTS_TREE_ATTENTION"  # tree_attention: graph | cudnn | varlen | flex ("" = auto)
BASELINE_ATTENTION = "HARTS_BASELINE_ATTENTION"  # baseline_attention: cudnn | flash | graph ("" = cudnn)
CONV = "HARTS_CONV"  # conv: triton | reference ("" = auto)
NORM = "HARTS_NORM"  # norm: reference ("" = auto)
CONV_BWD_TILES = "HARTS_CONV_BWD_TILES"  # conv_bwd_tiles: "BD,BT_g,NSUB,warps_g,BT_dx,warps_dx"
FWD_H = "HARTS_FWD_H"  # kda_fwd_h: "fla" | "BV,warps,stages" ("" = auto)
COMPILE = "HARTS_COMPILE"  # compile: inductor | aot_eager ("" = off)
RECTANGLE_TRIANGLES = "HARTS_RECTANGLE_TRIANGLES"  # rectangle_triangles_min_rows: rows (0: off)
CHAIN_STASH_BUDGETS = "HARTS_CHAIN_STASH_BUDGETS"  # chain_stash_device_budgets: budgets >= 0
KERNEL_VARIABLES = (FORCE_REFERENCE, TREE_ATTENTION, BASELINE_ATTENTION, CONV, NORM, CONV_BWD_TILES, FWD_H, COMPILE,
                    RECTANGLE_TRIANGLES, CHAIN_STASH_BUDGETS)

TRACKING_URI = "MLFLOW_TRACKING_URI"
SUPPRESS_URL_PRINTING = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
ARTIFACTS_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def kernel_settings() -> dict[str, str]:
    """The kernel-selection variables that are set to something other than blanks,
    stripped, keyed by variable name."""
    out = {}
    for name in KERNEL_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            out[name] = value
    return out


# a result's git revision where the tree's git metadata is absent or not its own (a copy
# on another machine): harts.bench.provenance.provenance
GIT_REV = "HARTS_GIT_REV"


def git_revision_override() -> str | None:
    """$HARTS_GIT_REV, or None where unset or empty."""
    return os.environ.get(GIT_REV) or None


def tracking_uri() -> str | None:
    """$MLFLOW_TRACKING_URI, or None where unset or empty."""
    return os.environ.get(TRACKING_URI) or None


@contextlib.contextmanager
def mlflow_url_printing_suppressed() -> Iterator[None]:
    """Set MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=true for the block, then restore it."""
    saved = os.environ.get(SUPPRESS_URL_PRINTING)
    os.environ[SUPPRESS_URL_PRINTING] = "true"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(SUPPRESS_URL_PRINTING, None)
        else:
            os.environ[SUPPRESS_URL_PRINTING] = saved


@contextlib.contextmanager
def mlflow_progress_bars_off() -> Iterator[None]:
    """MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false for the block (mlflow reads it per
    transfer), unless the user has set it; then restored."""
    if os.environ.get(ARTIFACTS_PROGRESS_BAR) is not None:
        yield
        return
    os.environ[ARTIFACTS_PROGRESS_BAR] = "false"
    try:
        yield
    finally:
        os.environ.pop(ARTIFACTS_PROGRESS_BAR, None)


# CPU threads of a `harts` process. OpenMP threads that spin while they wait slow a busy
# machine down many times over: on 2 cores shared with other work, `harts verify --input
# <tiny-stepwise> --planner l1l2 --microbatch-tokens 256` took 5.3-57.9 s with 2 threads and
# OpenMP's default waiting (5 runs), 6.0-12.3 s with 2 threads waiting passively (8 runs),
# 5.9-13.5 s with 1 thread (4 runs). So a harts process sizes its threads as
# tests/conftest.py sizes the suite's workers (the CPUs it may use, shared among the
# processes on the host) and has OpenMP's idle threads sleep rather than spin, unless the
# user says otherwise.
THREADS = "HARTS_THREADS"  # explicit intra-op thread count; wins over OMP_NUM_THREADS
OMP_THREADS = "OMP_NUM_THREADS"
MKL_THREADS = "MKL_NUM_THREADS"
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # processes on this host, set by torchrun


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_share(cpus: int, processes: int) -> int:
    """Threads for each of `processes` processes sharing `cpus` CPUs: max(1, cpus // processes)."""
    return max(1, cpus // max(1, processes))


def _positive_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"${name} must be a whole number >= 1, got {raw!r}")
    return value


def thread_settings(environ: Mapping[str, str] | None = None, *, cpus: int | None = None,
                    total_cpus: int | None = None) -> tuple[int, dict[str, str]]:
    """(threads, variables): at most how many intra-op threads a harts process runs, and
    the environment variables to set before torch is imported (OpenMP, MKL and torch size
    their pools from them as they load; worker processes inherit them).

    - $HARTS_THREADS (>= 1) wins: OMP_NUM_THREADS and MKL_NUM_THREADS are set to it.
    - else an OMP_NUM_THREADS the user (or torchrun) set is kept: threads = its value.
    - else threads = `cpu_share(cpus, $LOCAL_WORLD_SIZE or 1)`, set as both variables
      (MKL_NUM_THREADS only where unset) where it is below `total_cpus`; otherwise torch
      keeps its own default (its physical cores, no more than the CPUs).
    OMP_WAIT_POLICY is set to PASSIVE where unset. `cpus` defaults to `available_cpus()`,
    `total_cpus` to os.cpu_count(). A malformed $HARTS_THREADS raises ValueError."""
    environ = os.environ if environ is None else environ
    cpus = available_cpus() if cpus is None else cpus
    total_cpus = (os.cpu_count() or cpus) if total_cpus is None else total_cpus
    out: dict[str, str] = {}
    explicit = _positive_int(environ, THREADS)
    if explicit is not None:
        threads = explicit
        out[OMP_THREADS] = out[MKL_THREADS] = str(threads)
    else:
        try:
            user = _positive_int(environ, OMP_THREADS)
        except ValueError:
            user = None  # not ours to judge: OpenMP reads it as it does
        if user is not None:
            threads = user
        else:
            try:
                processes = _positive_int(environ, LOCAL_WORLD_SIZE) or 1
            except ValueError:
                processes = 1
            threads = cpu_share(cpus, processes)
            if threads < total_cpus:
                out[OMP_THREADS] = str(threads)
                if not environ.get(MKL_THREADS, "").strip():
                    out[MKL_THREADS] = str(threads)
    if not environ.get(OMP_WAIT_POLICY, "").strip():
        out[OMP_WAIT_POLICY] = "PASSIVE"
    return threads, out


def apply_thread_settings(torch_imported: bool) -> int | None:
    """Apply `thread_settings()` to this process: its variables into os.environ when torch
    is not imported yet (they take effect as it loads). With torch already imported the
    variables come too late; then the explicit $HARTS_THREADS count is returned, for the
    caller to apply with torch.set_num_threads (None: nothing to apply)."""
    threads, variables = thread_settings()
    if not torch_imported:
        os.environ.update(variables)
        return None
    return threads if os.environ.get(THREADS, "").strip() else None
