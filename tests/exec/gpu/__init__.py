"""The GPU code paths on CPU. Tests that run Triton kernels interpreted call
`interpret_triton()` first thing, before anything imports triton."""

import os
import sys


def interpret_triton() -> None:
    """Set TRITON_INTERPRET=1 for this process. triton takes the setting when it is
    imported, so a test module collected after something else imported triton (torch's
    pipelining does) would run compiled-mode kernels on CPU tensors and fail deep inside
    the interpreter; this names the cause instead."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: a module collected "
                           "earlier imports it (import torch.distributed.pipelining and harts' kernels "
                           "lazily in tests)")
    os.environ.setdefault("TRITON_INTERPRET", "1")
