"""Where a subcommand's rollouts come from, shared by the subcommands (no command of its
own): a rollout JSONL file (`--input`, token ids checked against the model's vocabulary
by file and line) or a generated workload preset (`--workload`, `--seed`, `--set`).

`read_trajectories` is the one loader of trajectories (`harts train`, `harts verify`, ...);
`load_forest` gives the rollout forest of `harts tree stats` and `harts plan`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from harts.cli.common import UserError, rollout_error

DEFAULT_WORKLOAD = "tiny-treestep"


def add_workload_args(parser: Any, required: bool) -> None:
    parser.add_argument("--workload", metavar="PRESET", required=required,
                        help="workload preset (see `harts workload presets`)")
    if required:
        parser.add_argument("--seed", type=int, default=None, help="override the preset's seed (default: the preset's own)")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="override a workload parameter, e.g. --set num_groups=4; repeatable")


def workload_config(name: str, seed: int | None, sets: list[str]):
    """The preset `name` with `--set KEY=VALUE` overrides and `seed` (None: the preset's)."""
    from harts.config.workload import WorkloadConfig
    from harts.tree.workload import preset

    fields = {f.name: f for f in dataclasses.fields(WorkloadConfig)}
    overrides: dict[str, Any] = {}
    for item in sets:
        key, eq, raw = item.partition("=")
        if not eq or key not in fields:
            raise UserError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, list):
            value = tuple(value)
        overrides[key] = value
    if seed is not None:
        overrides["seed"] = seed
    try:
        return preset(name, **overrides)
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(str(err).strip("'\"")) from None


def load_forest(args: argparse.Namespace):
    """The forest named by --input or --workload (structure-only for presets)."""
    from harts.tree.build import build_forest
    from harts.tree.io import RolloutFormatError, load_jsonl
    from harts.tree.workload import generate

    if args.input:
        try:
            trajs = load_jsonl(args.input)
        except RolloutFormatError as err:
            raise rollout_error(err) from None
        return build_forest(trajs)
    cfg = workload_config(args.workload, args.seed, args.set)
    return generate(cfg).forest()


def read_trajectories(input: str | None, workload: str | None, seed: int, vocab_size: int | None = None,
                      default: str = DEFAULT_WORKLOAD) -> list:
    """The trajectories of rollout file `input` (token ids checked against `vocab_size`, by
    file and line), or of the generated preset `workload` (`default` when None) from `seed`."""
    if input:
        from harts.tree.io import RolloutFormatError, load_jsonl

        try:
            return load_jsonl(input, vocab_size=vocab_size)
        except RolloutFormatError as err:
            raise rollout_error(err) from None
    from harts.tree.workload import generate_trajectories

    try:
        return generate_trajectories(workload or default, seed=seed)
    except (KeyError, ValueError) as err:
        raise UserError(str(err).strip("'\"")) from None


def load_trajectories(args: argparse.Namespace, default: str = DEFAULT_WORKLOAD) -> list:
    """`read_trajectories` of --input (checked against --model's or --model-path's
    vocabulary) or --workload and --seed."""
    vocab = None
    if args.input:
        from harts.cli.model_source import model_config

        vocab = model_config(args).vocab_size
    return read_trajectories(args.input, args.workload, args.seed, vocab, default)


def check_vocab(trajectories: list, model) -> None:
    """Every token id inside the vocabulary of `model` (a registered name or a ModelConfig)."""
    from harts.config.models import ConfigError, get_model_config

    try:
        cfg = get_model_config(model) if isinstance(model, str) else model
    except ConfigError as err:
        raise UserError(str(err)) from None
    for t in trajectories:
        top = int(t.tokens.max())
        if top >= cfg.vocab_size:
            raise UserError(f"trajectory {t.id!r}: token id {top} is outside the vocabulary of "
                            f"{cfg.name} (size {cfg.vocab_size})")
