"""`harts workload ...` and `harts tree ...`: generate rollouts, build trees, report statistics."""

from __future__ import annotations

import argparse
import dataclasses
import time

from harts.cli.common import (
    UserError,
    atomic_output,
    check_output_path,
    format_table,
    print_json,
    say_wrote,
)
from harts.cli.data import add_workload_args, load_forest, workload_config


def register(sub: argparse._SubParsersAction) -> None:
    wl = sub.add_parser("workload", help="generate synthetic SWE-bench-shaped rollouts")
    wl_sub = wl.add_subparsers(dest="workload_command", metavar="ACTION", required=True)
    gen = wl_sub.add_parser("generate", help="write a workload preset as rollout JSONL")
    add_workload_args(gen, required=True)
    gen.add_argument("--out", required=True, help="output JSONL path (its folder must exist)")
    gen.add_argument("--json", action="store_true", help="print what was written as JSON")
    gen.set_defaults(func=cmd_generate)
    shp = wl_sub.add_parser("shape", help="write an instance of a tree-shape family (the benchmark suites' "
                                          "instances) as rollout JSONL")
    shp.add_argument("--instance", required=True, metavar="FAMILY/SEED@BUDGET",
                     help="e.g. grpo/3@16384 or long-agent/1@32768 (families: harts.tree.shapes)")
    shp.add_argument("--vocab-size", type=int, default=32768, help="token ids below this (default 32768)")
    shp.add_argument("--out", required=True, help="output JSONL path (its folder must exist)")
    shp.add_argument("--json", action="store_true", help="print what was written as JSON")
    shp.set_defaults(func=cmd_shape)
    ls = wl_sub.add_parser("presets", help="list workload presets")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_presets)

    tr = sub.add_parser("tree", help="rollout-tree tools")
    tr_sub = tr.add_subparsers(dest="tree_command", metavar="ACTION", required=True)
    st = tr_sub.add_parser("stats", help="expanded/compact tokens, compression, nodes, depth, forks")
    src = st.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="rollout JSONL file")
    add_workload_args(src, required=False)
    st.add_argument("--seed", type=int, default=None, help="workload seed (with --workload; default: the preset's own)")
    st.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a workload parameter (with --workload); repeatable")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_stats)


def cmd_presets(args: argparse.Namespace) -> int:
    from harts.config.workload import PRESETS

    rows = [
        (name, c.scheme.value, c.num_groups, c.rollouts_per_group, f"{c.prompt_tokens[0]}-{c.prompt_tokens[1]}",
         c.turns_median, c.max_context, c.microbatch_tokens)
        for name, c in PRESETS.items()
    ]
    if args.json:
        print_json({name: dataclasses.asdict(c) for name, c in PRESETS.items()})
    else:
        print(format_table(["preset", "scheme", "groups", "rollouts", "prompt", "turns~", "max ctx",
                            "mb budget"], rows))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from harts.tree.io import write_jsonl
    from harts.tree.workload import generate

    check_output_path(args.out, "--out")
    cfg = workload_config(args.workload, args.seed, args.set)
    wl = generate(cfg)
    try:
        trajs = wl.trajectories()
    except ValueError as err:
        raise UserError(str(err)) from None
    with atomic_output(args.out, "--out") as tmp, open(tmp, "w", encoding="utf-8") as fh:
        write_jsonl(trajs, fh)
    tokens = sum(len(t) for t in trajs)
    if args.json:
        print_json({"out": args.out, "workload": args.workload, "seed": cfg.seed, "trajectories": len(trajs),
                    "tokens": tokens})
    say_wrote(args.out, args.json, f"{len(trajs)} trajectories, {tokens:,} tokens")
    return 0


def cmd_shape(args: argparse.Namespace) -> int:
    from harts.tree import build_forest, shapes
    from harts.tree.io import write_jsonl

    families = [*shapes.FAMILIES, *shapes.LONG_FAMILIES]
    try:
        family, rest = args.instance.split("/")
        seed, budget = (int(x) for x in rest.split("@"))
    except ValueError:
        raise UserError(f"--instance {args.instance!r} is not FAMILY/SEED@BUDGET (e.g. grpo/3@16384)") from None
    if family not in families:
        raise UserError(f"--instance: unknown family {family!r}; known: {', '.join(families)}")
    if args.vocab_size < 2:
        raise UserError(f"--vocab-size must be at least 2, got {args.vocab_size}")
    check_output_path(args.out, "--out")
    try:
        trajs = shapes.draw(family, seed, budget, vocab_size=args.vocab_size)
    except ValueError as err:
        raise UserError(f"--instance {args.instance}: {err}") from None
    with atomic_output(args.out, "--out") as tmp, open(tmp, "w", encoding="utf-8") as fh:
        write_jsonl(trajs, fh)
    forest = build_forest(trajs)
    info = {"out": args.out, "instance": args.instance, "trajectories": len(trajs),
            "expanded_tokens": int(forest.expanded_tokens), "compact_tokens": int(forest.compact_tokens),
            "longest": int(forest.traj_length.max())}
    if args.json:
        print_json(info)
    say_wrote(args.out, args.json, f"{len(trajs)} trajectories, {info['expanded_tokens']:,} tokens "
                                   f"({info['compact_tokens']:,} as a tree), the longest {info['longest']:,}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    forest = load_forest(args)
    stats = forest.stats()
    from harts.tree.prefix import duplicate_counts

    stats.update(duplicate_counts(forest))
    stats["build_seconds"] = time.perf_counter() - start
    if args.json:
        print_json(stats)
    else:
        rows = [(k.replace("_", " "), v) for k, v in stats.items()]
        print(format_table(["statistic", "value"], rows))
    return 0
