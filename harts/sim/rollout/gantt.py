"""Gantt chart of a simulated rollout phase (matplotlib, Agg): one row per worker, its
busy intervals as bars (labelled with the degree, and when it served if it was merged
during the step), and below them the longest
trajectories' timelines (decode, prefill, tool calls, queueing, migrations), so the long
tail and the GPUs it leaves idle show on one time axis."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from harts.sim.rollout.types import RolloutResult, SegmentKind  # noqa: E402

__all__ = ["plot_rollout_gantt"]

COLORS = {
    SegmentKind.DECODE: "#3182bd",
    SegmentKind.PREFILL: "#fdae6b",
    SegmentKind.TOOL: "#d9d9d9",
    SegmentKind.QUEUE: "#e6550d",
    SegmentKind.MIGRATE: "#31a354",
}
BUSY = "#6baed6"


def plot_rollout_gantt(result: RolloutResult, path: str | Path, title: str = "", tail: int = 8) -> Path:
    """Write the chart as PNG: every worker, then the `tail` trajectories that finish last."""
    longest = sorted(result.timelines, key=lambda t: (-t.finish_s, t.tid))[:tail]
    rows = len(result.workers) + len(longest)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.32 * rows), dpi=110)
    y = rows - 1
    labels, ticks = [], []
    for w, busy in zip(result.workers, result.busy, strict=True):
        ax.broken_barh([(s, e - s) for s, e in busy], (y - 0.35, 0.7), facecolors=BUSY, linewidth=0)
        span = (f", from {w.start_s:.0f} s" if w.start_s else "") + (f", to {w.end_s:.0f} s" if w.end_s is not None else "")
        labels.append(f"worker {w.wid} (MP{w.degree}{span})")
        ticks.append(y)
        y -= 1
    for t in longest:
        for kind, color in COLORS.items():
            bars = [(s.start, s.end - s.start) for s in t.segments if s.kind == kind and s.end > s.start]
            if bars:
                ax.broken_barh(bars, (y - 0.3, 0.6), facecolors=color, linewidth=0)
        labels.append(f"traj {t.tid} ({t.generated_tokens} tok)")
        ticks.append(y)
        y -= 1
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlim(0, max(result.makespan_s, 1e-9) * 1.01)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    handles = [Patch(color=BUSY, label="worker busy")] + [Patch(color=c, label=k.value) for k, c in COLORS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.08 - 1.5 / rows), ncol=len(handles),
              fontsize=7, frameon=False)
    ax.set_title(title or f"{result.policy}: {result.throughput_tokens_per_s:,.0f} tok/s, "
                 f"makespan {result.makespan_s:.1f} s on {result.gpus} GPUs", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
