"""`harts logprobs`: per-position log-probs and entropies of rollouts under a checkpoint,
computed over rollout trees (every shared prefix row once), as the RL step's old- or
reference-policy recomputation.

One output line per trajectory, in input order:
`{"id": ..., "logprobs": [null, lp_1, ..., lp_{L-1}], "entropy": [null, H_1, ...]}`, where
`lp_p` is the log-prob of `tokens[p]` from the logits at p-1 and `H_p` the entropy of that
distribution, at every position (masked or not).
"""

from __future__ import annotations

import argparse
import json
import math

from harts.cli.common import (
    UserError,
    atomic_output,
    check_output_path,
    print_json,
    rollout_error,
    say_wrote,
)

_DTYPES = ("float32", "float64", "bfloat16")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logprobs", help="per-token log-probs and entropies of rollouts under a checkpoint (on trees)")
    p.add_argument("--model-path", required=True, metavar="DIR", help="Hugging Face checkpoint directory")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a pytorch_model.bin checkpoint (torch.load(weights_only=True)); refused by default")
    p.add_argument("--input", required=True, metavar="FILE.jsonl", help="rollout JSONL file")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="output JSONL, one line per trajectory")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="compute dtype (default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--microbatch-tokens", type=int, default=1 << 16,
                   help="compact (tree) rows per forward (whole rollout groups are packed under it)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=cmd_logprobs)


def _values(a) -> list:
    return [None if not math.isfinite(v) else v for v in a.tolist()]


def cmd_logprobs(args: argparse.Namespace) -> int:
    if args.microbatch_tokens < 1:
        raise UserError("--microbatch-tokens must be >= 1", field="--microbatch-tokens")
    check_output_path(args.out, "--out")
    import torch

    from harts.cli.model_source import load_checkpoint, model_config
    from harts.config.models import ConfigError
    from harts.tree.io import RolloutFormatError, load_jsonl

    config = model_config(args)
    try:
        config.check_tree_mode()
    except ConfigError as err:
        raise UserError(str(err)) from None
    try:
        trajectories = load_jsonl(args.input, vocab_size=config.vocab_size)
    except RolloutFormatError as err:
        raise rollout_error(err) from None
    if not trajectories:
        raise UserError(f"{args.input}: no trajectories", file=args.input)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    loaded = load_checkpoint(args, dtype, args.device)

    from harts.exec.factory import make_trainer

    trainer = make_trainer("tree", loaded.model)
    result = trainer.evaluate(trajectories, args.microbatch_tokens)
    with atomic_output(args.out, "--out") as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for t, lp, ent in zip(trajectories, result.logprobs, result.entropy, strict=True):
            fh.write(json.dumps({"id": t.id, "logprobs": _values(lp), "entropy": _values(ent)}) + "\n")
    summary = {"out": args.out, "model": loaded.config.name, "model_type": loaded.adapter.model_type,
               "dtype": str(loaded.model.lm_head_weight.dtype).removeprefix("torch."), "device": args.device,
               "trajectories": len(trajectories), "expanded_tokens": result.tokens,
               "compact_tokens": result.executed_rows, "microbatches": len(result.microbatches)}
    if args.json:
        print_json(summary)
    else:
        print(f"{loaded.config.name} ({loaded.adapter.model_type}, {summary['dtype']}, {args.device}): "
              f"{len(trajectories)} trajectories, {result.tokens} tokens -> {result.executed_rows} tree rows")
    say_wrote(args.out, args.json, f"{len(trajectories)} trajectories")
    return 0
