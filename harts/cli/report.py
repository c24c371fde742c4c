"""`harts report`: the latest run of every study as one static HTML page.

    harts report                          # harts-runs/report.html from harts-runs/mlflow.db
    harts report --out /tmp/r.html --tracking-uri http://127.0.0.1:5000

The page is self-contained (tables inline, PNG plots embedded as base64, no scripts), so
it opens from disk without a server and can be mailed or archived with a paper draft.
Paper columns are shaded grey, ours are in blue; every section names the run, its
config, its git commit and when it ran, and a study run on its tiny config says above its
tables that those numbers are not comparable with the paper's beside them. Bar axes start
at 0.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import html
import json
import re
import sys
from typing import Any

from harts.cli.common import UserError, check_output_path, print_json, say_wrote, write_output


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="one static HTML page with the latest run of every study (tables and plots)")
    p.add_argument("--out", default=None,
                   help="HTML file to write, its folder must exist (default: report.html beside a local store, "
                   "harts-runs/report.html for the embedded one; ./report.html for a server)")
    p.add_argument("--tracking-uri", help="mlflow tracking URI (default: $MLFLOW_TRACKING_URI, else the "
                   "embedded store ./harts-runs/mlflow.db)")
    p.add_argument("--json", action="store_true", help="print what was rendered as JSON")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from harts.track.query import latest_runs
    from harts.track.store import local_store_dir, resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri)
    store = local_store_dir(uri)
    if store is not None and not (store / "mlflow.db").exists() and uri.endswith("/mlflow.db"):
        raise UserError(f"no tracking store at {uri}: run a study first (harts experiment NAME)")
    out = check_output_path(args.out or (store / "report.html" if store is not None else "report.html"), "--out")
    runs = latest_runs(uri, kind="study", group_by="harts.study",
                       artifacts=("tables.json", "table.json", "figures.json", RL_STEPS), artifact_dirs=("plots",))
    order = _study_order(runs)
    page = render_html(runs, order, uri)
    write_output(out, "--out", page)
    plots = sum(sum(1 for f in r.files if f.endswith(".png")) + (RL_STEPS in r.files) for r in runs.values())
    missing = [s for s in order if s not in runs]
    if args.json:
        print_json({"out": str(out), "tracking_uri": uri, "studies": {s: r.run_id for s, r in runs.items()},
                    "missing": missing, "plots": plots})
        say_wrote(out, True)
    else:
        say_wrote(out, False, f"{len(runs)} studies, {plots} plots, from {uri}")
        if missing:
            print(f"no finished run yet for: {', '.join(missing)} (harts experiment NAME)", file=sys.stderr)
    return 0


def _study_order(runs: dict[str, Any]) -> list[str]:
    from harts.experiments.registry import known_studies

    known = known_studies()
    return known + sorted(s for s in runs if s not in known)


CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 2.2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.meta { color: #666; font-size: 0.85em; } .note { color: #444; font-size: 0.85em; margin: 0.4em 0 1em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
th.paper, td.paper { background: #ececec; color: #555; } td.ours { color: #0b4f9c; font-weight: 600; }
caption { caption-side: top; text-align: left; font-weight: 600; padding-bottom: 0.3em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.missing { color: #a33; } nav a { margin-right: 1em; } code { background: #f5f5f5; padding: 0 0.2em; }
.legend span { padding: 0 0.4em; margin-right: 0.6em; }
.caveat { color: #8a5a00; background: #fff6e0; padding: 0.3em 0.6em; font-size: 0.85em; }
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _when(ms: int) -> str:
    if not ms:
        return "?"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


_NUM = r"[+\-]?[\d.,]+(?:e[+\-]?\d+)?[x%]?"
_NUMERIC = re.compile(rf"{_NUM}(?:\s*[-/]\s*{_NUM})*")


def _is_num(text: str) -> bool:
    """Numbers, '599 / 614' pairs and '4.77-10.45x' ranges are right-aligned."""
    return bool(_NUMERIC.fullmatch(text.strip()))


def render_table(t: dict[str, Any]) -> str:
    cols = t["columns"]
    head = "".join(f'<th class="{_e(c["kind"])}">{_e(c["label"])}</th>' for c in cols)
    body = []
    cells_rows = t.get("cells") or []
    kinds = t.get("row_kinds") or [""] * len(cells_rows)
    for cells, row_kind in zip(cells_rows, kinds, strict=False):
        tds = []
        for c, cell in zip(cols, cells, strict=False):
            cls = ["paper" if row_kind == "paper" and c["kind"] != "key" else c["kind"]]
            if _is_num(cell):
                cls.append("num")
            tds.append(f'<td class="{" ".join(cls)}">{_e(cell)}</td>')
        body.append("<tr>" + "".join(tds) + "</tr>")
    note = f'<div class="note">{_e(t["note"])}</div>' if t.get("note") else ""
    return (f'<table><caption>{_e(t["title"])}</caption><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>{note}')


def render_html(runs: dict[str, Any], order: list[str], uri: str) -> str:
    from harts.track.store import ui_hint

    now = dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    nav = " ".join(f'<a href="#{_e(s)}">{_e(s)}</a>' for s in order)
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<title>HARTS studies</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>HARTS studies: the paper's tables and figures, reproduced</h1>",
        f'<div class="meta">generated {now} from <code>{_e(uri)}</code>; the latest finished run of each study. '
        f'Browse every run: <code>{_e(ui_hint(uri))}</code></div>',
        '<p class="legend"><span class="paper" style="background:#ececec">paper</span>'
        '<span style="color:#0b4f9c;font-weight:600">ours</span></p>',
        f"<nav>{nav}</nav>",
    ]
    for study in order:
        run = runs.get(study)
        parts.append(f'<h2 id="{_e(study)}">{_e(study)}'
                     + (f": {_e(run.tags.get('harts.title', ''))}" if run else "") + "</h2>")
        if run is None:
            parts.append(f'<p class="missing">No finished run yet: <code>harts experiment {_e(study)}</code></p>')
            continue
        commit = run.tags.get("harts.git_commit", "")
        dirty = " (uncommitted changes)" if run.tags.get("harts.git_dirty") == "true" else ""
        secs = run.metrics.get("study_seconds")
        parts.append(
            f'<div class="meta">run <code>{_e(run.run_id)}</code> in experiment <code>{_e(run.experiment)}</code>, '
            f'config <b>{_e(run.tags.get("harts.config", "?"))}</b>, started {_e(_when(run.start_time))}'
            + (f", {secs:.1f} s" if secs is not None else "")
            + (f", commit <code>{_e(commit[:10])}</code>{_e(dirty)}" if commit else "") + "</div>"
        )
        tables = _tables(run.files)
        if run.tags.get("harts.config") == "tiny" and any(_has_paper(t) for t in tables):
            parts.append(f'<p class="caveat">{_e(TINY_CAVEAT)}</p>')
        if not tables:
            parts.append('<p class="missing">this run has no table artifact</p>')
        parts += [render_table(t) for t in tables]
        if RL_STEPS in run.files:
            b64 = base64.b64encode(rl_curve_png(json.loads(run.files[RL_STEPS]))).decode("ascii")
            parts.append(f'<div><img alt="reward and log-prob gap over steps" src="data:image/png;base64,{b64}"></div>')
        for path in _plot_order(run.files):
            b64 = base64.b64encode(run.files[path]).decode("ascii")
            parts.append(f'<div><img alt="{_e(path)}" src="data:image/png;base64,{b64}"></div>')
        note = run.tags.get("mlflow.note.content")
        if note:
            parts += [f'<div class="note">note: {_e(n)}</div>' for n in note.split("\n\n") if n.strip()]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


RL_STEPS = "rl_steps.json"  # an online RL run's per-step records (harts.rl.loop.log_run)


def rl_curve_png(steps: list[dict[str, Any]]) -> bytes:
    """Reward and rollout-vs-training log-prob gap over the steps of an online RL run (the
    paper's Figure 6 analogue): mean reward on the left axis, the gap (log scale) on the right."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    ax.plot(x, [s["reward_mean"] for s in steps], color="#0b4f9c", marker="o", ms=3, label="mean reward")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward", color="#0b4f9c")
    ax.set_ylim(0, 1)
    gap = ax.twinx()
    gap.plot(x, [max(s["logprob_gap"], 1e-18) for s in steps], color="#c0392b", lw=1, label="log-prob gap")
    gap.set_yscale("log")
    gap.set_ylabel("|rollout - training log-prob|", color="#c0392b")
    ax.set_title("online RL: reward and rollout-vs-training log-prob gap")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _plot_order(files: dict[str, bytes]) -> list[str]:
    """The study's own order (figures.json) when it logged one, then the rest by name."""
    pngs = sorted(p for p in files if p.endswith(".png"))
    if "figures.json" in files:
        listed = [p for p in json.loads(files["figures.json"]) if p in files]
        return listed + [p for p in pngs if p not in listed]
    return pngs


# one line above a study measured on its tiny config whose tables put the paper's numbers beside it
TINY_CAVEAT = ("Caveat: measured on the study's tiny config (a far smaller workload, fewer steps and GPUs "
               "than the paper's, seconds to run); these numbers beside the paper's are a smoke test of the "
               "pipeline, not a comparison with the paper's results.")


def _has_paper(table: dict[str, Any]) -> bool:
    """Whether a table puts paper numbers beside ours (a paper column or a paper row)."""
    return (any(c.get("kind") == "paper" for c in table.get("columns", ()))
            or "paper" in (table.get("row_kinds") or ()))


def _tables(files: dict[str, bytes]) -> list[dict[str, Any]]:
    if "tables.json" in files:
        return list(json.loads(files["tables.json"]))
    if "table.json" in files:
        return [json.loads(files["table.json"])]
    return []
