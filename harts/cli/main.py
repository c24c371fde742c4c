"""The `harts` command line: one entry point, one module per subcommand family.

Every module in `harts.cli` that defines `register(subparsers)` contributes subcommands;
`main` discovers them, so adding a family never edits this file. Registration must stay
cheap: heavy imports (torch) belong in the command handlers, so `harts tree stats` starts
fast on a machine where importing torch takes seconds.

Every runnable subcommand takes `--json` (tests/cli/test_json.py walks the parser to hold
this). Under `--json` an error, whether the handler's `UserError` or argparse's own, is
printed on stdout as `{"error": ..., "file": ..., "line": ..., "field": ...}` (keys null
where unknown), with the same exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import harts.cli
from harts.cli.common import UserError, print_json


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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    json_mode = "--json" in argv
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
        if getattr(args, "json", False) or json_mode:
            print_json(err.to_json())
        else:
            print(f"harts: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # output piped into `head` and closed early: not an error worth a traceback
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
