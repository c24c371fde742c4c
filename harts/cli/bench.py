"""`harts bench`: update-step throughput, tree vs the non-tree baselines (packed expanded,
prefix-merged expanded), on a CUDA device (prints a table, or with --json the runs as
JSON; --out writes them in the run schema of `benchmarks/results/step/headline.json`, with
provenance). The step is a built-in scheme, a workload preset (`--workload NAME --set
key=value`) or the user's own rollouts (`--input rollouts.jsonl`)."""

from __future__ import annotations

import argparse
import sys

from harts.cli.common import (
    UserError,
    add_attention_args,
    check_output_path,
    format_table,
    kernel_config,
    print_json,
    say_wrote,
    write_output,
)
from harts.cli.model_source import add_model_args

SCHEMES = {
    # the generator's SWE calibration, one prompt group (one GPU)
    "treestep": ("swe-treestep-1", {}),
    # full SWE stepwise is 8.6M expanded tokens; one rollout at a 24k context cap keeps its shape
    "stepwise": ("swe-stepwise-1", {"rollouts_per_group": 1, "max_context": 24576}),
}
BASELINE_CHOICES = {"packed": ("packed",), "prefix-merged": ("prefix-merged",), "both": ("packed", "prefix-merged")}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time tree vs expanded update steps on the GPU",
        description="Time full update steps (forward, backward, AdamW) in tree mode and in the non-tree baselines "
                    "(packed expanded; prefix-merged expanded, where a sequence that is a prefix of another runs "
                    "inside it) on the same rollouts. Step times are steady-state steps with each step's data side "
                    "(partition, layouts) prepared one step ahead in a background thread, the same for every mode; "
                    "the inline speedup (data side on the critical path) is reported next to it, and the ideal "
                    "speedup (each op's baseline time scaled by its own work ratio) next to the token ratio.")
    add_model_args(p, "tiny-h200", "model config (tiny-h200: Tiny-shaped, fits one H200)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--schemes", nargs="+", choices=sorted(SCHEMES), default=None,
                     help="built-in SWE-shaped steps (default: treestep stepwise)")
    src.add_argument("--workload", metavar="PRESET", help="time one step of a workload preset (with --set)")
    src.add_argument("--input", metavar="JSONL", help="time one step of these rollouts (harts rollout JSONL)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a workload parameter (with --workload); repeatable")
    p.add_argument("--baseline", choices=sorted(BASELINE_CHOICES), default="both",
                   help="which non-tree baseline(s) to time (default: both)")
    p.add_argument("--microbatch-tokens", type=int, default=131072)
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", metavar="PATH", help="write {'runs': [...], 'provenance': ...} here (its folder must exist)")
    p.add_argument("--json", action="store_true",
                   help="print {'runs': [...], 'provenance': ...} on stdout instead of the table")
    add_attention_args(p)
    p.set_defaults(func=cmd_bench)


