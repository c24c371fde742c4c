"""Adapters between Hugging Face transformers checkpoints and HARTS's `HybridModel`.

An `HFAdapter` maps one `model_type`: its `config.json` dict to a `ModelConfig` (refusing,
with the field named, anything HARTS cannot compute exactly), the checkpoint's state dict
to the `HybridModel`'s and back under the original key names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from harts.config.models import ModelConfig


@dataclass(frozen=True)
class HFAdapter:
    model_type: str
    to_config: Callable[[dict], ModelConfig]
    to_harts: Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]
    to_hf: Callable[[dict[str, Tensor], ModelConfig, dict], dict[str, Tensor]]
