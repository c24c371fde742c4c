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

Data parallel, as verl runs engines: one engine per rank of an initialised default process
group (verl's worker group; gloo on the CPU, NCCL on CUDA), each rank given its own share of
the batch. With a world of more than one rank `initialize` shards the model over all ranks
with FSDP2 (`harts.distributed.parallelize` at dp = world size: each block a unit, the root
last) and the engine reports that rank, size and group. As verl's FSDP engine does, each
step all-reduces the loss-mask token count over the group into `batch_num_tokens` and sets
`dp_size`, so `ppo_loss` gives each rank dp_size times its share of the global batch's loss,
and FSDP averages the gradients (divide factor dp_size) into the gradient of the global
batch's loss. The units are gathered once before the tree forward, keep their gradients
unreduced through the backward, and reduce-scatter once after it, in one zero-row pass with
FSDP's gradient sync on (`harts.distributed.runner`'s scheme; a parameter this rank's
sequences did not reach, such as an expert no token chose, gets a zero gradient first).
Clipping uses the full gradient's norm. `get_per_tensor_param` and `save_checkpoint` gather
the shards into the full checkpoint tensors (on every rank; rank 0 writes), so a checkpoint
file is the same whatever the data-parallel size; `load_checkpoint` reads the whole file on
every rank (a path every rank sees) and keeps each rank's shard of it. One process (no
process group, or a world of one): size 1, rank 0, group None, no FSDP.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, EngineRegistry

from harts.config.kernels import KernelConfig
from harts.config.parallel import ParallelConfig
from harts.integrations.hf import TreeForward
from harts.models import LoadedModel, load
from harts.models.hf.io import write_checkpoint

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
        self.parallel = None
        self._dp_group = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from harts.distributed.mesh import init_mesh
            from harts.distributed.parallelize import parallelize

            dp = dist.get_world_size()
            self.parallel = parallelize(self.module, init_mesh(ParallelConfig(dp=dp), device))
            self._dp_group = self.parallel.mesh.group("dp")
            # verl's loss is dp_size times this rank's share: FSDP averages, as in verl's FSDP engine
            for unit in self.parallel.fsdp_modules:
                unit.set_gradient_divide_factor(float(dp))
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
        return 0 if self._dp_group is None else dist.get_rank(self._dp_group)

    def get_data_parallel_size(self) -> int:
        return 1 if self._dp_group is None else dist.get_world_size(self._dp_group)

    def get_data_parallel_group(self) -> Any:
        return self._dp_group

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
        # the global batch's loss tokens, as verl's FSDP engine counts them: all-reduced over dp
        loss_mask = data["loss_mask"]
        num_tokens = (loss_mask.values() if loss_mask.is_nested else loss_mask).sum().to(torch.int64)
        if self._dp_group is not None:
            num_tokens = num_tokens.to(self.parallel.mesh.device)
            dist.all_reduce(num_tokens, op=dist.ReduceOp.SUM, group=self._dp_group)
        tu.assign_non_tensor(data, batch_num_tokens=int(num_tokens.item()))
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        temperature = _temperature(data)
        entropy_wanted = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        with self._gathered(backward=not forward_only), torch.set_grad_enabled(not forward_only):
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
                loss, metrics = loss_function(model_output=model_output, data=data, dp_group=self._dp_group)
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

    @contextmanager
    def _gathered(self, backward: bool):
        """Under data parallelism: every FSDP unit gathered for the step with its gradient
        sync off, and after a backward every unit's one reduce-scatter (a zero-row pass with
        the sync on, a parameter without a gradient given a zero one first), then the
        shards released (module docstring). Nothing in one process."""
        pm = self.parallel
        if pm is None:
            yield
            return
        from harts.distributed.runner import NullContext, zero_missing_grads

        pm.unshard()
        try:
            yield
            if backward:
                pm.enable_gradient_sync()
                zero_missing_grads(self.module)
                cfg = self.module.config
                device = pm.mesh.device
                out = self.module(torch.zeros(0, dtype=torch.int64, device=device),
                                  NullContext(device, cfg.num_moe_layers, cfg.num_experts))
                (out.hidden_TD.sum() + out.aux_loss).backward()
        finally:
            pm.reshard()

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
        # torch's clip_grad_norm_ in its two halves, the norm made whole between them (under
        # FSDP the local shards' norms form a DTensor; verl's fsdp2_clip_grad_norm_ likewise)
        norm = _full(torch.nn.utils.get_total_norm([p.grad for p in params]))
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return float(norm)
        torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad if self.clip_grad else float("inf"), norm)
        self.optimizer.step()
        return float(norm)

    def lr_scheduler_step(self) -> float:
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    # --- weights out, devices, checkpoints ---

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Generator[tuple[str, torch.Tensor], None, None], None]:
        """(name, tensor) under the checkpoint's own names, layouts and dtypes, and no PEFT config."""
        loaded = self.loaded
        state = self._full_state()

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
        model = self._full_state()
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {i: {k: _full(v) for k, v in st.items()} for i, st in optimizer["state"].items()}
        if self.get_data_parallel_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            state = {"model": model, "optimizer": optimizer, "lr_scheduler": self.lr_scheduler.state_dict(),
                     "global_step": int(global_step)}
            tmp = root / (STATE_FILE + ".tmp")
            torch.save(state, tmp)
            os.replace(tmp, root / STATE_FILE)
            loaded = self.loaded
            tensors = loaded.adapter.to_hf(model, loaded.config, loaded.hf_config)
            tensors = {k: v.to(device="cpu", dtype=loaded.source_dtypes.get(k, v.dtype)) for k, v in tensors.items()}
            write_checkpoint(root / "huggingface", loaded.hf_config, tensors, copy_from=loaded.source_dir)
        if self._dp_group is not None:
            dist.barrier(group=self._dp_group)  # the files are whole before any rank goes on

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False,
                        **kwargs: Any) -> None:
        device = next(self.module.parameters()).device
        state = torch.load(Path(local_path) / STATE_FILE, map_location=device, weights_only=True)
        own = self.module.state_dict()
        self.module.load_state_dict({k: _shard_like(v, own[k]) for k, v in state["model"].items()}, strict=True)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        optimizer = state["optimizer"]
        optimizer["state"] = {i: {k: _shard_like(v, params[int(i)]) for k, v in st.items()}
                              for i, st in optimizer["state"].items()}
        self.optimizer.load_state_dict(optimizer)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every FSDP shard gathered into its full tensor (a
        collective: every rank calls it)."""
        return {k: _full(v.detach()) for k, v in self.module.state_dict().items()}


def _full(t: Any) -> Any:
    """A DTensor's full tensor (gathered over its mesh); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_like(full: Any, like: Any) -> Any:
    """`full` cut as the DTensor `like` is (this rank's shard, no communication: every rank
    holds the same full tensor); `full` itself where `like` is no DTensor or the shapes differ
    (AdamW's scalar `step`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor) or not torch.is_tensor(full) or full.shape != like.shape:
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


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
