"""The Kimi-Linear-shaped hybrid-attention MoE model that HARTS trains.

Shapes: T rows, D model dim, V vocabulary, L MoE layers, E routed experts.

Every token-wise part runs once per row; all sequence mixing goes through the
`MixingContext` handed to `forward`, so the same weights and the same code compute
packed trajectories (the expanded baseline) and compact rollout trees. `forward` stops at
the final norm: log-probs are taken by `harts.exec.loss`, which applies the LM head only
to the rows that serve targets.

Blocks are pre-norm: x += mixer(norm(x)); x += ffn(norm(x)). With `recompute=True` each
block runs under `torch.utils.checkpoint`: activations are recomputed in backward and
gradients are bit-identical (tested in float64 and float32). Which checkpoint
(`checkpoint_kind`): the reentrant one where it can, because its forward records no
autograd graph and calls no hook per saved tensor (the non-reentrant one calls three
Python hooks per saved tensor, in forward, recompute and backward: about a sixth of the
host's time in a step of small microbatches,
benchmarks/results/windows/2026-12-05-f9de154-window-host-h200.json); the non-reentrant
one where the forward's own graph is needed (a sharing-window producer records the inputs
its consumers read, and backpropagates their gradients through it later) and under
torch.distributed (FSDP2 and the pipeline schedule drive hooks of their own in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from harts.config.models import FFNKind, LayerKind, ModelConfig, get_model_config
from harts.exec.model.context import MixingContext
from harts.exec.model.gated_attention import GatedAttentionMixer
from harts.exec.model.gdn import GDNMixer
from harts.exec.model.kda import KDAMixer
from harts.exec.model.layers import OffsetRMSNorm, RMSNorm, SwiGLU
from harts.exec.model.mla import MLAMixer
from harts.exec.model.moe import MoE

# the mixer module of each layer kind
_MIXERS: dict[LayerKind, type[nn.Module]] = {
    LayerKind.KDA: KDAMixer,
    LayerKind.MLA: MLAMixer,
    LayerKind.GDN: GDNMixer,
    LayerKind.GATED_ATTENTION: GatedAttentionMixer,
}


@dataclass(frozen=True)
class ModelOutput:
    hidden_TD: Tensor  # after the final norm
    aux_loss: Tensor  # scalar: MoE load-balancing loss summed over MoE layers (coef included)
    expert_load: Tensor  # [L, E] row_weight-weighted routing counts per MoE layer


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.mixer_kind = config.layer_kinds[layer]
        self.ffn_kind = config.ffn_kinds[layer]
        norm = OffsetRMSNorm if config.norm_offset else RMSNorm
        self.attn_norm = norm(config.d_model, config.norm_eps, config.norm_float32)
        self.mixer = _MIXERS[self.mixer_kind](config, layer)
        self.ffn_norm = norm(config.d_model, config.norm_eps, config.norm_float32)
        if self.ffn_kind == FFNKind.DENSE:
            self.ffn: nn.Module = SwiGLU(config.d_model, config.dense_ffn_dim)
        else:
            self.ffn = MoE(config, moe_index=config.ffn_kinds[:layer].count(FFNKind.MOE))

    def forward(self, x_TD: Tensor, ctx: MixingContext) -> tuple[Tensor, Tensor | None, Tensor | None]:
        x_TD = x_TD + self.mixer(self.attn_norm(x_TD, ctx), ctx)
        h_TD = self.ffn_norm(x_TD, ctx)
        if self.ffn_kind == FFNKind.DENSE:
            return x_TD + self.ffn(h_TD, ctx), None, None
        y_TD, aux, load_E = self.ffn(h_TD, ctx)
        return x_TD + y_TD, aux, load_E


def checkpoint_kind(ctx: MixingContext, x_TD: Tensor) -> str:
    """"reentrant" or "hooks" (non-reentrant): the checkpoint `run_blocks` uses for a
    microbatch (module docstring). Reentrant needs an input that requires grad, a context
    that records nothing inside the blocks (no window producer's stash) and a single
    process."""
    if not x_TD.requires_grad or getattr(ctx, "record", None) is not None:
        return "hooks"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "hooks"
    return "reentrant"


def run_blocks(blocks, x_TD: Tensor, ctx: MixingContext, aux: Tensor, recompute: bool
               ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The blocks in order over the residual stream `x_TD`, each under activation
    checkpointing when `recompute`, the context's own `recompute` (default True: a window
    producer whose saved tensors wait in host memory may store them rather than recompute)
    and gradients are on (`checkpoint_kind`); the MoE blocks' aux losses added to `aux` and
    their expert loads listed (the whole model's forward and a pipeline stage's)."""
    loads = []
    recompute = recompute and getattr(ctx, "recompute", True)
    kind = checkpoint_kind(ctx, x_TD) if recompute and torch.is_grad_enabled() else None
    for block in blocks:
        if kind == "reentrant":
            # the model draws no random numbers: no RNG state to save and restore
            x_TD, layer_aux, load_E = checkpoint(block, x_TD, ctx, use_reentrant=True, preserve_rng_state=False)
        elif kind == "hooks":
            # no metadata check of the recomputed tensors: the recompute runs the same ops on
            # the same shapes by construction, and the check's per-saved-tensor bookkeeping
            # is host time
            x_TD, layer_aux, load_E = checkpoint(block, x_TD, ctx, use_reentrant=False, determinism_check="none",
                                                 preserve_rng_state=False)
        else:
            x_TD, layer_aux, load_E = block(x_TD, ctx)
        if layer_aux is not None:
            aux = aux + layer_aux
            loads.append(load_E)
    return x_TD, aux, loads


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, *, recompute: bool = False):
        super().__init__()
        self.config = config.validate()
        self.recompute = recompute
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = (OffsetRMSNorm if config.norm_offset else RMSNorm)(config.d_model, config.norm_eps,
                                                                      config.norm_float32)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    @property
    def lm_head_weight(self) -> Tensor:
        """[V, D]: the LM head (the embedding table when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.init_std
        # residual-branch outputs scaled down with depth (GPT-2 style)
        out_std = std / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                p.fill_(1.0)
            elif leaf == "bias":
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")) or leaf == "w_down":
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)
        for module in self.modules():
            if isinstance(module, (KDAMixer, GDNMixer)):
                module.reset_special_parameters()
            elif isinstance(module, OffsetRMSNorm):
                module.weight.zero_()  # zero-centred: scales by 1 + w

    def forward(self, input_ids_T: Tensor, ctx: MixingContext) -> ModelOutput:
        if input_ids_T.dim() != 1 or input_ids_T.shape[0] != ctx.num_rows:
            raise ValueError(f"input_ids must be [T={ctx.num_rows}]; got {tuple(input_ids_T.shape)}")
        x_TD = self.embed(input_ids_T)
        x_TD, aux, loads = run_blocks(self.layers, x_TD, ctx, x_TD.new_zeros(()), self.recompute)
        if loads:
            expert_load = torch.stack(loads)
        else:
            expert_load = x_TD.new_zeros(0, self.config.num_experts)
        return ModelOutput(self.norm(x_TD, ctx), aux, expert_load)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_state_dict_file(self, path: str | Path) -> None:
        from harts.exec.model.weights import save_state_dict_file

        save_state_dict_file(self, path)

    def load_state_dict_file(self, path: str | Path) -> None:
        from harts.exec.model.weights import load_state_dict_file

        load_state_dict_file(self, path)


def build_model(
    config: ModelConfig | str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    recompute: bool = False,
) -> HybridModel:
    """A freshly initialised model; the same seed gives the same weights, and the global
    RNG state is left untouched."""
    if isinstance(config, str):
        config = get_model_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HybridModel(config, recompute=recompute)
    return model.to(device=device, dtype=dtype)
