"""The `harts` training engine for verl: `EngineRegistry` backend "harts" (language models).

verl 0.9 builds its actor from `verl.workers.engine.base.EngineRegistry`; this module
registers `HartsEngine` there as `backend="harts"`, so a config that names the backend
(`actor_rollout_ref.actor.strategy` / the engine's backend) trains through HARTS. The engine
holds the checkpoint as HARTS's `HybridModel` (`harts.models.load`: Kimi-Linear, Qwen3-Next,
Qwen3.5), its AdamW and a learning-rate schedule, and implements `BaseEngine`:

- `forward_backward_batch(data, loss_function, forward_only)` takes verl's no-padding batch
  (`input_ids` and `position_ids` as jagged nested tensors, `loss_mask`/`response_mask`,
  `old_log_probs`, `advantages`, optional `ref_log_prob`, `prompts`/`responses`, and
  `uid` where the batch carries it), rebuilds each group's rollout tree (one tree per
  `uid`, else per distinct prompt), runs HARTS's tree forward once over the whole batch
  (`harts.integrations.hf.TreeForward`, microbatched by `microbatch_tokens`) and hands
  `loss_function` (verl's own `ppo_loss`) the per-token log-probs and entropy in verl's
  layout: a jagged tensor per sequence whose entry p is the log-prob of token p + 1 (the
  last entry 0), as the FSDP engine returns them. verl's loss, advantages and metrics run
  unchanged on them; the one backward goes through the tree. Because verl normalises the
  loss by the global batch (`batch_num_tokens`, `global_batch_size`), one loss over the
  whole batch equals the sum of its micro-batches' losses.
- `optimizer_zero_grad` / `optimizer_step` (gradient clipping by `clip_grad`, returns the
  norm) / `lr_scheduler_step` (constant, or linear warm-up over `lr_warmup_steps`).
- `get_per_tensor_param()` yields the checkpoint's own tensor names and shapes
  (`adapter.to_hf`), which is what verl's weight sync sends to the rollout engine.
- `save_checkpoint` / `load_checkpoint`: model, optimizer and scheduler state in one file
  (`harts_engine.pt`, read back with `weights_only=True`), bit for bit, plus the weights as a
  Hugging Face directory (`huggingface/`) for export.

One process: data-parallel size 1, rank 0, group None. Multi-GPU HARTS training is
`harts.distributed`; joining it to verl's worker groups is not done here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, EngineRegistry

from harts.config.kernels import KernelConfig
from harts.integrations.hf import TreeForward
from harts.models import LoadedModel, load, save

__all__ = ["HartsEngine"]

STATE_FILE = "harts_engine.pt"


def _get(config: Any, name: str, default: Any) -> Any:
    value = getattr(config, name, None) if config is not None else None
    return default if value is None else value


@EngineRegistry.register(model_type="language_model", backend="harts", device=["cuda", "cpu"])
class HartsEngine(BaseEngine):
    """verl's engine interface over a HARTS HybridModel (module docstring). `model_config`:
    verl's `HFModelConfig` or anything with `local_path` / `path` (a checkpoint directory);
    `optimizer_config`: verl's optimizer config (`lr`, `betas`, `weight_decay`, `clip_grad`,
    `lr_warmup_steps`); `engine_config`: optional `harts_microbatch_tokens`, `dtype`,
    `device`. `dtype` is the parameters' dtype (default: the checkpoint's): HARTS computes
    in it, with no float32 master copy, so verl's `dtype: bfloat16` trains bf16 weights."""

    def __init__(self, model_config: Any, engine_config: Any = None, optimizer_config: Any = None,
                 checkpoint_config: Any = None, *, kernels: KernelConfig | None = None):
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.kernels = kernels
        self.mode: str | None = None
        self.loaded: LoadedModel | None = None

    # --- set-up ---

    def initialize(self) -> None:
        path = _get(self.model_config, "local_path", None) or _get(self.model_config, "path", None)
        if path is None:
            raise ValueError("HartsEngine: model_config needs local_path or path (a checkpoint directory)")
        dtype = _get(self.engine_config, "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        device = _get(self.engine_config, "device", "cuda" if torch.cuda.is_available() else "cpu")
        self.loaded = load(path, dtype=dtype, device=device)
        self.module = self.loaded.model
        if self.loaded.config.aux_loss_coef:
            raise NotImplementedError("HartsEngine: the MoE aux loss (output_router_logits) is not supported; "
                                      "verl's ppo_loss adds none")
        self.forward = TreeForward(self.module, kernels=self.kernels,
                                   microbatch_tokens=int(_get(self.engine_config, "harts_microbatch_tokens", 1 << 16)))
        opt = self.optimizer_config
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": float(_get(opt, "weight_decay", 0.01))},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=float(_get(opt, "lr", 1e-6)), betas=tuple(_get(opt, "betas", (0.9, 0.999))),
            eps=float(_get(opt, "eps", 1e-8)))
        warmup = int(_get(opt, "lr_warmup_steps", -1))
        warmup = warmup if warmup > 0 else 0
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.clip_grad = _get(opt, "clip_grad", 1.0)

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    @contextmanager
    def _in_mode(self, mode: str):
        self.mode = mode
        self.module.train(mode == "train")
        try:
            yield
        finally:
            self.mode = None

    def train_mode(self, **kwargs: Any):
        return self._in_mode("train")

    def eval_mode(self, **kwargs: Any):
        return self._in_mode("eval")

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_size(self) -> int:
        return 1

    def get_data_parallel_group(self) -> None:
        return None

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    # --- the step ---

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None, forward_only: bool = False
                               ) -> dict[str, Any]:
        input_ids = data["input_ids"]
        if not input_ids.is_nested:
            raise ValueError("HartsEngine takes verl's no-padding batch (input_ids as a jagged nested tensor)")
        offsets = input_ids.offsets().cpu()
        flat = input_ids.values().cpu().numpy()
        sequences = [flat[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        groups = self._groups(data, sequences)
        tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].values().sum().item())
                             if data["loss_mask"].is_nested else int(data["loss_mask"].sum().item()))
        tu.assign_non_tensor(data, dp_size=1)
        temperature = _temperature(data)
        entropy_wanted = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        with torch.set_grad_enabled(not forward_only):
            result = self.forward(sequences, groups, temperature=temperature, entropy_grad=entropy_wanted)
            device = result.logprob_N.device
            # verl's layout: entry p of a sequence is the log-prob of token p + 1
            at = offsets.to(device)[result.traj_N] + result.position_N - 1
            total = int(offsets[-1])
            log_probs = result.logprob_N.new_zeros(total).index_put((at,), result.logprob_N)
            cu = offsets.to(device)
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, cu)}
            if entropy_wanted:
                entropy = result.entropy_N.new_zeros(total).index_put((at,), result.entropy_N)
                model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, cu)
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=data, dp_group=None)
            else:
                if not forward_only:
                    raise ValueError("a training pass needs a loss_function")
                loss, metrics = log_probs.new_ones(()), {}
            if not forward_only:
                loss.backward()
        detached = {k: v.detach() for k, v in model_output.items()}
        metrics = dict(metrics)
        metrics["harts/compression"] = result.tokens / max(result.executed_rows, 1)
        aggregated: dict[str, list] = {}
        append_to_dict(aggregated, metrics)
        return {"model_output": detached, "loss": [float(loss.detach())], "metrics": aggregated}

    @staticmethod
    def _groups(data: TensorDict, sequences: list[np.ndarray]) -> list[str]:
        """Each sequence's tree: its `uid` where the batch carries one, else its prompt."""
        if "uid" in data.keys():
            uid = data["uid"]
            uid = uid.tolist() if hasattr(uid, "tolist") else list(uid)
            return [str(u) for u in uid]
        prompts = data["prompts"]
        if prompts.is_nested:
            lengths = prompts.offsets().diff().tolist()
        else:
            lengths = data["attention_mask"][:, : prompts.shape[1]].sum(dim=1).tolist()
        return [s[: int(n)].tobytes().hex() for s, n in zip(sequences, lengths, strict=True)]

    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, self.clip_grad if self.clip_grad else float("inf"))
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return float(norm)
        self.optimizer.step()
        return float(norm)

    def lr_scheduler_step(self) -> float:
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    # --- weights out, devices, checkpoints ---

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Generator[tuple[str, torch.Tensor], None, None], None]:
        """(name, tensor) under the checkpoint's own names, layouts and dtypes, and no PEFT config."""
        loaded = self.loaded
        state = {k: v.detach() for k, v in self.module.state_dict().items()}

        def tensors():
            hf = loaded.adapter.to_hf(state, loaded.config, loaded.hf_config)
            for name, t in _source_layout(hf, loaded.source_dtypes.keys()):
                yield name, t.to(loaded.source_dtypes.get(name, t.dtype))

        return tensors(), None

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if model:
            self.module.to(device)
        if optimizer:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v) and k != "step":
                        state[k] = v.to(device)

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **kwargs: Any) -> None:
        if hdfs_path is not None:
            raise NotImplementedError("HartsEngine saves to a local path only")
        root = Path(local_path)
        root.mkdir(parents=True, exist_ok=True)
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "lr_scheduler": self.lr_scheduler.state_dict(), "global_step": int(global_step)}
        tmp = root / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, root / STATE_FILE)
        save(self.loaded, root / "huggingface")

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False,
                        **kwargs: Any) -> None:
        device = next(self.module.parameters()).device
        state = torch.load(Path(local_path) / STATE_FILE, map_location=device, weights_only=True)
        self.module.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])


