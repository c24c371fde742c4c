"""Real models: Hugging Face checkpoint directories in and out of HARTS's execution.

`load(path)` reads a transformers checkpoint (config.json + safetensors), maps it through
the adapter of its `model_type` (`harts.models.hf`) and returns a `LoadedModel`: the
`HybridModel` with the checkpoint's weights, its `ModelConfig`, the source config dict
and the adapter. `save(loaded, out_dir)` writes the model's current weights back as a
checkpoint transformers' `from_pretrained` loads: the same config.json, the tensor names
and each tensor's dtype as they were read.

Errors are `CheckpointError` (the directory: missing or unreadable files, missing,
unexpected or mis-shaped tensors; one line naming the file and tensor) and `ConfigError`
(a config value HARTS cannot compute; names the field).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from harts.config.models import ConfigError, ModelConfig
from harts.exec.model.model import HybridModel
from harts.models.hf import CheckpointKeyError, HFAdapter, get_adapter
from harts.models.hf.io import (
    DEFAULT_SHARD_BYTES,
    CheckpointError,
    read_checkpoint,
    read_config,
    write_checkpoint,
)

__all__ = ["CheckpointError", "ConfigError", "LoadedModel", "load", "load_config", "save"]


@dataclass(frozen=True)
class LoadedModel:
    model: HybridModel
    config: ModelConfig
    hf_config: dict
    adapter: HFAdapter
    # each checkpoint tensor's dtype as read, restored on save
    source_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    source_dir: Path | None = None


def load_config(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict, HFAdapter]:
    """The ModelConfig of a checkpoint directory from its config.json alone (no weights
    read: what planners and the simulator need)."""
    hf = read_config(path)
    adapter = get_adapter(hf.get("model_type"))
    config = adapter.to_config(hf)
    return config.replace(name=_name(path)), hf, adapter


def _name(path: str | os.PathLike[str]) -> str:
    return Path(path).resolve().name or "checkpoint"


def _main_dtype(tensors: dict[str, Tensor]) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    if not counts:
        raise CheckpointError("the checkpoint holds no floating-point tensors")
    return max(counts, key=counts.get)


def load(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
         allow_pickle: bool = False) -> LoadedModel:
    """The checkpoint at `path` as a HybridModel in `dtype` (default: the checkpoint's
    main floating-point dtype) on `device`."""
    config, hf, adapter = load_config(path)
    ckpt = read_checkpoint(path, allow_pickle=allow_pickle)
    try:
        state = adapter.to_harts(ckpt.tensors, config)
    except CheckpointKeyError as err:
        # a missing tensor is in no file: name the one that lists the weights
        where = ckpt.path / ckpt.files.get(err.tensor or "", ckpt.weights)
        raise CheckpointError(f"{where}: {err}", path=where) from None
    dtype = dtype if dtype is not None else _main_dtype(ckpt.tensors)
    with torch.device("meta"):
        model = HybridModel(config)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing or set(state) - set(own):
        raise CheckpointError(f"{ckpt.path}: the {adapter.model_type} adapter gave no tensor for {missing[:3]} "
                              f"or extra ones {sorted(set(state) - set(own))[:3]}", path=ckpt.path)
    for name, t in state.items():
        if not torch.isfinite(t).all():
            where = ckpt.path / ckpt.files.get(name, "")
            raise CheckpointError(f"{where}: non-finite values in tensor for {name!r}", path=where)
    # no extra copy where the dtype and device already fit (a 48B checkpoint is ~100 GB)
    state = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return LoadedModel(model, config, hf, adapter, {k: t.dtype for k, t in ckpt.tensors.items()}, ckpt.path)


def save(loaded_or_model: LoadedModel | HybridModel, out_dir: str | os.PathLike[str], *,
         source: LoadedModel | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the model's current weights as a checkpoint directory at `out_dir`, with the
    source checkpoint's config.json, tensor names and dtypes (and its other files, such
    as the tokenizer, copied along). A bare HybridModel needs `source`, the LoadedModel
    it was loaded as (or one of the same config)."""
    if isinstance(loaded_or_model, LoadedModel):
        loaded, model = loaded_or_model, loaded_or_model.model
    else:
        if source is None:
            raise TypeError("save(model, ...) of a bare HybridModel needs source=LoadedModel (its config.json)")
        loaded, model = source, loaded_or_model
    if replace(model.config, name=loaded.config.name, aux_scope=loaded.config.aux_scope) != loaded.config:
        raise ConfigError("save: the model's config differs from the checkpoint's it would be saved as")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = loaded.adapter.to_hf(state, loaded.config, loaded.hf_config)
    tensors = {k: v.to(device="cpu", dtype=loaded.source_dtypes.get(k, v.dtype)) for k, v in tensors.items()}
    return write_checkpoint(out_dir, loaded.hf_config, tensors, shard_bytes=shard_bytes, copy_from=loaded.source_dir)
