"""What the ops ran: per op family the implementations a context's calls executed, and
the fallbacks, said per call.

A `KernelRecord` is kept by a trainer (shared by its microbatches' contexts) or by a
context built on its own. Ops note what each call ran (`ran`); where a call cannot run
the path its `KernelConfig` asks for (CPU tensors, a dtype the kernel lacks, a missing
library, a failed self-check or launch) it runs another and says so with a
`KernelFallbackWarning` naming the op, the requested and the executed path, once per
distinct (op, reason) and record. Nothing here changes a later call's choice.
"""

from __future__ import annotations

import warnings


class KernelFallbackWarning(RuntimeWarning):
    """An op ran another implementation than the one its configuration asked for."""


class KernelRecord:
    def __init__(self) -> None:
        self.ran: dict[str, set[str]] = {}
        self.fallbacks: dict[tuple[str, str], tuple[str, str]] = {}  # (op, reason) -> (requested, executed)

    def note(self, op: str, impl: str) -> None:
        """Record that a call of `op` ran `impl`."""
        self.ran.setdefault(op, set()).add(str(impl))

    def fallback(self, op: str, requested: str, executed: str, reason: str) -> None:
        """Record a call that ran `executed` instead of `requested`; warn once per (op, reason)."""
        self.note(op, executed)
        key = (op, reason)
        if key not in self.fallbacks:
            self.fallbacks[key] = (str(requested), str(executed))
            warn_fallback(op, requested, executed, reason, stacklevel=4)

    def to_dict(self) -> dict:
        """{"ran": {op: [impl, ...]}, "fallbacks": [{op, requested, executed, reason}]}."""
        return {"ran": {op: sorted(impls) for op, impls in sorted(self.ran.items())},
                "fallbacks": [{"op": op, "requested": req, "executed": ex, "reason": reason}
                              for (op, reason), (req, ex) in self.fallbacks.items()]}


def warn_fallback(op: str, requested: str, executed: str, reason: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{op}: requested {requested}, ran {executed} ({reason})", KernelFallbackWarning,
                  stacklevel=stacklevel)


def report(record: KernelRecord | None, op: str, impl: str) -> None:
    if record is not None:
        record.note(op, impl)


def report_fallback(record: KernelRecord | None, op: str, requested: str, executed: str, reason: str) -> None:
    """`record.fallback`, or a plain warning for a call made without a record."""
    if record is not None:
        record.fallback(op, requested, executed, reason)
    else:
        warn_fallback(op, requested, executed, reason, stacklevel=3)
