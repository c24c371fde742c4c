"""A transformers causal LM's own parameters, run as HARTS's HybridModel over rollout trees.

Legend: B sequences, C completion columns, L one sequence's length, R compact rows of a
microbatch, N targets (positions 1..L-1 of every sequence), D model dim, V vocabulary.

RL frameworks own the policy as a transformers model: TRL's trainer holds it, steps its
optimizer and saves it. `TreeLogProbs` leaves it that way. Each call maps the model's
current parameters through the checkpoint adapter of its `model_type`
(`harts.models.hf`: renames, stacks and reshapes, all differentiable) and runs the
HybridModel's forward on them with `torch.func.functional_call` (the HybridModel itself
lives on the meta device and holds no weights). The sequences of a call form one rollout
tree per group (`build_forest`): a prompt shared by a group's completions is computed once,
and the tree layout reproduces every sequence's own numbers (docs/ARCHITECTURE.md). The
per-token log-probs carry gradients back into the transformers parameters, so the
framework's loss, backward and optimizer step run unchanged on them.

Log-probs follow TRL's fused LM head: logits divided by the sampling temperature, the
entropy of that tempered distribution (a statistic, without gradient), zeros where a
position is not scored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from harts.config.kernels import KernelConfig
from harts.config.models import ModelConfig
from harts.exec.loss import target_logprobs
from harts.exec.model.model import HybridModel
from harts.exec.model.moe import MoE
from harts.exec.ops.record import KernelRecord
from harts.exec.transfer import to_device
from harts.exec.tree import TreeContext
from harts.models.hf import HFAdapter, get_adapter
from harts.plan.partition import tree_partition
from harts.tree import Trajectory, build_forest

__all__ = ["CheckpointLayout", "TokenLogProbs", "TreeForward", "TreeLogProbs", "hf_config_dict"]


def hf_config_dict(hf_model: Any) -> dict:
    """The model's config as its `config.json` holds it (`save_pretrained`'s diff dict)."""
    return json.loads(hf_model.config.to_json_string(use_diff=True))


class CheckpointLayout:
    """How a transformers model's checkpoint tensors (the names and layouts its files hold)
    are made of its in-memory parameters and persistent buffers.

    transformers 5 keeps some families in another layout in memory than on disk (Kimi-Linear:
    the q/k/v convolutions concatenated, the experts fused) and converts on load;
    `save_pretrained` reverts that with `revert_weight_conversion`, whose operations run
    without gradients. The layout runs that function once on index tensors (each element's
    position in the model's state dict): every checkpoint tensor is then a gather of
    in-memory elements, which `tensors()` applies to the live tensors, differentiably.
    A conversion that is not a rearrangement of elements is refused."""

    def __init__(self, hf_model: Any):
        live = dict(hf_model.state_dict(keep_vars=True))
        names = list(live)
        sizes = [live[n].numel() for n in names]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        index = {n: torch.arange(int(a), int(a) + k, dtype=torch.int64).view(live[n].shape)
                 for n, a, k in zip(names, starts[:-1], sizes, strict=True)}
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # transformers 4: memory and disk layouts are the same
            reverted = index
        else:
            reverted = dict(revert_weight_conversion(hf_model, index))
        # per checkpoint tensor: (source name, None) for a whole tensor as it is, else
        # (source name, flat indices into it)
        self.plan: dict[str, tuple[str, Tensor | None, tuple[int, ...]]] = {}
        for key, idx in reverted.items():
            if idx.dtype != torch.int64:
                raise ValueError(f"{key}: transformers' conversion changes values, not only their layout")
            flat = idx.reshape(-1)
            if flat.numel() == 0:
                raise ValueError(f"{key}: empty tensor")
            src = int(np.searchsorted(starts, int(flat[0]), side="right")) - 1
            a, b = int(starts[src]), int(starts[src + 1])
            if int(flat.min()) < a or int(flat.max()) >= b:
                raise ValueError(f"{key}: made of several in-memory tensors; not supported")
            local = flat - a
            whole = local.numel() == b - a and torch.equal(local, torch.arange(b - a))
            self.plan[key] = (names[src], None if whole else local, tuple(idx.shape))

    def tensors(self, hf_model: Any, live: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The checkpoint tensors as functions of `hf_model`'s live tensors (or of `live`,
        tensors under the in-memory names and shapes, e.g. their gradients)."""
        live = dict(hf_model.state_dict(keep_vars=True)) if live is None else live
        out = {}
        for key, (src, local, shape) in self.plan.items():
            t = live[src]
            out[key] = t.reshape(shape) if local is None else t.reshape(-1)[local.to(t.device)].view(shape)
        return out


@dataclass(frozen=True)
class TokenLogProbs:
    """Per target (sequence `traj`, position `position` >= 1): the log-prob of the token at
    `position` and the entropy of the distribution predicting it."""

    logprob_N: Tensor  # differentiable
    entropy_N: Tensor  # differentiable with entropy_grad, else no gradient
    traj_N: Tensor  # int64, index into the call's sequences
    position_N: Tensor  # int64
    aux_loss: Tensor  # scalar: the HybridModel's MoE aux loss summed over microbatches
    executed_rows: int  # compact rows run (the sequences' tokens when nothing is shared)
    tokens: int  # the sequences' tokens
    # with router_logits=True: per microbatch, (each MoE layer's router logits [R, E], each
    # row's occurrence count [R]); else empty
    router_logits: tuple[tuple[tuple[Tensor, ...], Tensor], ...] = ()

    def load_balancing_loss(self, num_experts: int, top_k: int) -> Tensor:
        """transformers' Mixtral load-balancing loss (`load_balancing_loss_func`, which TRL
        adds for MoE models) over the expanded sequences: every layer's rows concatenated,
        each compact row weighted by how many sequences hold it, as the attention mask
        weighs each real token once there. Needs `router_logits=True`."""
        if not self.router_logits:
            raise ValueError("no router logits recorded (router_logits=True) or the model has no MoE layer")
        tokens_E = probs_E = None
        total = 0.0
        for layers, weight_R in self.router_logits:
            for logits_RE in layers:
                w_R = weight_R.to(logits_RE.dtype)
                probs_RE = torch.softmax(logits_RE, dim=-1)
                chosen_Rk = torch.topk(probs_RE, top_k, dim=-1).indices
                counts_E = torch.zeros(num_experts, dtype=logits_RE.dtype, device=logits_RE.device).scatter_add_(
                    0, chosen_Rk.reshape(-1), w_R.repeat_interleave(top_k))
                mass_E = (probs_RE * w_R[:, None]).sum(0)
                tokens_E = counts_E if tokens_E is None else tokens_E + counts_E
                probs_E = mass_E if probs_E is None else probs_E + mass_E
                total += float(weight_R.sum())
        return (tokens_E / total * (probs_E / total)).sum() * num_experts


class TreeForward:
    """Per-token log-probs of sequences under a HybridModel, computed as rollout trees, with
    gradients. `kernels`: the ops' kernels (default `KernelConfig.from_env()`);
    `microbatch_tokens`: compact rows per forward (whole groups; a larger group runs alone)."""

    def __init__(self, model: HybridModel, *, kernels: KernelConfig | None = None,
                 microbatch_tokens: int = 1 << 16, kda_mode: str = "replay"):
        model.config.check_tree_mode()
        if microbatch_tokens < 1:
            raise ValueError(f"microbatch_tokens must be >= 1, got {microbatch_tokens}")
        self.model = model
        self.config: ModelConfig = model.config
        self.kernels = kernels if kernels is not None else KernelConfig.from_env()
        self.kernel_record = KernelRecord()
        self.microbatch_tokens = microbatch_tokens
        self.kda_mode = kda_mode

    def __call__(self, sequences: Sequence[np.ndarray], groups: Sequence[str], *, temperature: float = 1.0,
                 state: dict[str, Tensor] | None = None, router_logits: bool = False,
                 entropy_grad: bool = False) -> TokenLogProbs:
        """Log-probs and entropy of positions 1..L-1 of every sequence; sequences of one
        group share their common prefixes' rows. `state`: tensors to run the model on
        (`functional_call`; default: the model's own parameters). `router_logits`: also
        record every MoE layer's router logits (differentiable) with the rows' counts.
        `entropy_grad`: the entropy carries a gradient too (an entropy bonus)."""
        if len(sequences) != len(groups) or not sequences:
            raise ValueError(f"{len(sequences)} sequences and {len(groups)} groups: need as many, at least one")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0; got {temperature}")
        if state is None:
            lm_head_VD = self.model.lm_head_weight
        else:
            lm_head_VD = state.get("lm_head.weight", state["embed.weight"])
        device = lm_head_VD.device
        work = torch.promote_types(lm_head_VD.dtype, torch.float32)
        vocab = self.config.vocab_size
        trajs = []
        for i, (seq, group) in enumerate(zip(sequences, groups, strict=True)):
            seq = np.asarray(seq, dtype=np.int64)
            if seq.ndim != 1 or seq.size < 2:
                raise ValueError(f"sequence {i}: needs at least 2 tokens, got shape {seq.shape}")
            if int(seq.min()) < 0 or int(seq.max()) >= vocab:
                raise ValueError(f"sequence {i}: token ids must be in [0, {vocab})")
            trajs.append(Trajectory.make(str(i), str(group), seq))
        routed: list[tuple[tuple[Tensor, ...], Tensor]] = []
        layer_logits: list[Tensor] = []
        hooks = []
        if router_logits:
            def record(module: MoE, args: tuple) -> None:
                layer_logits.append(F.linear(args[0], module.router.weight))

            hooks = [m.register_forward_pre_hook(record) for m in self.model.modules() if isinstance(m, MoE)]
        try:
            parts, aux, rows = self._microbatches(trajs, state, lm_head_VD, work, temperature, layer_logits, routed,
                                                  entropy_grad)
        finally:
            for h in hooks:
                h.remove()
        cat = [torch.cat([p[k] for p in parts]) for k in range(4)]
        return TokenLogProbs(cat[0], cat[1], cat[2].to(device), cat[3].to(device), aux, rows,
                             sum(len(t) for t in trajs), tuple(routed))

    def _microbatches(self, trajs: list[Trajectory], state: dict[str, Tensor] | None, lm_head_VD: Tensor,
                      work: torch.dtype, temperature: float, layer_logits: list[Tensor],
                      routed: list, entropy_grad: bool) -> tuple[list[tuple[Tensor, ...]], Tensor, int]:
        device = lm_head_VD.device
        parts: list[tuple[Tensor, ...]] = []
        aux = lm_head_VD.new_zeros(())
        rows = 0
        for members in tree_partition(trajs, self.microbatch_tokens):
            forest = build_forest([trajs[j] for j in members])
            tg = forest.targets()
            ctx = TreeContext(forest, chunk_size=self.config.chunk_size, kda_mode=self.kda_mode, device=device,
                              kernels=self.kernels, kernel_record=self.kernel_record)
            ids_T = to_device(forest.token_ids, device)
            if state is None:
                out = self.model(ids_T, ctx)
            else:
                out = functional_call(self.model, state, (ids_T, ctx), strict=True)
            # the LM head in float32 at least, as TRL's fused head and verl's log-prob both are
            hidden_TD = out.hidden_TD.to(work)
            hidden_TD = hidden_TD if temperature == 1.0 else hidden_TD / temperature
            logprob_N, entropy_N = target_logprobs(hidden_TD, lm_head_VD.to(work), to_device(tg.row, device),
                                                   to_device(tg.label, device), entropy_grad=entropy_grad)
            traj_N = torch.from_numpy(np.asarray(members, dtype=np.int64)[tg.traj])
            parts.append((logprob_N, entropy_N, traj_N, torch.from_numpy(tg.position)))
            aux = aux + out.aux_loss
            rows += int(forest.token_ids.size)
            if layer_logits:
                routed.append((tuple(layer_logits), ctx.row_weight))
                layer_logits.clear()
        return parts, aux, rows


class TreeLogProbs:
    """Differentiable per-token log-probs of a transformers model's sequences, computed as
    rollout trees over its own parameters (module docstring); `TreeForward`'s options."""

    def __init__(self, hf_model: Any, *, kernels: KernelConfig | None = None, microbatch_tokens: int = 1 << 16,
                 kda_mode: str = "replay"):
        hf = hf_config_dict(hf_model)
        self.hf_model = hf_model
        self.layout = CheckpointLayout(hf_model)
        self.adapter: HFAdapter = get_adapter(hf.get("model_type"))
        self.config: ModelConfig = self.adapter.to_config(hf).replace(name=str(hf.get("model_type")))
        with torch.device("meta"):
            model = HybridModel(self.config)
        self.forward = TreeForward(model, kernels=kernels, microbatch_tokens=microbatch_tokens, kda_mode=kda_mode)

    def state(self) -> dict[str, Tensor]:
        """The HybridModel's state dict as functions of the transformers parameters."""
        return self.adapter.to_harts(self.layout.tensors(self.hf_model), self.config)

    def __call__(self, sequences: Sequence[np.ndarray], groups: Sequence[str], *, temperature: float = 1.0,
                 router_logits: bool = False) -> TokenLogProbs:
        """`TreeForward.__call__` on the transformers parameters as they are now."""
        return self.forward(sequences, groups, temperature=temperature, state=self.state(),
                            router_logits=router_logits)

    def completion_logps(self, input_ids_BT: Tensor, attention_mask_BT: Tensor, logits_to_keep: int, *,
                         temperature: float = 1.0, router_logits: bool = False
                         ) -> tuple[Tensor, Tensor, TokenLogProbs]:
        """TRL's layout: `[B, T]` rows of left-padded prompts followed by right-padded
        completions (the last `logits_to_keep` columns), `attention_mask` marking real
        tokens. Returns `[B, C]` log-probs and entropies of the completion columns (zero
        where the mask is 0), as `model(..., labels=..., fused_lm_head=True)` gives them,
        and the flat result. A row's prompt is grouped with every row of the same prompt."""
        ids = input_ids_BT.detach().cpu().numpy()
        keep = attention_mask_BT.detach().cpu().numpy().astype(bool)
        B, T = ids.shape
        C = int(logits_to_keep)
        sequences, groups, columns = [], [], []
        for b in range(B):
            prompt = ids[b, : T - C][keep[b, : T - C]]
            comp_keep = keep[b, T - C:]
            last = int(np.flatnonzero(comp_keep)[-1]) + 1 if comp_keep.any() else 0
            sequences.append(np.concatenate([prompt, ids[b, T - C: T - C + last]]))
            groups.append(prompt.tobytes().hex())
            # the completion column of each position; -1 for the prompt's and masked ones
            col = np.full(prompt.size + last, -1, dtype=np.int64)
            col[prompt.size:] = np.where(comp_keep[:last], np.arange(last), -1)
            columns.append(col)
        short = [b for b, s in enumerate(sequences) if s.size < 2]
        if short:
            raise ValueError(f"row {short[0]}: fewer than 2 real tokens; nothing to score")
        result = self(sequences, groups, temperature=temperature, router_logits=router_logits)
        traj = result.traj_N.cpu().numpy()
        pos = result.position_N.cpu().numpy()
        col_N = np.concatenate(columns)[np.concatenate([[0], np.cumsum([c.size for c in columns])])[traj] + pos]
        sel = np.flatnonzero(col_N >= 0)
        device = result.logprob_N.device
        flat = torch.from_numpy(traj[sel] * C + col_N[sel]).to(device)
        pick = torch.from_numpy(sel).to(device)
        logps = result.logprob_N.new_zeros(B * C).index_put((flat,), result.logprob_N[pick]).view(B, C)
        ent = result.entropy_N.new_zeros(B * C).index_put((flat,), result.entropy_N[pick]).view(B, C)
        return logps, ent, result
