"""TRL's `GRPOTrainer` with the policy's log-probs computed over rollout trees by HARTS.

`HartsGRPOTrainer` is `trl.GRPOTrainer` with one method replaced:
`_get_per_token_logps_and_entropies`, where TRL runs the model over every `[prompt |
completion]` row and reads the completion's per-token log-probs from its fused LM head.
Here the rows become rollout trees, one per distinct prompt (TRL's `num_generations`
completions of a prompt share it), and `harts.integrations.hf.TreeLogProbs` runs the
model's own parameters through HARTS's tree forward: each shared prompt token is computed
once, and the log-probs (temperature applied, zeros where TRL's mask is 0) are TRL's own
to rounding, with gradients into the same parameters. Everything else is TRL's:
generation, rewards, advantages, the loss and its variants, the optimizer and scheduler,
the reference model (its log-probs go through the same method), logging and saving.
The trainer logs `harts/compression` (tokens per executed row) beside TRL's metrics.

What is refused, in one line each, rather than computed differently: models of a family
HARTS does not read (`harts.models.hf`), PEFT adapters, more than one process (the tree
forward bypasses DDP's and FSDP's own forward, which they synchronise gradients through),
multimodal inputs and `cast_lm_head_to_fp32`. The tree forward runs in the parameters'
dtype, outside TRL's autocast (`bf16=True` autocasts TRL's own forward, not this one).

MoE models: where TRL adds its load-balancing loss (a `router_aux_loss_coef` that is not 0,
as Qwen3-Next's config has), the trainer returns the same loss, transformers' Mixtral
`load_balancing_loss_func` over the expanded sequences' router logits, computed from each
compact row's logits weighted by how many sequences hold the row.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer

from harts.config.kernels import KernelConfig
from harts.integrations.hf import TreeLogProbs

__all__ = ["HartsGRPOTrainer"]


class HartsGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer(...)` with the same arguments, plus `harts_kernels` (a `KernelConfig`;
    default from the environment) and `harts_microbatch_tokens` (compact rows per tree
    forward; whole prompt groups)."""

    def __init__(self, *args: Any, harts_kernels: KernelConfig | None = None,
                 harts_microbatch_tokens: int = 1 << 16, **kwargs: Any):
        self._harts_kernels = harts_kernels
        self._harts_microbatch_tokens = harts_microbatch_tokens
        self._harts_views: dict[int, TreeLogProbs] = {}
        super().__init__(*args, **kwargs)
        if self.accelerator.num_processes > 1:
            raise NotImplementedError("HartsGRPOTrainer runs in one process (the tree forward bypasses the "
                                      "data-parallel wrapper's forward)")
        if self.args.cast_lm_head_to_fp32:
            raise NotImplementedError("HartsGRPOTrainer: cast_lm_head_to_fp32 is not supported")

    def harts_view(self, model: Any) -> TreeLogProbs:
        """The tree forward over `model`'s own parameters (built once per model)."""
        from accelerate.utils import is_peft_model

        model = self.accelerator.unwrap_model(model)
        if is_peft_model(model):
            raise NotImplementedError("HartsGRPOTrainer: PEFT adapters are not supported")
        view = self._harts_views.get(id(model))
        if view is None or view.hf_model is not model:
            view = TreeLogProbs(model, kernels=self._harts_kernels, microbatch_tokens=self._harts_microbatch_tokens)
            self._harts_views[id(model)] = view
        return view

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise NotImplementedError(f"HartsGRPOTrainer: multimodal inputs ({', '.join(given)}) are not supported")
        view = self.harts_view(model)
        # HARTS's ops compute in the parameters' dtype; mixed precision (`bf16=True`) would
        # autocast some of them and not others
        device_type = input_ids.device.type
        with torch.autocast(device_type, enabled=False):
            logps, entropy, result = view.completion_logps(input_ids, attention_mask, logits_to_keep,
                                                           temperature=self.temperature,
                                                           router_logits=compute_aux_loss)
        aux = None
        if compute_aux_loss:
            aux = result.load_balancing_loss(view.config.num_experts, view.config.top_k)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["harts/compression"].append(result.tokens / max(result.executed_rows, 1))
        return logps, (entropy if compute_entropy else None), aux
