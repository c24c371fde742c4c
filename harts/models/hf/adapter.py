"""The adapter type every model family module builds (`ADAPTER`), and its key error.

Apart from `harts.models.hf` so that the family modules import it without importing the
registry that imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from torch import Tensor

from harts.config.models import ModelConfig


class HFModelType(StrEnum):
    """The transformers model types HARTS reads and writes (one adapter module each)."""

    KIMI_LINEAR = "kimi_linear"
    QWEN3_NEXT = "qwen3_next"
    QWEN3_5_TEXT = "qwen3_5_text"
    QWEN3_5_MOE_TEXT = "qwen3_5_moe_text"


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
