"""The framework-facing API: sequences in, per-token log-probs and entropy out, an update step.

Legend: B sequences, T padded length, L one sequence's length.

A `SequenceBatch` carries what verl's and TRL's actor batches carry, one sequence per row:
token ids, the response (loss) mask, per-token advantages, the rollout's per-token
log-probs, optional reference log-probs, and a group id per sequence (verl's `uid`, TRL's
prompt of the group). Arrays are per sequence and aligned with its tokens (entry p belongs
to token p, predicted from the logits at p - 1), so padding never enters: `from_padded`
strips a `[B, T]` layout by its attention mask (left or right padding), and
`from_prompt_completion` joins TRL's prompt and completion tensors. docs/RL.md maps the
fields onto verl's `DataProto` and TRL's GRPO batch.

`RLPolicy` wraps a HARTS model and one trainer: `mode="tree"` trains each group as one
rollout tree (sequences of a group share their common prefixes), `mode="expanded"` packs
sequences independently (the baseline); both compute the same numbers. `compute_log_prob`
is a forward pass; `update` is one optimizer step (forward, PPO/GRPO loss, backward, clip,
AdamW) whose log-probs and entropy are those of the forward before the step. Outputs are in
the batch's sequence order whatever the layout packs together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.tree.trajectory import Trajectory


class BatchError(ValueError):
    """A batch that breaks the contract; the message names the sequence and the field."""


@dataclass(frozen=True)
class SequenceBatch:
    input_ids: tuple[np.ndarray, ...]  # per sequence int64 [L]
    response_mask: tuple[np.ndarray, ...]  # per sequence bool [L]: tokens the loss trains on
    advantages: tuple[np.ndarray, ...]  # per sequence float64 [L]
    old_log_probs: tuple[np.ndarray, ...]  # per sequence float64 [L] (read where the mask is set)
    group_ids: tuple[str, ...]  # per sequence: the prompt group (tree mode: one tree per group)
    ref_log_probs: tuple[np.ndarray, ...] | None = None
    ids: tuple[str, ...] | None = None  # per sequence; default "0", "1", ...
    turns: tuple[Any, ...] | None = None  # per sequence: step structure (see harts.tree.trajectory)

    @classmethod
    def make(cls, input_ids: Sequence[Any], response_mask: Sequence[Any], advantages: Sequence[Any],
             old_log_probs: Sequence[Any] | None, group_ids: Sequence[Any], *,
             ref_log_probs: Sequence[Any] | None = None, ids: Sequence[str] | None = None,
             turns: Sequence[Any] | None = None) -> SequenceBatch:
        """Validated batch from per-sequence lists. An advantage may be a scalar per
        sequence (broadcast, as GRPO's episode advantage); missing old log-probs are zeros."""
        n = len(input_ids)
        if n == 0:
            raise BatchError("a batch needs at least one sequence")
        for name, value in (("response_mask", response_mask), ("advantages", advantages),
                            ("group_ids", group_ids), ("old_log_probs", old_log_probs),
                            ("ref_log_probs", ref_log_probs), ("ids", ids), ("turns", turns)):
            if value is not None and len(value) != n:
                raise BatchError(f"{name}: {len(value)} entries for {n} sequences")
        toks, masks, advs, olds, refs = [], [], [], [], []
        for i in range(n):
            t = np.asarray(input_ids[i])
            if t.ndim != 1 or t.size == 0 or not np.issubdtype(t.dtype, np.integer):
                raise BatchError(f"sequence {i}: input_ids must be a non-empty flat list of integers")
            L = t.size
            m = np.asarray(response_mask[i]).astype(bool)
            if m.shape != (L,):
                raise BatchError(f"sequence {i}: response_mask has {m.size} entries for {L} tokens")
            if m[0]:
                raise BatchError(f"sequence {i}: response_mask[0] is set, but no logits predict token 0")
            a = np.asarray(advantages[i], dtype=np.float64)
            a = np.full(L, float(a)) if a.ndim == 0 else a
            if a.shape != (L,):
                raise BatchError(f"sequence {i}: advantages has {a.size} entries for {L} tokens")
            o = np.zeros(L) if old_log_probs is None else np.asarray(old_log_probs[i], dtype=np.float64)
            if o.shape != (L,):
                raise BatchError(f"sequence {i}: old_log_probs has {o.size} entries for {L} tokens")
            toks.append(t.astype(np.int64))
            masks.append(m)
            advs.append(a)
            olds.append(np.where(m, o, 0.0))
            if ref_log_probs is not None:
                r = np.asarray(ref_log_probs[i], dtype=np.float64)
                if r.shape != (L,):
                    raise BatchError(f"sequence {i}: ref_log_probs has {r.size} entries for {L} tokens")
                refs.append(np.where(m, r, 0.0))
        return cls(tuple(toks), tuple(masks), tuple(advs), tuple(olds), tuple(str(g) for g in group_ids),
                   tuple(refs) if ref_log_probs is not None else None,
                   tuple(ids) if ids is not None else None, tuple(turns) if turns is not None else None)

    @classmethod
    def from_padded(cls, input_ids: Any, attention_mask: Any, response_mask: Any, advantages: Any,
                    old_log_probs: Any, group_ids: Sequence[Any], *, ref_log_probs: Any = None) -> SequenceBatch:
        """From `[B, T]` arrays aligned with `input_ids` (verl's full-sequence layout;
        padding on either side); the attention mask selects each row's real tokens."""
        ids_BT = np.asarray(input_ids)
        keep_BT = np.asarray(attention_mask).astype(bool)
        if ids_BT.ndim != 2 or keep_BT.shape != ids_BT.shape:
            raise BatchError("input_ids and attention_mask must both be [B, T]")

        def rows(x: Any) -> list[np.ndarray] | None:
            if x is None:
                return None
            arr = np.asarray(x)
            if arr.shape != ids_BT.shape:
                raise BatchError(f"a [B, T] field has shape {arr.shape}, input_ids {ids_BT.shape}")
            return [arr[b][keep_BT[b]] for b in range(arr.shape[0])]

        return cls.make(rows(ids_BT), rows(response_mask), rows(advantages), rows(old_log_probs), group_ids,
                        ref_log_probs=rows(ref_log_probs))

    @classmethod
    def from_prompt_completion(cls, prompt_ids: Any, prompt_mask: Any, completion_ids: Any, completion_mask: Any,
                               advantages: Any, old_per_token_logps: Any, group_ids: Sequence[Any], *,
                               ref_per_token_logps: Any = None) -> SequenceBatch:
        """From TRL's GRPO layout: left-padded prompts `[B, P]`, right-padded completions
        `[B, C]` with their masks, advantages `[B]` (per sequence) or `[B, C]`, and the
        completion's per-token log-probs `[B, C]` (None: zeros)."""
        p_ids, p_keep = np.asarray(prompt_ids), np.asarray(prompt_mask).astype(bool)
        c_ids, c_keep = np.asarray(completion_ids), np.asarray(completion_mask).astype(bool)
        adv = np.asarray(advantages, dtype=np.float64)
        B = p_ids.shape[0]
        toks, masks, advs, olds, refs = [], [], [], [], []
        for b in range(B):
            prompt = p_ids[b][p_keep[b]]
            # completion tokens up to the last kept one (TRL masks after EOS)
            c_len = int(np.flatnonzero(c_keep[b])[-1]) + 1 if c_keep[b].any() else 0
            comp = c_ids[b][:c_len]
            toks.append(np.concatenate([prompt, comp]))
            masks.append(np.concatenate([np.zeros(prompt.size, bool), c_keep[b][:c_len]]))
            a = np.full(c_len, adv[b]) if adv.ndim == 1 else adv[b][:c_len]
            advs.append(np.concatenate([np.zeros(prompt.size), a]))
            old = np.zeros(c_len) if old_per_token_logps is None else np.asarray(old_per_token_logps)[b][:c_len]
            olds.append(np.concatenate([np.zeros(prompt.size), old]))
            if ref_per_token_logps is not None:
                refs.append(np.concatenate([np.zeros(prompt.size), np.asarray(ref_per_token_logps)[b][:c_len]]))
        return cls.make(toks, masks, advs, olds, group_ids, ref_log_probs=refs if ref_per_token_logps is not None else None)

    def __len__(self) -> int:
        return len(self.input_ids)

    def trajectories(self) -> list[Trajectory]:
        """The batch as the trainers' trajectories, in batch order."""
        ids = self.ids or tuple(str(i) for i in range(len(self)))
        out = []
        for i in range(len(self)):
            kwargs: dict[str, Any] = {}
            if self.turns is not None:
                kwargs = turns_kwargs(self.turns[i])
            out.append(Trajectory.make(
                ids[i], self.group_ids[i], self.input_ids[i], self.response_mask[i].astype(np.int8),
                self.advantages[i], self.old_log_probs[i],
                None if self.ref_log_probs is None else self.ref_log_probs[i], **kwargs))
        return out


def turns_kwargs(turns: Any) -> dict[str, Any]:
    """`Trajectory.make` keyword arguments carrying a rollout's step structure: the `turns`
    field where the trajectory type has one, else `extra["turns"]` (the same records)."""
    import inspect

    records = [t.to_dict() if hasattr(t, "to_dict") else dict(t) for t in turns]
    if "turns" in inspect.signature(Trajectory.make).parameters:
        return {"turns": records}
    return {"extra": {"turns": records}}


@dataclass(frozen=True)
class TokenStats:
    """Per sequence, aligned with its tokens: log-prob of token p under the model and the
    entropy of the distribution predicting it (NaN at p = 0)."""

    log_probs: tuple[np.ndarray, ...]
    entropy: tuple[np.ndarray, ...]

    def padded(self, width: int | None = None, fill: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """`[B, T]` right-padded arrays (NaN at p = 0 replaced by `fill` too)."""
        width = width or max(x.size for x in self.log_probs)
        lp = np.full((len(self.log_probs), width), fill)
        ent = np.full_like(lp, fill)
        for b, (x, e) in enumerate(zip(self.log_probs, self.entropy, strict=True)):
            lp[b, : x.size] = np.nan_to_num(x, nan=fill)
            ent[b, : e.size] = np.nan_to_num(e, nan=fill)
        return lp, ent


@dataclass(frozen=True)
class UpdateResult:
    stats: TokenStats  # from the forward before the optimizer step
    losses: dict[str, float]  # loss, pg_loss, kl, entropy, aux_loss, clip_frac, ppo_kl
    grad_norm: float
    tokens: int  # expanded tokens
    executed_rows: int  # rows the layout computed (tree mode: fewer than tokens when prefixes are shared)
    seconds: float

    @property
    def compression(self) -> float:
        return self.tokens / self.executed_rows if self.executed_rows else 1.0


class RLPolicy:
    """A HARTS model and its trainer behind the batch API (module docstring)."""

    def __init__(self, model: Any, *, mode: str = "tree", optimizer: Any = None, loss: Any = None,
                 microbatch_tokens: int = 4096, kernels: Any = None):
        from harts.exec.factory import make_trainer

        if mode not in ("tree", "expanded"):
            raise ValueError(f"mode must be 'tree' or 'expanded', got {mode!r}")
        if microbatch_tokens < 1:
            raise ValueError(f"microbatch_tokens must be >= 1, got {microbatch_tokens}")
        self.mode = mode
        self.model = model
        self.microbatch_tokens = microbatch_tokens
        self.trainer = make_trainer(mode, model, optimizer=optimizer, loss=loss, kernels=kernels)

    def compute_log_prob(self, batch: SequenceBatch) -> TokenStats:
        result = self.trainer.evaluate(batch.trajectories(), self.microbatch_tokens)
        return TokenStats(tuple(result.logprobs), tuple(result.entropy))

    def update(self, batch: SequenceBatch) -> UpdateResult:
        result = self.trainer.step(batch.trajectories(), self.microbatch_tokens)
        return UpdateResult(TokenStats(tuple(result.logprobs), tuple(result.entropy)), dict(result.losses),
                            result.grad_norm, result.tokens, result.executed_rows, result.seconds)


__all__ = ["BatchError", "RLPolicy", "SequenceBatch", "TokenStats", "UpdateResult", "turns_kwargs"]
