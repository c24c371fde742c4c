"""Hugging Face checkpoints: one adapter per transformers `model_type`.

An `HFAdapter` maps a checkpoint's `config.json` (a dict) to a `ModelConfig`, its tensors
(by their names in the files) to `HybridModel` state-dict tensors, and back. The adapters
are the only place that knows a family's key names and config fields; reading and writing
directories is `harts.models.hf.io`. Each adapter lives in its own module, which exposes
`ADAPTER`, and is registered by importing it in the registration list below.

Refusal rule: a config value that the HARTS model cannot compute exactly (an activation
other than SiLU, attention biases, dropout, a layer layout HARTS cannot express, ...) raises
`ConfigError` naming the field; nothing is approximated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from torch import Tensor

from harts.config.models import ConfigError, ModelConfig
from harts.config.registry import Registry


class HFModelType(StrEnum):
    """The transformers model types HARTS reads and writes (one adapter module each)."""

    KIMI_LINEAR = "kimi_linear"
    QWEN3_NEXT = "qwen3_next"


@dataclass(frozen=True)
class HFAdapter:
    """One transformers model family.

    `to_config(hf_config)`: the ModelConfig (ConfigError naming the field on anything
    unsupported). `to_harts(tensors, config)`: HybridModel state-dict tensors from the
    checkpoint's tensors by their file names (KeyError-free: missing or unexpected names
    raise `CheckpointKeyError`). `to_hf(state, config, hf_config)`: the inverse, file names
    and shapes as transformers' `save_pretrained` writes them."""

    model_type: str
    to_config: Callable[[dict], ModelConfig]
    to_harts: Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]
    to_hf: Callable[[dict[str, Tensor], ModelConfig, dict], dict[str, Tensor]]


class CheckpointKeyError(ValueError):
    """Checkpoint tensors that do not fit the config: the message names the tensor,
    `tensor` holds its name (the reader adds the file it came from)."""

    def __init__(self, message: str, *, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class _UnknownModelType(ConfigError):
    pass


_ADAPTERS: Registry[HFModelType, HFAdapter] = Registry(
    "model_type", HFModelType, _UnknownModelType, "supported model types")


def register_adapter(adapter: HFAdapter) -> HFAdapter:
    try:
        key = HFModelType(adapter.model_type)
    except ValueError:
        raise ConfigError(f"adapter model_type {adapter.model_type!r} is not an HFModelType member") from None
    return _ADAPTERS.register(key, adapter)


def supported_model_types() -> list[str]:
    return _ADAPTERS.known()


def get_adapter(model_type: object) -> HFAdapter:
    """The adapter of `model_type` (config.json's field); unknown ones fail naming the
    file, the field and the supported types."""
    if not isinstance(model_type, str) or model_type not in supported_model_types():
        raise ConfigError(f"config.json: field 'model_type' is {model_type!r}; supported model types: "
                          f"{', '.join(supported_model_types())}")
    return _ADAPTERS.get(model_type)


# registration: one module per model type, each exposing ADAPTER
from harts.models.hf import kimi_linear  # noqa: E402

for _module in (kimi_linear,):
    register_adapter(_module.ADAPTER)
