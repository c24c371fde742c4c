"""`harts train`: policy-update steps on rollouts, trajectory-expanded or over rollout trees,
in one process or distributed (`torchrun --nproc-per-node N -m harts train --parallel ...`).

The command is flags -> `harts.config.train.TrainConfig` -> `harts.train`: the run is what
the config describes, however it was given. Where a setting comes from, first match wins:

1. a flag given on the command line;
2. `--config FILE`'s value (a TOML file in `TrainConfig.to_toml`'s form);
3. the default (each flag's --help states it; kernels: the HARTS_* environment's).

`--print-config` writes the resolved config as TOML and exits, a file `--config` reads
back; every result (the --json output) carries the run's config. Errors name the flag that
sets the field at fault, or the config key where it came from the file (one line, exit 2,
before any work; distributed, before the mesh's first collective). Ctrl-C is one line with
the last finished step and checkpoint (exit 130); under --json the finished steps are
still printed.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from harts.cli.common import (
    Interrupted,
    UserError,
    add_attention_args,
    caused_by_interrupt,
    format_table,
    print_json,
    say_wrote,
)
from harts.cli.model_source import add_model_args

# the flags, by argparse dest, and the TrainConfig field each sets (dotted path)
_FIELDS = {
    "mode": "mode", "model": "model.name", "model_path": "model.path", "allow_pickle": "model.allow_pickle",
    "recompute": "model.recompute", "workload": "data.workload", "input": "data.input", "steps": "steps",
    "seed": "seed", "microbatch_tokens": "plan.microbatch_tokens", "planner": "plan.planner", "plan": "plan.file",
    "window_floors": "plan.window_floors",
    "aux_scope": "aux_scope", "lr": "optimizer.lr", "grad_clip": "optimizer.grad_clip",
    "agg_mode": "loss.agg_mode", "kl_coef": "loss.kl_coef", "old_logprobs": "old_logprobs",
    "dtype": "precision.dtype", "device": "precision.device", "parallel": "parallel",
    "schedule": "parallel.schedule", "checkpoint_dir": "checkpoint.dir", "checkpoint_every": "checkpoint.every",
    "resume": "checkpoint.resume", "save": "checkpoint.save", "tree_attention": "kernels.tree_attention",
    "baseline_attention": "kernels.baseline_attention", "compile": "kernels.compile",
}
# flags setting a field of the [kernels] section (resolved over the HARTS_* environment)
_KERNEL_FLAGS = ("tree_attention", "baseline_attention", "compile")
# a flag setting one field of an exclusive pair clears the other
_CLEARS = {"model": "model.path", "model_path": "model.name", "workload": "data.input", "input": "data.workload"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


_FLAG_OF = {path: _flag(dest) for dest, path in _FIELDS.items()}
_FLAG_OF.update({f"parallel.{d}": "--parallel" for d in ("dp", "pp", "ep", "tp")})


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run RL policy-update steps (PPO/GRPO loss) on rollouts",
                       epilog="precedence: a flag given on the command line, then --config FILE's value, then the "
                       "default")
    p.add_argument("--config", metavar="FILE.toml", default=None,
                   help="read the run's settings from this TOML file (a TrainConfig, as --print-config writes it); "
                   "flags given explicitly override its values")
    p.add_argument("--print-config", action="store_true",
                   help="write the resolved config (flags over --config over defaults) as TOML to stdout and exit")
    p.add_argument("--mode", choices=["expanded", "tree"], default="expanded",
                   help="expanded: the trajectory-by-trajectory baseline; tree: rollout-tree execution, the "
                   "same numbers with every shared token computed once (--parallel needs tree)")
    add_model_args(p, "tiny-cpu")
    p.add_argument("--save", metavar="DIR", default=None,
                   help="with --model-path: write the trained weights there as a Hugging Face checkpoint "
                   "(the source's config.json, tensor names and dtypes)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="PRESET", default=None,
                     help="generated workload preset (default tiny-treestep)")
    src.add_argument("--input", metavar="FILE.jsonl", default=None, help="rollout JSONL file")
    p.add_argument("--steps", type=int, default=3, help="update steps (default 3)")
    p.add_argument("--microbatch-tokens", type=int, default=4096, help="token budget per microbatch")
    p.add_argument("--aux-scope", choices=["microbatch", "global"], default="microbatch",
                   help="the MoE aux loss's routing statistics (ModelConfig.aux_scope): microbatch: each "
                   "microbatch's own, scaled by its token share (depends on the split: pipeline stages and "
                   "planners split differently); global: the step's, from one extra no-grad pass (the same "
                   "aux loss for any split)")
    p.add_argument("--planner", default=None, metavar="NAME",
                   help="tree mode: execute this step planner's plan (e.g. l1l2: trees larger than the "
                   "budget split into producer/consumer sharing windows); default: whole trees per microbatch, "
                   "with --parallel l1l2")
    p.add_argument("--seed", type=int, default=0, help="model init and workload seed")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (<= 0: off)")
    p.add_argument("--agg-mode", default="token-mean",
                   choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"],
                   help="how the policy loss averages over tokens and sequences")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the rollouts' ref log-probs")
    p.add_argument("--old-logprobs", choices=["recompute", "input"], default="recompute",
                   help="recompute: current policy's log-probs before the step (on-policy, "
                   "as verl's actor); input: the rollouts' old_logprobs (each step's data side is then "
                   "prepared one step ahead, in a background thread)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default=None,
                   help="default float32; with --model-path the checkpoint's")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--recompute", action="store_true", help="activation recomputation per layer")
    p.add_argument("--parallel", default=None, metavar="SPEC",
                   help="distributed: dp=N,pp=N,ep=N,tp=N (under torchrun --nproc-per-node N; needs --mode tree); "
                   "default: one process")
    p.add_argument("--plan", default=None, metavar="FILE.json", help="with --parallel: run this saved plan (default: plan with --planner)")
    p.add_argument("--window-floors", default=None, metavar="PROFILE",
                   help="--planner l1l2: plan with the model's microbatch floors on this hardware profile (h100, "
                        "h200 or a profile JSON), windows only where they pay; auto (default): the profile of "
                        "the CUDA device trained on (H100, H200), rows alone elsewhere; off: rows alone")
    p.add_argument("--schedule", default="consumer-1f1b", choices=["non-overlap", "overlap-bwd-first", "consumer-1f1b"],
                   help="with --parallel pp>1: the pipeline schedule (the simulator's, lowered to the pipelining runtime)")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="write checkpoints (torch.distributed.checkpoint) into DIR: after every "
                   "--checkpoint-every steps and after the last step")
    p.add_argument("--checkpoint-every", type=int, metavar="N", default=None,
                   help="checkpoint after every N-th step (needs --checkpoint-dir; default: after the last step only)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run from the latest checkpoint in --checkpoint-dir (from step 1 "
                   "if it holds none yet); a checkpoint written with other settings that change the numbers "
                   "is refused")
    add_attention_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _record_explicit(p)
    p.set_defaults(func=cmd_train)


# ---- flags -> TrainConfig ------------------------------------------------------------------------


def _record_explicit(parser: argparse.ArgumentParser) -> None:
    """Make every option of `parser` record its dest in `namespace.explicit_flags` when it is
    given on the command line (argparse calls an option's action only then)."""
    classes: dict[type, type] = {}

    def recording(cls: type) -> type:
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001, N807
            given = getattr(namespace, "explicit_flags", None)
            if given is None:
                given = set()
                namespace.explicit_flags = given
            given.add(self.dest)
            cls.__call__(self, parser, namespace, values, option_string)

        return type(cls.__name__, (cls,), {"__call__": __call__})

    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            if type(action) not in classes:
                classes[type(action)] = recording(type(action))
            action.__class__ = classes[type(action)]


class _Source:
    """Where the resolved config's fields came from: which were flags, and the --config file."""

    def __init__(self, explicit: set[str], file: str | None):
        self.flags = {_FIELDS[d] for d in explicit if d in _FIELDS}
        self.file = file

    def name(self, path: str) -> str:
        """A field as the user set it: its flag, or (from the file) its config key."""
        from_flag = path in self.flags or path.split(".")[0] in self.flags
        if (self.file is None or from_flag) and path in _FLAG_OF:
            return _FLAG_OF[path]
        return path

    def error(self, err: BaseException) -> UserError:
        """A ConfigError or TrainError as a one-line UserError naming the flag or key."""
        path = getattr(err, "field", None) or None
        text = re.sub(r"`([A-Za-z0-9_.]*)`", lambda m: self.name(m.group(1)), str(err))
        name = self.name(path) if path else None
        in_file = self.file is not None and name is not None and not name.startswith("--")
        flag = name is not None and name.startswith("--")
        return UserError(text, file=self.file if in_file else None, field=name if flag or in_file else None)


def resolve_config(args: argparse.Namespace) -> tuple[Any, _Source]:
    """The run's TrainConfig from --config FILE (if given), the flags given explicitly on top,
    and the kernels of the HARTS_* environment where neither sets them."""
    from harts.config.models import ConfigError
    from harts.config.train import TrainConfig

    explicit = set(getattr(args, "explicit_flags", set()))
    source = _Source(explicit, args.config)
    try:
        base = TrainConfig.from_toml(args.config) if args.config is not None else TrainConfig()
    except ConfigError as err:
        raise UserError(str(err).replace("`", ""), file=args.config, field=getattr(err, "field", None) or None) \
            from None
    values: dict[str, Any] = {}
    for dest in sorted(explicit & set(_FIELDS)):
        value = getattr(args, dest)
        if dest in ("parallel", *_KERNEL_FLAGS):
            continue
        if dest == "grad_clip" and value <= 0:
            value = None
        values[_FIELDS[dest]] = value
        if dest in _CLEARS:
            values[_CLEARS[dest]] = None
    if "parallel" in explicit:
        from harts.config.parallel import parse_degrees

        try:
            degrees = parse_degrees(args.parallel)
        except ValueError as err:
            raise UserError(str(err), field="--parallel") from None
        values.update({f"parallel.{d}": degrees.get(d, None if d == "dp" else 1) for d in ("dp", "pp", "ep", "tp")})
    elif "schedule" in explicit and base.parallel is None:
        raise UserError("--schedule needs --parallel (the pipeline schedule of pp > 1)", field="--schedule")
    try:
        config = base.override(values)
        kernels = {k: getattr(args, k) for k in _KERNEL_FLAGS if k in explicit}
        if config.kernels is None or kernels:
            from harts.config.kernels import KernelConfig

            resolved = KernelConfig.from_env() if config.kernels is None else config.kernels
            config = config.replace(kernels=resolved.replace(**kernels))
    except ConfigError as err:
        raise source.error(err) from None
    except ValueError as err:  # the HARTS_* environment's kernel settings
        raise UserError(str(err)) from None
    return config, source


# ---- the command ---------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    config, source = resolve_config(args)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    from harts.cli.data import read_trajectories
    from harts.cli.model_source import checkpoint_error, config_error
    from harts.config.models import ConfigError
    from harts.models import CheckpointError
    from harts.train import TrainError, build_trainer, model_config

    path = config.model.path
    try:
        vocab = model_config(config).vocab_size
        trajectories = read_trajectories(config.data.input, config.data.workload, config.seed, vocab)
        run = build_trainer(config, trajectories)
    except TrainError as err:
        raise source.error(err) from None
    except CheckpointError as err:
        raise checkpoint_error(err, path) from None
    except ConfigError as err:  # a checkpoint's config.json value the adapter does not support
        raise (config_error(err, path) if path is not None else UserError(str(err))) from None
    ok = False
    try:
        _steps(args, run, source)
        ok = True
    finally:
        run.close(ok)
    return 0


def _steps(args: argparse.Namespace, run: Any, source: _Source) -> None:
    from harts.train import TrainError

    config, main = run.config, run.is_main
    report = {**run.describe()}
    try:
        for rec in run.steps():
            if not main:
                continue
            if not args.json and rec.step == run.start + 1 and run.mesh is None:
                v = rec.values
                budget, largest = config.plan.microbatch_tokens, v.get("largest_microbatch_rows", 0)
                size = (f"of <= {budget} tokens" if largest <= budget else
                        f"(the largest {largest} rows, over the budget {budget}: whole trees per microbatch; "
                        f"--planner l1l2 splits them at the budget)")
                print(f"{report['model']} ({config.mode}): {len(run.trajectories)} trajectories, {v['tokens']} "
                      f"tokens -> {v['executed_rows']} executed rows, {v['microbatches']} microbatches {size}, "
                      f"{run.device}")
            if not args.json:  # each step once, as it finishes
                print(_step_line(rec.values), flush=True)
                if rec.checkpoint is not None:
                    print(f"checkpoint {rec.checkpoint}", flush=True)
        saved = run.finish()
    except (KeyboardInterrupt, TrainError) as err:
        if isinstance(err, TrainError) and not caused_by_interrupt(err):
            raise source.error(err) from None
        done = run.finished[-1].step if run.finished else run.start
        if args.json and main:  # the finished steps' records, still valid JSON
            print_json({**report, "steps": [r.values for r in run.finished], "interrupted": True,
                        "config": config.to_dict()})
        latest = run.latest_checkpoint()
        where = f"checkpoint at {latest}" if latest is not None else "no checkpoint"
        raise Interrupted(f"interrupted after step {done}; {where}") from None
    if not main:
        return
    records = [r.values for r in run.finished]
    if args.json:
        print_json({**report, "steps": records, "config": config.to_dict()})
    elif run.mesh is not None:
        print(format_table(["step", "loss", "pg_loss", "aux_loss", "grad_norm", "tokens/s"],
                           [(r["step"], r["loss"], r["pg_loss"], r["aux_loss"], r["grad_norm"],
                             round(r["tokens_per_s"])) for r in records]))
    if saved is not None:
        say_wrote(saved, args.json, "Hugging Face checkpoint")


def _step_line(v: dict) -> str:
    return (f"step {v['step']}  loss {v['loss']:.6f}  pg {v['pg_loss']:.6f}  kl {v['kl']:.3e}  "
            f"aux {v['aux_loss']:.3e}  grad_norm {v['grad_norm']:.4f}  entropy {v['entropy']:.4f}  "
            f"clip_frac {v['clip_frac']:.4f}  {v['tokens_per_s']:,.0f} tok/s")
