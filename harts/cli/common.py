"""Helpers shared by the subcommands: errors, JSON output, tables and progress."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

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


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain aligned text table: numbers right-aligned, text left-aligned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [all(_is_number(r[i]) for r in cells) if cells else False for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric, strict=True)
        ).rstrip()

    out = [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:,.4f}".rstrip("0").rstrip(".") if abs(value) < 1e4 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").rstrip("x%"))
    except ValueError:
        return False
    return True


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
    (`KernelConfig.tree_attention` / `baseline_attention`; `kernel_config` builds it)."""
    p.add_argument("--tree-attention", choices=TREE_ATTENTION_CHOICES, default=None,
                   help="tree mode's bf16 attention on CUDA (default auto: cuDNN's graph path where "
                   "nvidia-cudnn-frontend imports, else per-segment cuDNN / varlen flash)")
    p.add_argument("--baseline-attention", choices=BASELINE_ATTENTION_CHOICES, default=None,
                   help="expanded mode's attention on CUDA: cudnn (torch's SDPA per sequence, default), flash "
                   "(values padded), graph (one cuDNN graph call per microbatch: the tree's forward kernel, "
                   "so tree and expanded rows get the same bits)")


def kernel_config(args):
    """The run's `KernelConfig`: the HARTS_* environment's (`KernelConfig.from_env`), with
    --tree-attention / --baseline-attention where given on top."""
    from harts.config.kernels import KernelConfig

    overrides = {}
    if getattr(args, "tree_attention", None) is not None:
        overrides["tree_attention"] = args.tree_attention
    if getattr(args, "baseline_attention", None) is not None:
        overrides["baseline_attention"] = args.baseline_attention
    try:
        return KernelConfig.from_env(**overrides)
    except ValueError as err:
        raise UserError(str(err)) from None
