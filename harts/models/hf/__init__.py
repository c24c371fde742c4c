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

import re

from harts.config.models import ConfigError
from harts.config.registry import Registry
from harts.models.hf.adapter import CheckpointKeyError, HFAdapter, HFModelType

__all__ = ["CheckpointKeyError", "HFAdapter", "HFModelType", "config_field", "get_adapter", "register_adapter",
           "supported_model_types"]


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


# the adapters' refusals name the config.json field first: "config.json: field 'hidden_act' is ...",
# "config.json: fields 'num_experts' and 'n_routed_experts' disagree ..." (kimi_linear), or
# "hidden_act: 'gelu' is not supported" (qwen3_next and the Qwen3.5 adapters built on it)
_QUOTED_FIELD = re.compile(r"^config\.json: fields? '([^']+)'")
_LEADING_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*): ")


def config_field(err: ConfigError) -> str | None:
    """The config.json field an adapter's ConfigError refuses (dotted for a nested one:
    'linear_attn_config.kda_layers'); None where the message names none, e.g. a value the
    adapter mapped that HARTS's own ModelConfig then refused ("config.json: dense_ffn_dim:
    ...", "qwen3_next config: ..."): those name a ModelConfig field, not the file's."""
    message = str(err)
    quoted = _QUOTED_FIELD.match(message)
    if quoted:
        return quoted.group(1)
    if message.startswith("config.json: "):
        return None
    leading = _LEADING_FIELD.match(message)
    return leading.group(1) if leading else None


# registration: one module per model type, each exposing ADAPTER
from harts.models.hf import kimi_linear, qwen3_5, qwen3_5_moe, qwen3_next  # noqa: E402

for _module in (kimi_linear, qwen3_next, qwen3_5, qwen3_5_moe):
    register_adapter(_module.ADAPTER)