def _source_layout(tensors: dict[str, torch.Tensor], source: Any) -> Generator[tuple[str, torch.Tensor], None, None]:
    """The adapter's tensors under the source checkpoint's names: fused experts
    (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F], as transformers from 5.11
    writes them) split per expert where the checkpoint held them so (`experts.{e}.gate_proj`,
    `.up_proj`, `.down_proj`, as transformers < 5.11 writes them)."""
    source = set(source)
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if name in source or not prefix.endswith("experts") or f"{prefix}.0.down_proj.weight" not in source:
            yield name, t
        elif leaf == "gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", t[e, half:]
        elif leaf == "down_proj":
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            yield name, t


def _temperature(data: TensorDict) -> float:
    """The batch's sampling temperature: verl carries it as non-tensor data or as a tensor
    per sequence (the FSDP engine divides the logits by it)."""
    if "temperature" not in data.keys():
        return 1.0
    value = data["temperature"]
    if not torch.is_tensor(value):
        value = tu.get_non_tensor_data(data=data, key="temperature", default=1.0)
    if torch.is_tensor(value):
        flat = value.reshape(-1)
        if flat.numel() and not bool((flat == flat[0]).all()):
            raise ValueError("HartsEngine: one temperature per batch")
        value = float(flat[0]) if flat.numel() else 1.0
    return float(value)
