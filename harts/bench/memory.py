"""The planned peak memory of one update step on one GPU (`memory_plan`) and the largest
microbatch token budget that fits a capacity (`largest_fitting_budget`): estimates to plan
a budget with, not measurements."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harts.config.models import ModelConfig


# measured activation bytes per computed row of tiny-h200 at 131,072 rows (267 KB, the
# windows section of docs/BENCHMARKS.md) over the simulator's estimate for it (138 KB)
MEASURED_OVER_SIMULATED_ACTIVATIONS = 1.93


def memory_plan(model: str | ModelConfig, microbatch_tokens: int, param_bytes: int = 2,
                lm_head_chunk_elements: int | None = None) -> dict[str, float]:
    """Planned peak bytes of one update step on one GPU: weights, gradients and AdamW's two
    moments in the parameters' dtype (`param_bytes` each), activations of a
    recomputing microbatch (the simulator's per-row estimate scaled by the measured
    ratio `MEASURED_OVER_SIMULATED_ACTIVATIONS`), and the LM head's largest logits
    workspace (three float32 [chunk, vocab] tensors in the chunked head, three
    [rows, vocab] without it). An estimate to plan the budget with, not a measurement."""
    from harts.config.models import get_model_config
    from harts.config.param_counts import parameter_counts
    from harts.exec.loss import DEFAULT_LM_HEAD_CHUNK_ELEMENTS
    from harts.plan.stages import stage_layers
    from harts.sim.ops import StageCounter
    from harts.sim.parallel import default_parallel

    cfg = get_model_config(model) if isinstance(model, str) else model
    counter = StageCounter(cfg, default_parallel(cfg, 1), stage_layers(cfg, 1)[0], 8, True)
    params = parameter_counts(cfg).total
    static = params * param_bytes * 4  # weights, gradients, exp_avg, exp_avg_sq
    per_row = (counter.activation_bytes_per_token() + counter.recompute_working_bytes_per_token())
    activations = per_row * MEASURED_OVER_SIMULATED_ACTIVATIONS * microbatch_tokens
    chunk = DEFAULT_LM_HEAD_CHUNK_ELEMENTS if lm_head_chunk_elements is None else lm_head_chunk_elements
    logits = 3 * 4 * min(chunk, microbatch_tokens * cfg.vocab_size)
    return {"parameters": float(params), "static_bytes": float(static), "activation_bytes": activations,
            "lm_head_bytes": float(logits), "total_bytes": static + activations + logits,
            "unchunked_lm_head_bytes": float(3 * 4 * microbatch_tokens * cfg.vocab_size)}


def largest_fitting_budget(model: str | ModelConfig, capacity_bytes: float, param_bytes: int = 2) -> int:
    """The largest microbatch token budget (a multiple of 4096) whose `memory_plan` fits
    `capacity_bytes`; 0 if even the weights and optimizer state do not."""
    lo, hi = 0, 1 << 22
    while hi - lo > 4096:
        mid = (lo + hi) // 2 // 4096 * 4096
        if memory_plan(model, mid, param_bytes)["total_bytes"] <= capacity_bytes:
            lo = mid
        else:
            hi = mid
    return lo
