"""The RL objective on per-target log-probs: PPO/GRPO clipped policy loss, k3 KL, entropy.

Shapes: T hidden rows, D model dim, V vocabulary, U distinct rows that serve targets,
N targets, S trajectories (sequences) of the step.

A *target* is one trained-on trajectory position: (row, label, traj, position, weight,
advantage, old log-prob, ref log-prob). `row` is the hidden row whose logits predict
`label` (the row of position p-1 in trajectory layout, a compact row in tree layout, where
one row may serve several targets with different labels). Log-softmax runs ONCE per
distinct row, then each target gathers one scalar, so expanded vocabulary rows never exist.
Past `PolicyLossConfig.lm_head_chunk_elements` logits per microbatch the LM head runs in
row chunks (`target_logprobs(chunk_rows=...)`): logsumexp and entropy per chunk, their
backward recomputing each chunk's logits, so no [rows, vocab] tensor exists at any vocabulary.

Aggregation (verl's `agg_loss` modes) with denominators passed in, computed once over the
whole step (`loss_denominators`):

    token-mean           sum_n w_n l_n / total_tokens
    seq-mean-token-sum   sum_n w_n l_n / num_sequences
    seq-mean-token-mean  sum_n w_n l_n / seq_tokens[traj_n] / num_sequences

Because every denominator is global, the loss of a microbatch is its exact share of the
full-batch loss and accumulating microbatch gradients gives the full-batch gradient. A
sequence without trained tokens counts in num_sequences and contributes 0 (verl would
produce 0/0 there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

# the settings live with the other configs (no torch); imported from here too
from harts.config.loss import (  # noqa: F401
    AGG_MODES,
    DEFAULT_LM_HEAD_CHUNK_ELEMENTS,
    AggMode,
    PolicyLossConfig,
)
from harts.exec.transfer import to_device


def unique_rows(row_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows ascending, each target's index into them) of non-negative row ids:
    `np.unique(row_N, return_inverse=True)` by marking the rows present (linear in the
    targets plus the largest row, no sort: the tables of a step hold every expanded
    position, so this runs on the data side of each step)."""
    row_N = np.asarray(row_N, dtype=np.int64).reshape(-1)
    if row_N.size == 0:
        return row_N.copy(), row_N.copy()
    if row_N.min() < 0:
        raise ValueError("row ids must be >= 0")
    present = np.zeros(int(row_N.max()) + 1, dtype=bool)
    present[row_N] = True
    rank = np.cumsum(present, dtype=np.int64) - 1
    return np.flatnonzero(present).astype(np.int64), rank[row_N]