def _steps(args: argparse.Namespace, vocab: int) -> list[tuple[str, str, dict, list]]:
    """(label, workload, overrides, trajectories) per step to time."""
    from harts.tree.workload import generate, preset

    if args.input:
        from harts.cli.common import rollout_error
        from harts.tree.io import RolloutFormatError, load_jsonl

        try:
            trajs = load_jsonl(args.input)
        except RolloutFormatError as err:
            raise rollout_error(err) from None
        except OSError as err:
            raise UserError(f"--input {args.input}: {err.strerror or err}") from None
        return [("input", args.input, {}, trajs)]
    if args.workload:
        from harts.cli.data import workload_config

        sets = list(args.set)
        if not any(s.partition("=")[0] == "vocab_size" for s in sets):
            sets.append(f"vocab_size={vocab}")  # the model's vocabulary unless asked otherwise
        cfg = workload_config(args.workload, None, sets)
        over = {s.partition("=")[0]: s.partition("=")[2] for s in sets}
        try:
            trajs = generate(cfg).trajectories()
        except ValueError as err:
            raise UserError(str(err)) from None
        if max(int(t.tokens.max()) for t in trajs) >= vocab:
            raise UserError(f"--workload {args.workload}: token ids reach the workload's vocab_size "
                            f"{cfg.vocab_size}, beyond the model's {vocab}: set vocab_size <= {vocab}")
        return [(args.workload, args.workload, over, trajs)]
    out = []
    for scheme in args.schemes or ["treestep", "stepwise"]:
        name, over = SCHEMES[scheme]
        out.append((scheme, name, over, generate(preset(name, vocab_size=vocab, **over)).trajectories()))
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    import torch

    from harts.bench.step import step_benchmark
    from harts.cli.model_source import load_checkpoint, model_config

    if args.set and not args.workload:
        raise UserError("--set needs --workload")
    if args.out:
        check_output_path(args.out, "--out")
    if not torch.cuda.is_available():
        if args.input:
            raise UserError(f"harts bench --input {args.input}: no CUDA device here; timing update steps needs a "
                            "GPU (`harts tree stats --input` and `harts sim` work on CPU)")
        raise UserError("harts bench needs a CUDA device")
    cfg = model_config(args)  # --model, or --model-path's config.json
    # a checkpoint's weights, read once on the host (each mode copies them to the device)
    model = args.model if not args.model_path else load_checkpoint(args, torch.bfloat16, "cpu").model
    if args.steps < 1 or args.microbatch_tokens < 1:
        raise UserError("--steps and --microbatch-tokens must be >= 1")
    from harts.bench.memory import largest_fitting_budget, memory_plan

    capacity = torch.cuda.get_device_properties(0).total_memory
    plan = memory_plan(cfg, args.microbatch_tokens)
    print(f"[bench] planned peak {plan['total_bytes'] / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB "
          f"(weights+grads+AdamW {plan['static_bytes'] / 2**30:.1f}, activations "
          f"{plan['activation_bytes'] / 2**30:.1f}, LM head chunk {plan['lm_head_bytes'] / 2**30:.1f})",
          file=sys.stderr, flush=True)
    if plan["total_bytes"] > capacity:
        fits = largest_fitting_budget(cfg, capacity)
        raise UserError(f"{cfg.name} at --microbatch-tokens {args.microbatch_tokens} plans "
                        f"{plan['total_bytes'] / 2**30:.1f} GiB, more than this GPU's {capacity / 2**30:.1f} GiB; "
                        + (f"--microbatch-tokens {fits} fits" if fits else "its weights and optimizer state alone "
                           "do not fit one GPU"))
    kernels = kernel_config(args)
    baselines = BASELINE_CHOICES[args.baseline]
    runs = []
    for label, name, over, trajs in _steps(args, cfg.vocab_size):
        print(f"[bench] {label}: {len(trajs)} trajectories, {sum(len(t) for t in trajs)} tokens; "
              f"{args.warmup} warm-up + {args.steps} timed steps per mode ({', '.join(baselines)}, tree)",
              file=sys.stderr, flush=True)
        r = step_benchmark(trajs, model=model, microbatch_tokens=args.microbatch_tokens,
                           steps=args.steps, warmup=args.warmup, kernels=kernels, baselines=baselines,
                           progress=lambda line, label=label: print(f"[bench] {label} {line}", file=sys.stderr,
                                                                    flush=True))
        r.update(scheme=label, workload=name, overrides=over, kernels=kernels.to_dict())
        runs.append(r)
        for b, v in r["baselines"].items():
            print(f"[bench] {label}: over {b} {v['speedup']:.2f}x ({v['of_ideal']:.2f} of the ideal "
                  f"{v['ideal']:.2f}x)", file=sys.stderr, flush=True)
    rows = []
    for r in runs:
        for b, v in r["baselines"].items():
            key = "expanded" if b == "packed" else "prefix_merged"
            rows.append((r["scheme"], b, r["expanded_tokens"], r[key]["rows"], r["tree"]["rows"],
                         f"{v['token_ratio']:.2f}", f"{v['ideal']:.2f}", f"{r[key]['seconds']:.2f}",
                         f"{r['tree']['seconds']:.2f}", f"{v['speedup']:.2f}", f"{v['of_ideal']:.2f}",
                         f"{v['speedup_inline']:.2f}", f"{r[key]['peak_bytes'] / 2**30:.1f}",
                         f"{r['tree']['peak_bytes'] / 2**30:.1f}"))
    from harts.bench.provenance import provenance

    doc = {"runs": runs, "provenance": provenance()}
    if args.out:
        write_output(args.out, "--out", json.dumps(doc, indent=1, default=str))
    if args.json:
        print_json(doc)
        if args.out:
            say_wrote(args.out, True)
        return 0
    print(format_table(["step", "baseline", "expanded tok", "baseline rows", "tree rows", "token ratio", "ideal",
                        "baseline s", "tree s", "speedup", "of ideal", "speedup inline", "baseline GiB",
                        "tree GiB"], rows))
    print("step times with each step's data side (partition, layouts) prepared one step ahead in a background "
          "thread, every mode; 'speedup inline' prepares it on the critical path; 'ideal': each op's baseline "
          "time scaled by its own work ratio (harts.sim.flops.ideal_speedup)")
    if args.out:
        say_wrote(args.out, False)
    return 0
