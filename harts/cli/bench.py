"""`harts bench`: update-step throughput, tree vs expanded, on a CUDA device (prints a table,
or with --json the runs as JSON; --out writes them in the `benchmarks/results/h200.json` run
schema)."""

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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time tree vs expanded update steps on the GPU",
        description="Time full update steps (forward, backward, AdamW) in tree and expanded mode on the same "
                    "SWE-shaped rollouts. Step times are steady-state steps with each step's data side (partition, "
                    "layouts) prepared one step ahead in a background thread, the same for both modes; the "
                    "inline speedup (data side on the critical path) is reported next to it.")
    add_model_args(p, "tiny-h200", "model config (tiny-h200: Tiny-shaped, fits one H200)")
    p.add_argument("--schemes", nargs="+", choices=sorted(SCHEMES), default=["treestep", "stepwise"])
    p.add_argument("--microbatch-tokens", type=int, default=131072)
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", metavar="PATH", help="write {'runs': [...]} here (its folder must exist)")
    p.add_argument("--json", action="store_true", help="print {'runs': [...]} on stdout instead of the table")
    add_attention_args(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    import torch

    from harts.cli.model_source import load_checkpoint, model_config
    from harts.exec.bench import step_benchmark
    from harts.tree.workload import generate, preset

    if args.out:
        check_output_path(args.out, "--out")
    if not torch.cuda.is_available():
        raise UserError("harts bench needs a CUDA device")
    cfg = model_config(args)  # --model, or --model-path's config.json
    # a checkpoint's weights, read once on the host (each mode copies them to the device)
    model = args.model if not args.model_path else load_checkpoint(args, torch.bfloat16, "cpu").model
    if args.steps < 1 or args.microbatch_tokens < 1:
        raise UserError("--steps and --microbatch-tokens must be >= 1")
    kernels = kernel_config(args)
    runs = []
    for scheme in args.schemes:
        name, over = SCHEMES[scheme]
        trajs = generate(preset(name, vocab_size=cfg.vocab_size, **over)).trajectories()
        print(f"[bench] {scheme}: {len(trajs)} trajectories, {sum(len(t) for t in trajs)} tokens; "
              f"{args.warmup} warm-up + {args.steps} timed steps per mode, inline and prepared ahead",
              file=sys.stderr, flush=True)
        r = step_benchmark(trajs, model=model, microbatch_tokens=args.microbatch_tokens,
                           steps=args.steps, warmup=args.warmup, kernels=kernels)
        r.update(scheme=scheme, workload=name, overrides=over, kernels=kernels.to_dict())
        runs.append(r)
        print(f"[bench] {scheme}: speedup {r['speedup']:.2f}x ({r['speedup_over_limit']:.2f} of the FLOP limit)",
              file=sys.stderr, flush=True)
    rows = [(r["scheme"], r["expanded_tokens"], r["compact_tokens"], f"{r['token_limit']:.2f}", f"{r['flop_limit']:.2f}",
             f"{r['expanded']['seconds']:.2f}", f"{r['tree']['seconds']:.2f}", f"{r['speedup']:.2f}",
             f"{r['speedup_over_limit']:.2f}", f"{r['speedup_inline']:.2f}",
             f"{r['tree']['prepare_seconds']:.3f}", f"{r['expanded_peak_bytes'] / 2**30:.1f}",
             f"{r['tree_peak_bytes'] / 2**30:.1f}") for r in runs]
    if args.out:
        write_output(args.out, "--out", json.dumps({"runs": runs}, indent=1))
    if args.json:
        print_json({"runs": runs})
        if args.out:
            say_wrote(args.out, True)
        return 0
    print(format_table(["scheme", "expanded tok", "compact", "token limit", "FLOP limit", "exp s", "tree s", "speedup",
                        "of limit", "speedup inline", "tree prep s", "exp GiB", "tree GiB"], rows))
    print("step times with each step's data side (partition, layouts) prepared one step ahead in a background "
          "thread, both modes; 'speedup inline' prepares it on the critical path")
    if args.out:
        say_wrote(args.out, False)
    return 0