def unique_pairs(inverse_N: np.ndarray, label_N: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each distinct (row, label) pair's row index, its label, each target's index into
    the pairs) from the targets' row indices (`unique_rows`' inverse) and labels. In a
    tree the trajectories through a row mostly share its next token, so a row serving many
    targets has few distinct labels: its label logit is formed once per pair."""
    inverse_N = np.asarray(inverse_N, dtype=np.int64).reshape(-1)
    label_N = np.asarray(label_N, dtype=np.int64).reshape(-1)
    if inverse_N.size == 0:
        return inverse_N.copy(), label_N.copy(), inverse_N.copy()
    # one label per row first (one of its targets' labels), in linear time; then the few
    # targets whose label differs from their row's (forks) as pairs of their own, sorted
    U = int(inverse_N.max()) + 1
    row_label = np.zeros(U, dtype=np.int64)
    row_label[inverse_N] = label_N
    present = np.zeros(U, dtype=bool)
    present[inverse_N] = True
    rows = np.flatnonzero(present)  # every row index when they come from `unique_rows`
    rank = np.cumsum(present, dtype=np.int64) - 1
    other = np.flatnonzero(label_N != row_label[inverse_N])
    pair_N = rank[inverse_N]
    width = int(label_N.max()) + 1
    keys, at = np.unique(inverse_N[other] * width + label_N[other], return_inverse=True)
    pair_N[other] = rows.size + at.reshape(-1)
    return (np.concatenate([rows, keys // width]), np.concatenate([row_label[rows], keys % width]), pair_N)


@dataclass(frozen=True)
class TargetTable:
    row: Tensor  # int64 [N] hidden row whose logits predict the label
    label: Tensor  # int64 [N]
    traj: Tensor  # int64 [N] trajectory index within the step (indexes seq_tokens)
    position: Tensor  # int64 [N] position of the label in its trajectory
    weight: Tensor  # float [N] loss mask (1 = trained on)
    advantage: Tensor  # float [N]
    old_logprob: Tensor  # float [N]
    ref_logprob: Tensor | None = None  # float [N]
    # the distinct serving rows (sorted) and each target's index into them, when known
    # (`to` computes them on the host: torch.unique on a GPU reads its size back, a sync)
    unique_rows: Tensor | None = None  # int64 [U]
    row_inverse: Tensor | None = None  # int64 [N]
    # the distinct (row, label) pairs: row index into unique_rows, label, each target's
    # index into them (`unique_pairs`, computed with the rows)
    pair_row: Tensor | None = None  # int64 [P]
    pair_label: Tensor | None = None  # int64 [P]
    pair_inverse: Tensor | None = None  # int64 [N]

    @property
    def num_targets(self) -> int:
        return int(self.row.numel())

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TargetTable:
        def f(x: Tensor | None) -> Tensor | None:
            if x is None:
                return None
            if dtype is not None and x.is_floating_point():
                return to_device(x, device, dtype)
            return to_device(x, device)

        table = self
        if self.unique_rows is None and self.row.device.type == "cpu":
            rows_U, inverse_N = unique_rows(self.row.numpy())
            pair_U, label_P, pair_N = unique_pairs(inverse_N, self.label.numpy())
            table = replace(self, unique_rows=torch.from_numpy(rows_U), row_inverse=torch.from_numpy(inverse_N),
                            pair_row=torch.from_numpy(pair_U), pair_label=torch.from_numpy(label_P),
                            pair_inverse=torch.from_numpy(pair_N))
        return TargetTable(*(f(getattr(table, n)) for n in self.__dataclass_fields__))


@dataclass(frozen=True)
class LossDenominators:
    total_tokens: float  # trained tokens of the whole step
    num_sequences: int  # trajectories of the whole step
    seq_tokens: Tensor  # float64 [S] trained tokens per trajectory


def loss_denominators(trained_tokens_per_traj: Sequence[float] | np.ndarray | Tensor) -> LossDenominators:
    """Step-global denominators from each trajectory's trained-token count (sum of its loss
    mask); the trajectory order defines the `traj` indices of the targets."""
    counts = torch.as_tensor(np.asarray(trained_tokens_per_traj, dtype=np.float64))
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError("need a non-empty 1-D array of per-trajectory trained-token counts")
    if bool((counts < 0).any()):
        raise ValueError("trained-token counts must be >= 0")
    return LossDenominators(float(counts.sum()), int(counts.numel()), counts)


class _ChunkedLogSumExpEntropy(torch.autograd.Function):
    """(logsumexp_U, entropy_U) of the logits h_UD @ W_VD^T, computed and differentiated
    in chunks of `chunk_rows` rows: the forward keeps no logits, the backward recomputes
    each chunk's, so no [U, V] tensor ever exists (peak: one [chunk_rows, V] chunk and its
    softmax). Logits are formed in float32 at least (float64 stays float64).

    Gradients: d lse / dz = p; d H / dz = -p (log p + H); dz flows to h (dz @ W) and to W
    (dz^T h), chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden_UD: Tensor, weight_VD: Tensor, chunk_rows: int):
        work = torch.promote_types(hidden_UD.dtype, torch.float32)
        U = hidden_UD.shape[0]
        lse_U = hidden_UD.new_empty(U, dtype=work)
        ent_U = hidden_UD.new_empty(U, dtype=work)
        for a in range(0, U, chunk_rows):
            z = (hidden_UD[a:a + chunk_rows] @ weight_VD.T).to(work)
            lse = torch.logsumexp(z, dim=-1)
            pz = (z - lse[:, None]).exp_().mul_(z)  # p * z, one [rows, V] buffer
            lse_U[a:a + chunk_rows] = lse
            ent_U[a:a + chunk_rows] = lse - pz.sum(-1)
            del z, pz
        ctx.save_for_backward(hidden_UD, weight_VD, lse_U, ent_U)
        ctx.chunk_rows = chunk_rows
        return lse_U, ent_U

    @staticmethod
    def backward(ctx, g_lse: Tensor | None, g_ent: Tensor | None):
        hidden_UD, weight_VD, lse_U, ent_U = ctx.saved_tensors
        n = ctx.chunk_rows
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_h = torch.zeros_like(hidden_UD) if need_h else None
        d_w = torch.zeros(weight_VD.shape, dtype=lse_U.dtype, device=weight_VD.device) if need_w else None
        for a in range(0, hidden_UD.shape[0], n):
            h = hidden_UD[a:a + n]
            # in place where a buffer is done with: each [rows, V] pass over the vocabulary
            # is what this loop's time is made of (the same values as out of place)
            logp = (h @ weight_VD.T).to(lse_U.dtype).sub_(lse_U[a:a + n, None])
            p = torch.exp(logp)
            dent = None
            if g_ent is not None:  # p (log p + H) g_ent
                dent = logp.add_(ent_U[a:a + n, None]).mul_(p).mul_(g_ent[a:a + n, None])
            if g_lse is not None:
                dz = p.mul_(g_lse[a:a + n, None])
                if dent is not None:
                    dz.sub_(dent)
            else:
                dz = dent.neg_() if dent is not None else torch.zeros_like(p)
            del logp, p, dent
            dz = dz.to(hidden_UD.dtype)
            if need_h:
                d_h[a:a + n] = dz @ weight_VD
            if need_w:
                d_w += (dz.T @ h).to(d_w.dtype)
            del dz
        return d_h, (d_w.to(weight_VD.dtype) if need_w else None), None


