"""The policy loss's settings (no torch): what `harts.exec.loss.policy_loss` reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["AGG_MODES", "AggMode", "DEFAULT_LM_HEAD_CHUNK_ELEMENTS", "PolicyLossConfig"]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)
DEFAULT_LM_HEAD_CHUNK_ELEMENTS = 1 << 27  # logits per row chunk (128M: 256 MB in bf16, 512 MB fp32)


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    # dual-clip bound for negative advantages (verl's clip_ratio_c, e.g. 3.0); None = off
    clip_ratio_c: float | None = None
    kl_coef: float = 0.0  # k3 ("low_var_kl") KL to the reference log-probs
    entropy_coef: float = 0.0
    agg_mode: AggMode = "token-mean"
    # the LM head runs in row chunks of at most this many logits when a microbatch's
    # [rows, vocab] logits exceed it (no [rows, vocab] tensor is formed); None: always the
    # unchunked reference (one log-softmax over all rows)
    lm_head_chunk_elements: int | None = DEFAULT_LM_HEAD_CHUNK_ELEMENTS

    def validate(self) -> PolicyLossConfig:
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode: unknown {self.agg_mode!r}; known: {', '.join(AGG_MODES)}")
        if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
            raise ValueError("clip_eps_low must be in [0, 1) and clip_eps_high >= 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 or None; got {self.clip_ratio_c}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        if self.lm_head_chunk_elements is not None and self.lm_head_chunk_elements < 1:
            raise ValueError(f"lm_head_chunk_elements must be >= 1 or None; got {self.lm_head_chunk_elements}")
        return self
