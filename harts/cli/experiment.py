"""`harts experiment NAME`: run a study, print its table next to the paper's, log it to mlflow.

    harts experiment planners                    # default config (CPU, minutes)
    harts experiment fidelity --config tiny      # the tiny config the tests use
    harts experiment all --tracking-uri http://127.0.0.1:5000
    harts experiment list
    harts experiment run experiments/table4-planners.toml   # a study and its parameters from a file

Studies live in `harts.experiments` (harts/experiments/<study>/), the paper's tables and
figures as experiment files in experiments/ (`harts.experiments.files`); runs go to the
embedded store ./harts-runs/mlflow.db unless --tracking-uri or $MLFLOW_TRACKING_URI says
otherwise. `harts report` renders the latest run of every study as one HTML page.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from harts.cli.common import UserError, format_table, print_json


def load_registry() -> Any:
    """`harts.experiments.registry` (cheap to import: no study loads until it runs)."""
    import harts.experiments.registry as registry

    return registry


def register(sub: argparse._SubParsersAction) -> None:
    try:
        names = ", ".join(load_registry().known_studies())
    except (UserError, ImportError):
        names = "see `harts experiment list`"
    p = sub.add_parser(
        "experiment",
        help="run a study that reproduces a table/figure of the paper and log it to mlflow",
        description=f"Studies: {names}. 'all' runs every study; 'list' lists them; 'run FILE' runs "
                    "the study an experiment file names with its parameters (experiments/*.toml).",
    )
    p.add_argument("name", metavar="NAME", help=f"study name ({names}), 'all', 'list' or 'run'")
    p.add_argument("file", metavar="FILE", nargs="?",
                   help="with 'run': the experiment file (TOML: reproduces, study, config, [parameters])")
    p.add_argument("--config", default=None, choices=("tiny", "default"),
                   help="tiny: seconds (what the tests run); default: the study on CPU in minutes "
                        "(default: default; with 'run' the file names its config)")
    p.add_argument("--tracking-uri", help="mlflow tracking URI (default: $MLFLOW_TRACKING_URI, else "
                   "the embedded store ./harts-runs/mlflow.db)")
    p.add_argument("--no-log", action="store_true", help="do not log to mlflow")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    p.add_argument("--json", action="store_true", help="machine-readable results on stdout")
    p.set_defaults(func=cmd_experiment)


class _Display:
    """One progress line on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, study: str, enabled: bool):
        self.study = study
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.width = 0

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        text = f"[{done}/{total}] {self.study}: {label}  ({elapsed:.1f}s)"
        if self.tty:
            pad = max(0, self.width - len(text))
            sys.stderr.write("\r" + text + " " * pad)
            self.width = len(text)
            if done >= total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


def cmd_experiment(args: argparse.Namespace) -> int:
    registry = load_registry()
    known = registry.known_studies()
    if args.name == "run":
        if args.file is None:
            raise UserError("harts experiment run: give the experiment file (e.g. experiments/table4-planners.toml)")
        if args.config is not None:
            raise UserError("--config: an experiment file names its own config", field="config")
    elif args.file is not None:
        raise UserError(f"unexpected argument {args.file!r}: only 'harts experiment run' takes a file")
    if args.name == "list":
        return _list(registry, args)
    if args.name not in ("all", "run") and args.name not in known:
        raise UserError(f"unknown study {args.name!r}; known studies: {', '.join(known)} (or 'all', 'list', "
                        "'run FILE')")
    runs = [_from_file(args.file)] if args.name == "run" else \
        [(name, args.config or "default", args.config or "default", None) for name in
         (known if args.name == "all" else [args.name])]
    names = [name for name, *_ in runs]
    uri = None
    if not args.no_log:
        from harts.track.store import resolve_tracking_uri

        uri = resolve_tracking_uri(args.tracking_uri)
    outputs, failed = [], []
    for name, config, label, file in runs:
        try:
            outputs.append(_run_one(registry, name, config, label, file, args, uri))
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - 'all' reports a failing study and goes on
            if len(names) == 1:
                raise
            failed.append(name)
            print(f"harts: study {name} failed: {type(err).__name__}: {err}", file=sys.stderr)
            outputs.append({"study": name, "error": f"{type(err).__name__}: {err}"})
    if args.json:
        print_json(outputs[0] if len(names) == 1 else outputs)
    elif len(names) > 1:
        print(format_table(["study", "seconds", "run"],
                           [[o["study"], round(o.get("seconds", 0.0), 1), o.get("run_id") or o.get("error", "-")]
                            for o in outputs]))
    if uri is not None and not args.json and outputs:
        from harts.track.store import ui_hint

        print(f"\nbrowse the runs: {ui_hint(uri)}\none page with every study: harts report"
              + ("" if args.tracking_uri is None else f" --tracking-uri {args.tracking_uri}"))
    return 1 if failed else 0


def _list(registry: Any, args: argparse.Namespace) -> int:
    rows = []
    for name in registry.known_studies():
        study = registry.get_study(name)
        rows.append([name, study.title, type(study.config("default")).__name__])
    if args.json:
        print_json([{"study": r[0], "title": r[1], "config": r[2]} for r in rows])
    else:
        print(format_table(["study", "reproduces", "config"], rows))
    return 0


def _from_file(path: str) -> tuple[str, Any, str, Any]:
    """(study, config, its label, the file) of an experiment file, or a UserError naming
    the file, line and key."""
    from harts.experiments.files import ExperimentFileError, load_experiment

    try:
        exp = load_experiment(path)
    except ExperimentFileError as err:
        raise UserError(str(err), file=err.file, line=err.line, field=err.field) from None
    return exp.study, exp.config, Path(path).stem, exp


def _run_one(registry: Any, name: str, config: Any, label: str, file: Any, args: argparse.Namespace,
             uri: str | None) -> dict[str, Any]:
    from harts.experiments.common import Progress

    display = _Display(name, enabled=not args.quiet)
    result = registry.run_study(name, config, Progress(display), config_name=label)
    if file is not None:
        # the file as it was run, beside the study's artifacts
        result = dataclasses.replace(result, artifacts={**result.artifacts, "experiment.toml": file.text},
                                     notes=(f"reproduces {file.reproduces} ({file.path})", *result.notes))
    out = {"study": name, "config_name": label, "seconds": result.seconds, **result.summary()}
    if file is not None:
        out["file"] = str(file.path)
    if uri is not None:
        from harts.experiments.common import experiment_name, log_study

        out["run_id"] = log_study(result, uri)
        out["tracking_uri"] = uri
        out["experiment"] = experiment_name(name)
    if not args.json:
        print()
        for table in result.tables:
            print(table.to_text())
            print()
        for note in result.notes:
            print(f"note: {note}")
        done = f"{name} ({label}) ran in {result.seconds:.1f}s"
        if uri is not None:
            done += f"; logged as run {out['run_id']} in experiment {out['experiment']}"
        print(done)
    return out
