"""Shared machinery of the GPU benchmark suites (`benchmarks/gpu/<topic>.py`).

Each suite is a script with named sections:

    python3 benchmarks/gpu/<topic>.py [SECTION...] [--out DIR] [options]

`run_suite` parses the common options, runs the chosen sections (all by default), records
an exception in a section's JSON instead of stopping the others, writes
DIR/<topic>_<section>.json with the result and its provenance (git revision, exact
command, package versions, GPU, date), and prints a short table last.

Timing is `time_cuda`: CUDA events around each call, warm-up calls first, the median of the
repeats. Kernel choices that the library still reads from environment variables are set
through `kernel_env` only, so that they can move to a configuration object in one place.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as _md
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
RESULT_SCHEMA = "harts.bench.gpu/v1"

# environment variables through which today's library picks its kernels (read at call
# time by harts.exec); `kernel_env` is the one place the suites set them
KERNEL_ENV = {
    "tree_attention": "HARTS_TREE_ATTENTION",  # default | cudnn | graph | varlen | flex
    "baseline_attention": "HARTS_BASELINE_ATTENTION",  # default (torch SDPA) | graph
    "conv": "HARTS_CONV",  # default (fused Triton) | reference | triton
    "conv_bwd_tiles": "HARTS_CONV_BWD_TILES",  # "BD,BT_g,NSUB,warps_g,BT_dx,warps_dx"
    "fwd_h": "HARTS_FWD_H",  # default rule | fla | "BV,warps,stages"
    "force_reference": "HARTS_FORCE_REFERENCE",  # 1: the reference (non-fused) paths everywhere
}


@contextmanager
def kernel_env(**choices: str | None) -> Iterator[None]:
    """A block running with the given kernel choices (keys of KERNEL_ENV; a value sets the
    choice, "" or "default" runs the library's default, None leaves the setting as it is),
    restoring the previous settings after. Unknown keys fail loudly."""
    unknown = sorted(set(choices) - set(KERNEL_ENV))
    if unknown:
        raise KeyError(f"unknown kernel choice(s) {unknown}; known: {sorted(KERNEL_ENV)}")
    saved = {KERNEL_ENV[k]: os.environ.get(KERNEL_ENV[k]) for k in choices}
    try:
        for k, v in choices.items():
            if v is None:
                continue
            if v in ("", "default"):
                os.environ.pop(KERNEL_ENV[k], None)
            else:
                os.environ[KERNEL_ENV[k]] = v
        yield
    finally:
        for name, v in saved.items():
            if v is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = v


def kernel_choices() -> dict[str, str]:
    """The kernel choices in force (those set; the rest run the library's defaults)."""
    return {k: os.environ[v] for k, v in KERNEL_ENV.items() if os.environ.get(v)}


# ---------------------------------------------------------------------------- timing


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_cuda(fn: Callable[[], Any], repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of fn() measured with CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b (in float64); inf if a has a non-finite entry."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("inf")


# ----------------------------------------------------------------- tree layouts


def parents_from_ends(end_np: np.ndarray) -> np.ndarray:
    """Local parents from DFS subtree ends: each row's nearest earlier row whose subtree covers it."""
    parent = np.full(end_np.size, -1, np.int64)
    stack: list[int] = []
    for r in range(end_np.size):
        while stack and end_np[stack[-1]] < r:
            stack.pop()
        parent[r] = stack[-1] if stack else -1
        stack.append(r)
    return parent


def ends_from_parents(par: np.ndarray) -> np.ndarray:
    """The last row of each row's subtree (DFS order), from the parents (inverse of
    `parents_from_ends`)."""
    end = np.arange(par.size, dtype=np.int64)
    for r in range(par.size - 1, 0, -1):
        p = par[r]
        if p >= 0 and end[r] > end[p]:
            end[p] = end[r]
    return end


# ------------------------------------------------------------------- provenance


PACKAGES = ("torch", "triton", "fla-core", "nvidia-cudnn-frontend", "numpy", "einops")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - a copy of the tree without .git has no revision
        return None


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            out[name] = None
    if out.get("fla-core") is None:  # a wheel installed with --target has no dist-info lookup path
        try:
            import fla

            out["fla-core"] = fla.__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def device_info() -> dict[str, Any]:
    """The GPU, CUDA and cuDNN the run saw (None fields on a machine without CUDA)."""
    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(0), sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), count=torch.cuda.device_count())
    try:
        import cudnn

        info["cudnn_frontend_backend"] = cudnn.backend_version()
    except Exception:  # noqa: BLE001 - the frontend is optional
        pass
    return info


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """Where a result comes from: git revision (and whether the tree had local changes),
    the exact command, package versions, device, kernel choices, and the UTC date."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_revision": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *(sys.argv if argv is None else argv)]),
        "packages": package_versions(),
        "device": device_info(),
        "kernel_choices": kernel_choices(),
        "env": {k: os.environ[k] for k in ("TRITON_F32_DEFAULT", "CUDA_VISIBLE_DEVICES") if k in os.environ},
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _jsonable(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def write_result(out_dir: Path, name: str, result: Any, prov: Mapping[str, Any], **extra: Any) -> Path:
    """DIR/<name>.json: {schema, name, provenance, result, ...extra}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    doc = {"schema": RESULT_SCHEMA, "name": name, "provenance": dict(prov), **extra, "result": result}
    path.write_text(json.dumps(doc, indent=1, default=_jsonable))
    return path


# ------------------------------------------------------------------------ suites


@dataclass(frozen=True)
class Section:
    """One named measurement of a suite: fn(args) -> a JSON-able result; `summary` turns the
    result into short table rows ((label, value) pairs) printed at the end."""

    name: str
    fn: Callable[[argparse.Namespace], Any]
    doc: str
    summary: Callable[[Any], list[tuple[str, str]]] | None = None
    default: bool = True


@dataclass
class SuiteContext:
    """What a section may use besides its arguments: the output folder and `save`, which
    writes an extra JSON next to the section's (e.g. a profile for `harts sim fit`)."""

    out: Path
    topic: str
    prov: dict[str, Any] = field(default_factory=dict)

    def save(self, name: str, obj: Any) -> Path:
        return write_result(self.out, f"{self.topic}_{name}", obj, self.prov)

    def save_raw(self, name: str, obj: dict[str, Any]) -> Path:
        """DIR/<name>.json in the object's own schema (e.g. harts.sim.profile/v1, read by
        `harts sim fit`), with the provenance added as one more key."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{name}.json"
        path.write_text(json.dumps({**obj, "provenance": self.prov}, indent=1, default=_jsonable))
        return path


CTX: SuiteContext | None = None


def ctx() -> SuiteContext:
    if CTX is None:
        raise RuntimeError("no suite is running (call run_suite)")
    return CTX


def no_autotune() -> None:
    """Each Triton autotuner takes its first config without benchmarking (correctness runs
    and step timings that do not depend on the tuned configs: saves minutes of tuning)."""
    import triton.runtime.autotuner as autotuner

    autotuner.Autotuner._bench = lambda self, *a, **kw: [0.0, 0.0, 0.0]


def base_parser(topic: str, sections: Mapping[str, Section], description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"benchmarks/gpu/{topic}.py", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="sections:\n" + "\n".join(
                                     f"  {s.name:12s} {s.doc}{'' if s.default else ' (not run by default)'}"
                                     for s in sections.values()))
    ap.add_argument("sections", nargs="*", metavar="SECTION",
                    help=f"sections to run (default: {' '.join(n for n, s in sections.items() if s.default)})")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON results")
    ap.add_argument("--no-autotune", action="store_true",
                    help="take each Triton kernel's first config (saves minutes of tuning)")
    return ap


def run_suite(topic: str, sections: list[Section], description: str,
              add_args: Callable[[argparse.ArgumentParser], None] | None = None,
              argv: list[str] | None = None) -> int:
    """Parse the suite's command line, run its sections, write one JSON per section, print
    a table of the sections' summaries last. Returns 1 if any section failed, else 0."""
    global CTX
    by_name = {s.name: s for s in sections}
    ap = base_parser(topic, by_name, description)
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args(argv)
    chosen = args.sections or [n for n, s in by_name.items() if s.default]
    unknown = [n for n in chosen if n not in by_name]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; {topic} has {sorted(by_name)}")
    if not torch.cuda.is_available():
        ap.error("these benchmarks need a CUDA device")
    if args.no_autotune:
        no_autotune()
    import torch._dynamo as dynamo

    # kernel-option variants and grad modes each compile FlexAttention once; past the
    # default limit (8) dynamo falls back to eager flex, which materialises dense scores
    dynamo.config.recompile_limit = 64
    out = Path(args.out)
    prov = provenance(argv)
    prov["options"] = {k: v for k, v in vars(args).items() if k not in ("sections", "out")}
    CTX = SuiteContext(out=out, topic=topic, prov=prov)
    table: list[tuple[str, str, str]] = []
    failed = False
    for name in chosen:
        sec = by_name[name]
        t0 = time.perf_counter()
        try:
            res = sec.fn(args)
            status = "ok"
        except Exception as err:  # noqa: BLE001 - record and go on to the next section
            res = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
            status = "ERROR " + res["error"][:200]
            failed = True
        secs = time.perf_counter() - t0
        write_result(out, f"{topic}_{name}", res, prov, section=name, seconds=round(secs, 2), status=status)
        print(f"=== {topic} {name}: {status} ({secs:.1f}s)", flush=True)
        if status == "ok" and sec.summary is not None:
            try:
                table += [(name, k, v) for k, v in sec.summary(res)]
            except Exception as err:  # noqa: BLE001 - a summary is never worth losing the result
                table.append((name, "summary", f"{type(err).__name__}: {err}"[:80]))
        elif status != "ok":
            table.append((name, "error", status[6:86]))
    print_table(topic, table)
    return 1 if failed else 0


def print_table(topic: str, rows: list[tuple[str, str, str]]) -> None:
    if not rows:
        return
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{topic}:")
    for a, b, c in rows:
        print(f"  {a:<{w0}}  {b:<{w1}}  {c}")
    sys.stdout.flush()


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
