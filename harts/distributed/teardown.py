"""How a distributed worker process ends (no torch import: harts/__main__ uses it too).

A worker ends with `os._exit`, without interpreter finalization. Its process group is
destroyed by then, but a gloo worker thread may still be releasing the last collective's
tensors; when that needs the GIL after finalization has begun, Python ends the thread with
pthread_exit, whose unwinding through a noexcept C++ frame aborts the process ("terminate
called without an active exception", exit -6) after the run itself succeeded. Both kinds
of worker hit it: torchrun's (`harts/__main__`) and `harts.distributed.runner.launch`'s spawned
ones (the tp2sp equivalence test aborted so in CI). Everything the worker wrote is closed
by then; only the standard streams need flushing.
"""

from __future__ import annotations

import os
import sys

__all__ = ["exit_without_finalization"]


def exit_without_finalization(rc: int) -> None:
    """Flush the standard streams and end the process with status `rc` at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
