"""Helpers shared by the subcommands: errors, output files, JSON output, tables and progress.

Output files follow one rule for every command: the target's folder must exist and the
target must not be a directory (else a one-line `UserError`, exit code 2, before any work
is done), and the file is written atomically (a temporary file in the same folder,
fsynced, then renamed over the target), so a failed write leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from harts.track.text import format_table  # noqa: F401  (the subcommands import it from here)

T = TypeVar("T")


class UserError(Exception):
    """A problem with the user's input or options: printed as one line, exit code 2.

    `file`, `line` (1-based) and `field` say where, when the input came from a file;
    under --json the error is printed as `{"error", "file", "line", "field"}`."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.file = file
        self.line = line
        self.field = field

    def to_json(self) -> dict[str, Any]:
        return {"error": str(self), "file": self.file, "line": self.line, "field": self.field}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying the one line that says what the command had finished
    ("interrupted after step 3; checkpoint at ckpt/step-000002"); `harts.cli.main` prints
    it on stderr and exits 130."""


def caused_by_interrupt(err: BaseException) -> bool:
    """Whether a KeyboardInterrupt is behind `err`: in its chain of causes and contexts, or
    among the per-rank failures a torch.distributed.checkpoint error carries (DCP catches
    every exception of a save, Ctrl-C's too, and re-raises them wrapped)."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return True
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(failure, BaseException):
                    todo.append(failure)
    return False


def rollout_error(err: Any) -> UserError:
    """A `harts.tree.io.RolloutFormatError` as a UserError carrying its file, line and field."""
    return UserError(str(err), file=getattr(err, "file", None), line=getattr(err, "line", None) or None,
                     field=getattr(err, "field", None))


def check_output_path(path: str | os.PathLike[str], flag: str) -> Path:
    """`path` as an output file of option `flag`: its folder must exist and it must not be a
    directory. Commands call this before doing their work, so a bad path fails at once."""
    target = Path(path)
    if str(path) == "" or target.is_dir():
        raise UserError(f"{flag} {str(path)!r}: is a directory; give a file name", field=flag)
    parent = target.parent
    if not parent.exists():
        raise UserError(f"{flag} {path}: folder {parent} does not exist (create it first)", field=flag)
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is not a folder", field=flag)
    return target


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], flag: str) -> Iterator[Path]:
    """Yield a temporary path in the target's folder (same suffix, so writers that go by the
    extension still work); on success it is fsynced and renamed over `path`, on any failure
    it is removed. OS errors become one-line UserErrors."""
    target = check_output_path(path, flag)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write there ({err.strerror})", field=flag) from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        # mkstemp creates the file 0600; give it the mode a plain open() would
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{flag} {path}: cannot write ({err.strerror or err})", field=flag) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_output(path: str | os.PathLike[str], flag: str, content: str | bytes) -> Path:
    """Write `content` to `path` under the output rule (see `atomic_output`)."""
    with atomic_output(path, flag) as tmp:
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        else:
            tmp.write_bytes(content)
    return Path(path)


def say_wrote(path: str | os.PathLike[str], json_mode: bool, detail: str = "") -> None:
    """`wrote PATH [detail]`: on stdout for people, on stderr under --json (stdout stays JSON)."""
    print(f"wrote {os.fspath(path)}" + (f" ({detail})" if detail else ""),
          file=sys.stderr if json_mode else sys.stdout)


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
COMPILE_CHOICES = ("off", "inductor", "aot_eager")


def add_attention_args(p) -> None:
    """--tree-attention / --baseline-attention: the GPU attention paths of each mode
    (`KernelConfig.tree_attention` / `baseline_attention`), and --compile, the model's
    compiled regions (`KernelConfig.compile`); `kernel_config` builds the config."""
    p.add_argument("--tree-attention", choices=TREE_ATTENTION_CHOICES, default=None,
                   help="tree mode's bf16 attention on CUDA (default auto: cuDNN's graph path where "
                   "nvidia-cudnn-frontend imports, else per-segment cuDNN / varlen flash)")
    p.add_argument("--baseline-attention", choices=BASELINE_ATTENTION_CHOICES, default=None,
                   help="expanded mode's attention on CUDA: cudnn (torch's SDPA per sequence, default), flash "
                   "(values padded), graph (one cuDNN graph call per microbatch: the tree's forward kernel, "
                   "so tree and expanded rows get the same bits)")
    p.add_argument("--compile", choices=COMPILE_CHOICES, default=None,
                   help="run the model's elementwise chains (MoE routing, KDA forget gate, SwiGLU products, "
                   "gated norm) under torch.compile with this backend: inductor fuses them into fewer launches, "
                   "which pays where the device is the bottleneck and costs where the host is (a first "
                   "step that compiles; default off, or HARTS_COMPILE)")


def kernel_config(args):
    """The run's `KernelConfig`: the HARTS_* environment's (`KernelConfig.from_env`), with
    --tree-attention / --baseline-attention / --compile where given on top."""
    from harts.config.kernels import KernelConfig

    overrides = {}
    if getattr(args, "tree_attention", None) is not None:
        overrides["tree_attention"] = args.tree_attention
    if getattr(args, "baseline_attention", None) is not None:
        overrides["baseline_attention"] = args.baseline_attention
    if getattr(args, "compile", None) is not None:
        overrides["compile"] = args.compile
    try:
        return KernelConfig.from_env(**overrides)
    except ValueError as err:
        raise UserError(str(err)) from None
