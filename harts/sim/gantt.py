"""Gantt chart of a simulated step (matplotlib, Agg: no display needed).

One row per (replica, stage) compute stream, top to bottom by replica then stage; bars
are passes coloured by kind and labelled with their microbatch ids when wide enough; a
thin bar under each row shows producer retention (PF end to PB end), as in the paper's
Figure 3; communication (sends, gradient sync) is drawn as a thin strip above the row.
`plot_gantt_panels` draws several steps (a sweep's schedules) as panels of one figure.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from harts.sim.engine import Trace  # noqa: E402

__all__ = ["plot_gantt", "plot_gantt_panels"]

COLORS = {
    "F": "#9ecae1",
    "B": "#3182bd",
    "PF": "#fdae6b",
    "PB": "#e6550d",
    "B+PB": "#756bb1",
    "OPT": "#74c476",
    "SYNC": "#31a354",
    "SEND_F": "#bdbdbd",
    "SEND_B": "#636363",
}


def _rows(trace: Trace, max_replicas: int) -> list[tuple[int, int]]:
    ranks = sorted({(e.replica, e.stage) for e in trace.events})
    replicas = sorted({r for r, _ in ranks})[:max_replicas]
    return [rk for rk in ranks if rk[0] in replicas]


def _draw(ax, trace: Trace, rows: list[tuple[int, int]], span: float, time_unit: float) -> None:
    """One step's bars on `ax`, one row per (replica, stage) of `rows`, x up to `span`."""
    y_of = {rk: len(rows) - 1 - i for i, rk in enumerate(rows)}
    pf_end: dict[tuple[int, int, int], float] = {}
    for e in sorted(trace.events, key=lambda e: e.idx):
        rk = (e.replica, e.stage)
        if rk not in y_of:
            continue
        y = y_of[rk]
        x0, w = e.start / time_unit, (e.end - e.start) / time_unit
        color = COLORS.get(e.kind, "#969696")
        if e.lane == "comm":
            ax.broken_barh([(x0, w)], (y + 0.36, 0.1), facecolors=color, linewidth=0)
            continue
        ax.broken_barh([(x0, w)], (y - 0.3, 0.6), facecolors=color, edgecolors="white", linewidth=0.4)
        label = "+".join(str(m) for m in e.mbs) if e.kind not in ("OPT",) else "opt"
        if w > span * 0.012 * max(1, len(label) / 2):
            ax.text(x0 + w / 2, y, label, ha="center", va="center", fontsize=6,
                    color="white" if e.kind in ("B", "PB", "B+PB") else "black")
        if e.kind == "PF":
            pf_end[(e.replica, e.stage, e.mbs[0])] = e.end / time_unit
        if e.kind in ("PB", "B+PB"):
            p = e.mbs[-1]
            start = pf_end.get((e.replica, e.stage, p))
            if start is not None:
                ax.broken_barh([(start, e.end / time_unit - start)], (y - 0.44, 0.08),
                               facecolors=COLORS["PB"], alpha=0.6, linewidth=0)
    ax.set_yticks([y_of[rk] for rk in rows])
    ax.set_yticklabels([f"DP{r} PP{s}" for r, s in rows])
    ax.set_xlim(0, span * 1.01)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)


def _legend(ax, traces: list[Trace], rows: int) -> None:
    kinds = sorted({e.kind for t in traces for e in t.events if e.kind in COLORS})
    handles = [Patch(color=COLORS[k], label=k) for k in kinds]
    handles.append(Patch(color=COLORS["PB"], alpha=0.6, label="producer retained"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / rows),
              ncol=len(handles), fontsize=7, frameon=False)


def _x_label(time_unit: float) -> str:
    return "seconds" if time_unit == 1.0 else f"x {time_unit:g} s"


def plot_gantt(trace: Trace, path: str | Path, title: str = "", max_replicas: int = 4,
               time_unit: float = 1.0) -> Path:
    """Write the chart as PNG; `max_replicas` limits the rows drawn (replica 0 first)."""
    rows = _rows(trace, max_replicas)
    fig, ax = plt.subplots(figsize=(16, 1.2 + 0.55 * len(rows)), dpi=110)
    span = trace.makespan / time_unit if trace.makespan > 0 else 1.0
    _draw(ax, trace, rows, span, time_unit)
    ax.set_xlabel(_x_label(time_unit))
    _legend(ax, [trace], len(rows))
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_gantt_panels(panels: list[tuple[Trace, str]], path: str | Path, max_replicas: int = 4,
                      time_unit: float = 1.0) -> Path:
    """Several steps in one PNG, one panel per (trace, title), top to bottom, on one time
    axis (the longest step's), so that their makespans compare by eye."""
    if not panels:
        raise ValueError("plot_gantt_panels: no panels")
    rows = [_rows(trace, max_replicas) for trace, _ in panels]
    span = max(trace.makespan for trace, _ in panels) / time_unit or 1.0
    heights = [0.9 + 0.55 * len(r) for r in rows]
    fig, axes = plt.subplots(len(panels), 1, figsize=(16, 0.6 + sum(heights)), dpi=110, sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (trace, title), r in zip(axes[:, 0], panels, rows, strict=True):
        _draw(ax, trace, r, span, time_unit)
        if title:
            ax.set_title(title, fontsize=9)
    last = axes[-1, 0]
    last.set_xlabel(_x_label(time_unit))
    _legend(last, [trace for trace, _ in panels], len(rows[-1]))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
