"""Gantt chart of a simulated step (matplotlib, Agg: no display needed).

One row per (replica, stage) compute stream, top to bottom by replica then stage; bars
are passes coloured by kind and labelled with their microbatch ids when wide enough; a
thin bar under each row shows producer retention (PF end to PB end), as in the paper's
Figure 3; communication (sends, gradient sync) is drawn as a thin strip above the row.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from harts.sim.engine import Trace  # noqa: E402

__all__ = ["plot_gantt"]

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


def plot_gantt(trace: Trace, path: str | Path, title: str = "", max_replicas: int = 4,
               time_unit: float = 1.0) -> Path:
    """Write the chart as PNG; `max_replicas` limits the rows drawn (replica 0 first)."""
    ranks = sorted({(e.replica, e.stage) for e in trace.events})
    replicas = sorted({r for r, _ in ranks})[:max_replicas]
    rows = [rk for rk in ranks if rk[0] in replicas]
    y_of = {rk: len(rows) - 1 - i for i, rk in enumerate(rows)}
    fig_h = 1.2 + 0.55 * len(rows)
    fig, ax = plt.subplots(figsize=(16, fig_h), dpi=110)
    span = trace.makespan / time_unit if trace.makespan > 0 else 1.0
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
    ax.set_xlabel("seconds" if time_unit == 1.0 else f"x {time_unit:g} s")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    kinds = sorted({e.kind for e in trace.events if e.kind in COLORS})
    handles = [Patch(color=COLORS[k], label=k) for k in kinds]
    handles.append(Patch(color=COLORS["PB"], alpha=0.6, label="producer retained"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(rows)),
              ncol=len(handles), fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
