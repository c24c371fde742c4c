"""Helpers shared by the subcommands: errors, JSON output, tables and progress."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from harts.track.text import format_table  # noqa: F401  (the subcommands import it from here)

T = TypeVar("T")


class UserError(Exception):
    """A problem with the user's input or options: printed as one line, exit code 2."""


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=_json_default)
    sys.stdout.write("\n")


def _json_default(obj: Any) -> Any:
    # numpy scalars and arrays reach here; keep the CLI free of a numpy import at load time
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def progress(items: Iterable[T], total: int | None, label: str, enabled: bool = True) -> Iterator[T]:
    """Yield items, drawing a one-line progress display on stderr when it is a terminal
    (or always when `enabled` is forced on); silent under --json pipes."""
    show = enabled and sys.stderr.isatty()
    start = time.perf_counter()
    done = 0
    for item in items:
        yield item
        done += 1
        if show and (done == total or done % max(1, (total or 100) // 100) == 0):
            elapsed = time.perf_counter() - start
            frac = f"{done}/{total}" if total else str(done)
            sys.stderr.write(f"\r{label}: {frac}  {elapsed:6.1f}s")
            sys.stderr.flush()
    if show:
        sys.stderr.write("\n")


TREE_ATTENTION_CHOICES = ("auto", "graph", "cudnn", "varlen", "flex")
BASELINE_ATTENTION_CHOICES = ("cudnn", "flash", "graph")


def add_attention_args(p) -> None:
    """--tree-attention / --baseline-attention: the GPU attention paths of each mode
    (`harts.exec.backend`'s HARTS_TREE_ATTENTION / HARTS_BASELINE_ATTENTION switches)."""
    p.add_argument("--tree-attention", choices=TREE_ATTENTION_CHOICES, default=None,
                   help="tree mode's bf16 attention on CUDA (default auto: cuDNN's graph path where "
                   "nvidia-cudnn-frontend imports, else per-segment cuDNN / varlen flash)")
    p.add_argument("--baseline-attention", choices=BASELINE_ATTENTION_CHOICES, default=None,
                   help="expanded mode's attention on CUDA: cudnn (torch's SDPA per sequence, default), flash "
                   "(values padded), graph (one cuDNN graph call per microbatch: the tree's forward kernel, "
                   "so tree and expanded rows get the same bits)")


def apply_attention_args(args) -> None:
    """Set the backend's switches from --tree-attention / --baseline-attention (given ones only)."""
    import os

    from harts.exec.backend import BASELINE_ATTENTION_ENV, TREE_ATTENTION_ENV

    tree = getattr(args, "tree_attention", None)
    if tree is not None:
        if tree == "auto":
            os.environ.pop(TREE_ATTENTION_ENV, None)
        else:
            os.environ[TREE_ATTENTION_ENV] = tree
    base = getattr(args, "baseline_attention", None)
    if base is not None:
        os.environ[BASELINE_ATTENTION_ENV] = "" if base == "cudnn" else base
