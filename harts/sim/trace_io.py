"""Trace files: what a simulated step did, in a form a measured GPU trace can be diffed with.

Format: Chrome trace-event JSON (what torch.profiler exports and Perfetto reads), one
complete event (`ph: "X"`) per action: `pid` = DP replica, `tid` = 2 * stage (+1 for the
communication stream), `ts`/`dur` in microseconds, `name` = the action's schedule token
(`F3`, `B5+B0`, `send-F3`, `grad-sync`, `optimizer`), `cat` = its kind (F, PF, B, PB,
B+PB, SEND_F, SEND_B, SYNC, OPT), `args.mbs` = the microbatches. A GPU run that emits the
same names (one NVTX range per action, exported as trace events) diffs event by event with
`diff_traces`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harts.sim.engine import Trace, TraceEvent

__all__ = ["TraceDiff", "diff_traces", "load_trace_events", "save_trace", "trace_to_chrome"]


def _short(name: str) -> str:
    return name.split(":", 1)[1] if ":" in name else name


def trace_to_chrome(trace: Trace, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    events = []
    for e in trace.events:
        events.append({
            "name": _short(e.name),
            "cat": e.kind,
            "ph": "X",
            "pid": e.replica,
            "tid": 2 * e.stage + (1 if e.lane == "comm" else 0),
            "ts": e.start * 1e6,
            "dur": (e.end - e.start) * 1e6,
            "args": {"mbs": list(e.mbs), "stage": e.stage, "lane": e.lane},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def save_trace(trace: Trace, path: str | Path, metadata: dict[str, Any] | None = None) -> None:
    Path(path).write_text(json.dumps(trace_to_chrome(trace, metadata)))


def load_trace_events(path_or_obj: str | Path | dict[str, Any]) -> list[TraceEvent]:
    """Complete events of a Chrome trace (simulated or measured), as TraceEvents."""
    data = path_or_obj if isinstance(path_or_obj, dict) else json.loads(Path(path_or_obj).read_text())
    out = []
    for i, ev in enumerate(data.get("traceEvents", [])):
        if ev.get("ph") != "X":
            continue
        tid = int(ev.get("tid", 0))
        args = ev.get("args", {})
        start = float(ev["ts"]) / 1e6
        out.append(TraceEvent(
            idx=i, name=str(ev["name"]), kind=str(ev.get("cat", "")), replica=int(ev.get("pid", 0)),
            stage=int(args.get("stage", tid // 2)), lane=str(args.get("lane", "comm" if tid % 2 else "compute")),
            start=start, end=start + float(ev["dur"]) / 1e6, mbs=tuple(int(m) for m in args.get("mbs", ())),
        ))
    return out


@dataclass(frozen=True)
class TraceDiff:
    matched: int
    only_simulated: tuple[str, ...]
    only_measured: tuple[str, ...]
    makespan_simulated: float
    makespan_measured: float
    # per kind: (simulated seconds, measured seconds) summed over matched events
    by_kind: dict[str, tuple[float, float]]

    @property
    def makespan_error(self) -> float:
        """(simulated - measured) / measured."""
        return (self.makespan_simulated - self.makespan_measured) / self.makespan_measured


def diff_traces(simulated: list[TraceEvent] | Trace, measured: list[TraceEvent] | Trace) -> TraceDiff:
    """Match events by (replica, stage, lane, name) and compare durations and the makespan."""

    def events(t: list[TraceEvent] | Trace) -> list[TraceEvent]:
        return list(t.events) if isinstance(t, Trace) else list(t)

    def key(e: TraceEvent) -> tuple[int, int, str, str]:
        return (e.replica, e.stage, e.lane, _short(e.name))

    sim, mea = events(simulated), events(measured)
    a = {key(e): e for e in sim}
    b = {key(e): e for e in mea}
    by_kind: dict[str, tuple[float, float]] = {}
    for k in sorted(set(a) & set(b)):
        es, em = a[k], b[k]
        s0, m0 = by_kind.get(es.kind, (0.0, 0.0))
        by_kind[es.kind] = (s0 + es.end - es.start, m0 + em.end - em.start)

    def span(es: list[TraceEvent]) -> float:
        return max((e.end for e in es), default=0.0) - min((e.start for e in es), default=0.0)

    def fmt(k: tuple[int, int, str, str]) -> str:
        return f"r{k[0]}s{k[1]}:{k[3]}"

    return TraceDiff(
        matched=len(set(a) & set(b)),
        only_simulated=tuple(fmt(k) for k in sorted(set(a) - set(b))),
        only_measured=tuple(fmt(k) for k in sorted(set(b) - set(a))),
        makespan_simulated=span(sim),
        makespan_measured=span(mea),
        by_kind=by_kind,
    )
