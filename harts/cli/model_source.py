"""Where a subcommand's model comes from: a registered config (`--model NAME`, random
weights from --seed) or a Hugging Face checkpoint directory (`--model-path DIR`, its
config and weights; `harts.models`). The two flags are mutually exclusive.

`model_config(args)` reads only the config (what planners and the simulator price);
`load_checkpoint(args, dtype, device)` loads the weights too. Both turn a bad directory
or an unsupported config value into a one-line `UserError`.
"""

from __future__ import annotations

import argparse

from harts.cli.common import UserError


def add_model_args(p: argparse.ArgumentParser, default: str | None, help: str = "model config") -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--model", default=default, metavar="NAME", help=help + " (see `harts model params`)")
    group.add_argument("--model-path", default=None, metavar="DIR",
                       help="a Hugging Face checkpoint directory (config.json + safetensors; "
                       "model types: kimi_linear, qwen3_next, qwen3_5_text, qwen3_5_moe_text) instead of --model")
    p.add_argument("--allow-pickle", action="store_true",
                   help="with --model-path: read a pytorch_model.bin checkpoint (torch.load(weights_only=True)); "
                   "refused by default, since unpickling an untrusted file can run code")


def model_config(args: argparse.Namespace):
    """The ModelConfig of --model or --model-path (config.json only)."""
    from harts.config.models import ConfigError, get_model_config

    if getattr(args, "model_path", None):
        from harts.models import CheckpointError, load_config

        try:
            return load_config(args.model_path)[0]
        except CheckpointError as err:
            raise checkpoint_error(err, args.model_path) from None
        except ConfigError as err:
            raise config_error(err, args.model_path) from None
    try:
        return get_model_config(args.model)
    except ConfigError as err:
        raise UserError(str(err), field="--model") from None


def checkpoint_error(err, model_path) -> UserError:
    """A `harts.models.CheckpointError` as a UserError whose `file` is the file it names (a
    shard, the index, config.json), else the --model-path directory."""
    return UserError(str(err), file=getattr(err, "path", None) or str(model_path))


def config_error(err, model_path) -> UserError:
    """An adapter's ConfigError (an unsupported config.json value) as a UserError whose
    `file` is the config.json and `field` the config field it names."""
    from pathlib import Path

    from harts.models.hf import config_field
    from harts.models.hf.io import CONFIG

    return UserError(str(err), file=str(Path(model_path) / CONFIG), field=config_field(err))


def load_checkpoint(args: argparse.Namespace, dtype, device):
    """The LoadedModel of --model-path in `dtype` on `device`."""
    from harts.config.models import ConfigError
    from harts.models import CheckpointError, load

    try:
        return load(args.model_path, dtype=dtype, device=device, allow_pickle=args.allow_pickle)
    except CheckpointError as err:
        raise checkpoint_error(err, args.model_path) from None
    except ConfigError as err:
        raise config_error(err, args.model_path) from None