def lm_head_chunk_rows(rows: int, vocab: int, chunk_elements: int | None) -> int | None:
    """Rows per chunk of the LM head for `rows` x `vocab` logits under a budget of
    `chunk_elements` logits per chunk; None (one unchunked pass) when the whole fits the
    budget or the budget is None."""
    if chunk_elements is None or rows * vocab <= chunk_elements:
        return None
    return max(1, chunk_elements // vocab)


def target_logprobs(
    hidden_TD: Tensor, lm_head_VD: Tensor, row_N: Tensor, label_N: Tensor, *, entropy_grad: bool = False,
    unique: tuple[Tensor, Tensor] | None = None, chunk_rows: int | None = None,
    pairs: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(logprob_N, entropy_N): log-softmax once per distinct row, gathered per target.

    The entropy is of the full next-token distribution at the target's row; it carries a
    gradient only with entropy_grad (an entropy bonus), otherwise it is a statistic.
    `unique`: (distinct rows sorted, each target's index into them), if already known.
    `chunk_rows`: None runs the reference (one [U, V] log-softmax); a row count runs the
    chunked LM head (`_ChunkedLogSumExpEntropy`: no [U, V] tensor, logits recomputed per
    chunk in the backward), log-prob = label logit - logsumexp, the label logit formed
    once per distinct (row, label) pair (`pairs`: `unique_pairs` of `unique`'s inverse and
    the labels, as tensors; computed here when not given). Per target that would be a
    [N, D] product, N the targets: in a tree many times the rows (843k targets on 48k rows
    in a fanout instance), and saved for the backward."""
    rows_U, inverse_N = unique if unique is not None else torch.unique(row_N, return_inverse=True)
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1 or None; got {chunk_rows}")
        hidden_UD = hidden_TD[rows_U]
        lse_U, entropy_U = _ChunkedLogSumExpEntropy.apply(hidden_UD, lm_head_VD, int(chunk_rows))
        if pairs is None:
            width = int(label_N.max()) + 1 if label_N.numel() else 1
            keys_P, pair_N = torch.unique(inverse_N * width + label_N, return_inverse=True)
            pairs = (keys_P // width, keys_P % width, pair_N)
        row_P, lab_P, pair_N = pairs
        label_logit_P = (hidden_UD[row_P] * lm_head_VD[lab_P]).sum(-1).to(lse_U.dtype)
        logprob_N = (label_logit_P - lse_U[row_P]).to(hidden_TD.dtype)[pair_N]
        if not (entropy_grad and torch.is_grad_enabled()):
            entropy_U = entropy_U.detach()
        return logprob_N, entropy_U.to(hidden_TD.dtype)[inverse_N]
    logits_UV = hidden_TD[rows_U] @ lm_head_VD.T
    logp_UV = torch.log_softmax(logits_UV, dim=-1)
    logprob_N = logp_UV[inverse_N, label_N]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy_U = -(logp_UV.exp() * logp_UV).sum(-1)
    return logprob_N, entropy_U[inverse_N]


def aggregate(values_N: Tensor, table: TargetTable, den: LossDenominators, mode: AggMode) -> Tensor:
    """This batch's contribution to the step-level aggregate of per-target values."""
    weighted_N = values_N * table.weight.to(values_N.dtype)
    if mode == "token-mean":
        return weighted_N.sum() / max(den.total_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return weighted_N.sum() / den.num_sequences
    if mode == "seq-mean-token-mean":
        seq_N = to_device(den.seq_tokens, values_N.device, values_N.dtype)[table.traj].clamp(min=1.0)
        return (weighted_N / seq_N).sum() / den.num_sequences
    raise ValueError(f"unknown aggregation mode {mode!r}; known: {', '.join(AGG_MODES)}")


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: Tensor  # scalar to backpropagate: pg + kl_coef * kl - entropy_coef * entropy
    pg_loss: Tensor  # detached contributions (all sum over microbatches to the step value)
    kl: Tensor
    entropy: Tensor
    clip_frac: Tensor  # token-mean of "the clipped branch was taken"
    ppo_kl: Tensor  # token-mean of old_logprob - logprob
    logprob_N: Tensor  # detached per-target values
    entropy_N: Tensor


def policy_loss(
    hidden_TD: Tensor,
    lm_head_VD: Tensor,
    table: TargetTable,
    den: LossDenominators,
    config: PolicyLossConfig | None = None,
) -> PolicyLossOutput:
    cfg = config or PolicyLossConfig()
    unique = None if table.unique_rows is None else (table.unique_rows, table.row_inverse)
    if unique is None:
        unique = torch.unique(table.row, return_inverse=True)
    chunk = lm_head_chunk_rows(int(unique[0].numel()), int(lm_head_VD.shape[0]), cfg.lm_head_chunk_elements)
    pairs = None if table.pair_row is None else (table.pair_row, table.pair_label, table.pair_inverse)
    logprob_N, entropy_N = target_logprobs(
        hidden_TD, lm_head_VD, table.row, table.label, entropy_grad=cfg.entropy_coef > 0, unique=unique,
        chunk_rows=chunk, pairs=pairs if table.unique_rows is not None else None,
    )
    dtype = logprob_N.dtype
    adv_N = table.advantage.to(dtype)
    log_ratio_N = logprob_N - table.old_logprob.to(dtype)
    ratio_N = torch.exp(log_ratio_N)
    pg1_N = -adv_N * ratio_N
    pg2_N = -adv_N * ratio_N.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg_N = torch.maximum(pg1_N, pg2_N)
    clipped_N = (pg2_N > pg1_N).to(dtype)
    if cfg.clip_ratio_c is not None:
        pg3_N = -adv_N * cfg.clip_ratio_c
        pg_N = torch.where(adv_N < 0, torch.minimum(pg_N, pg3_N), pg_N)
    mode = cfg.agg_mode
    pg = aggregate(pg_N, table, den, mode)
    loss = pg
    if cfg.kl_coef > 0:
        if table.ref_logprob is None:
            raise ValueError("kl_coef > 0 needs reference log-probs for every target")
        delta_N = (table.ref_logprob.to(dtype) - logprob_N).clamp(-20.0, 20.0)
        kl_N = (torch.exp(delta_N) - delta_N - 1.0).clamp(-10.0, 10.0)
        kl = aggregate(kl_N, table, den, mode)
        loss = loss + cfg.kl_coef * kl
    else:
        kl = pg.new_zeros(())
    ent = aggregate(entropy_N, table, den, mode)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * ent
    with torch.no_grad():
        clip_frac = aggregate(clipped_N, table, den, "token-mean")
        ppo_kl = aggregate(-log_ratio_N, table, den, "token-mean")
    return PolicyLossOutput(
        loss=loss,
        pg_loss=pg.detach(),
        kl=kl.detach(),
        entropy=ent.detach(),
        clip_frac=clip_frac,
        ppo_kl=ppo_kl.detach(),
        logprob_N=logprob_N.detach(),
        entropy_N=entropy_N.detach(),
    )
