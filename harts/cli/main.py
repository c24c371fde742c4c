"""The `harts` command line: one entry point, one module per subcommand family.

Every module in `harts.cli` that defines `register(subparsers)` contributes subcommands;
`main` discovers them, so adding a family never edits this file. Registration must stay
cheap: heavy imports (torch) belong in the command handlers, so `harts tree stats` starts
fast on a machine where importing torch takes seconds.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import harts.cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except harts.cli.common.UserError as err:
        print(f"harts: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # output piped into `head` and closed early: not an error worth a traceback
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
