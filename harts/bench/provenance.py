"""Where a benchmark result comes from: git revision, command, package versions, Python,
device and date (`provenance`), shared by `harts bench --out` and the scripts under
benchmarks/."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parents[2]


PACKAGES = ("torch", "triton", "fla-core", "nvidia-cudnn-frontend", "numpy", "einops", "transformers", "ortools")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True, timeout=10,
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
    the exact command, package versions, Python, device and the UTC date (the GPU suites'
    `run_suite` adds the suite's options and its kernel config). `HARTS_GIT_REV` in the
    environment names the revision instead of git: a copy of the tree on another machine
    may carry git metadata that is not its own."""
    from harts.config.env import git_revision_override

    named = git_revision_override()
    status = None if named else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_revision": named or _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *(sys.argv if argv is None else argv)]),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "device": device_info(),
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_result(path: str | Path, annotation: str | None = None, **fields: Any) -> None:
    """A benchmark's result file: its `annotation` (where given) and this process's
    `provenance` first, then `fields`, as indented JSON."""
    import json

    head = {} if annotation is None else {"annotation": annotation}
    Path(path).write_text(json.dumps({**head, "provenance": provenance(sys.argv), **fields}, indent=1) + "\n")
