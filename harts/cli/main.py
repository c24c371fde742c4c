"""The `harts` command line: one entry point, one module per subcommand family.

Every module in `harts.cli` that defines `register(subparsers)` contributes subcommands;
`main` discovers them, so adding a family never edits this file. Registration must stay
cheap: heavy imports (torch) belong in the command handlers, so `harts tree stats` starts
fast on a machine where importing torch takes seconds.

Every runnable subcommand takes `--json` (tests/cli/test_json.py walks the parser to hold
this). Under `--json` an error, whether the handler's `UserError` or argparse's own, is
printed on stdout as `{"error": ..., "file": ..., "line": ..., "field": ...}` (keys null
where unknown), with the same exit code 2.

Every option's --help states its default (`_state_defaults` appends "(default: X)" where
the help text does not already name one). Ctrl-C ends any command with one line on
stderr (`harts: interrupted ...`) and exit code 130, never a traceback; a command that
has partial results to give (`harts train`) says what it finished in that line
(`Interrupted`). Before any command runs, the process's CPU threads are sized by
`harts.config.env.thread_settings` ($HARTS_THREADS wins, then $OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import signal
import sys

import harts.cli
from harts.cli.common import Interrupted, UserError, caused_by_interrupt, print_json


class _ParseError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser, raising its errors to `main` instead of exiting (subparsers are
    made of the same class), so that under --json they can be printed as JSON."""

    def error(self, message: str):  # type: ignore[override]
        raise _ParseError(self, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="harts",
        description="HARTS: hybrid-attention RL training over rollout trees.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(harts.cli.__path__), key=lambda m: m.name):
        if info.name in ("main", "common"):
            continue
        module = importlib.import_module(f"harts.cli.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    _state_defaults(parser)
    return parser


_THREADS_EPILOG = ("CPU threads: at most the CPUs this process may use, shared among the processes torchrun "
                   "starts on the host, with OpenMP's idle threads sleeping (OMP_WAIT_POLICY=PASSIVE); "
                   "$OMP_NUM_THREADS is kept, $HARTS_THREADS=N sets N and wins over it.")


def _state_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to every option's help, in every subcommand, whose default is
    a value (not None / False / SUPPRESS) and whose help does not already name its default."""
    if parser.prog == "harts" and parser.epilog is None:
        parser.epilog = _THREADS_EPILOG
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                _state_defaults(child)
            continue
        default = action.default
        if not action.option_strings or default is None or default is False or default == argparse.SUPPRESS:
            continue
        if isinstance(default, (list, tuple)) and not default:
            continue
        text = action.help or ""
        if "default" in text.lower():
            continue
        action.help = f"{text} (default: %(default)s)".lstrip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    json_mode = "--json" in argv
    try:
        return _main(argv, json_mode)
    except KeyboardInterrupt as err:
        return _interrupted(err)
    except BrokenPipeError:
        # output piped into `head` and closed early: not an error worth a traceback
        sys.stderr.close()
        return 0


def _main(argv: list[str], json_mode: bool) -> int:
    from harts.config import env

    try:
        late = env.apply_thread_settings(torch_imported="torch" in sys.modules)
    except ValueError as err:
        return _user_error(UserError(str(err), field=env.THREADS), json_mode)
    if late is not None:  # in a process that imported torch before calling main
        import torch

        torch.set_num_threads(late)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ParseError as err:
        if json_mode:
            print_json(UserError(str(err)).to_json())
        else:
            err.parser.print_usage(sys.stderr)
            print(f"{err.parser.prog}: error: {err}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        if caused_by_interrupt(err):  # a library wrapped Ctrl-C into an error (a checkpoint write's)
            raise KeyboardInterrupt from err
        return _user_error(err, getattr(args, "json", False) or json_mode)


def _user_error(err: UserError, json_mode: bool) -> int:
    if json_mode:
        print_json(err.to_json())
    else:
        print(f"harts: error: {err}", file=sys.stderr)
    return 2


def _interrupted(err: KeyboardInterrupt) -> int:
    """Ctrl-C: one line on stderr, exit code 130 (128 + SIGINT), as a shell reports it."""
    try:  # a second Ctrl-C while the line is written does not turn into a traceback
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    try:
        message = str(err) if isinstance(err, Interrupted) else "interrupted"
        print(f"harts: {message}", file=sys.stderr, flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return 130


if __name__ == "__main__":
    sys.exit(main())
