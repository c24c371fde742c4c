"""The online RL loop: sample -> allocate -> score -> plan -> tree-train -> repeat.

One step: P prompts (episode seeds, fresh each step) get root episodes from the current
policy (`harts.rl.sample`); an allocation spends the rest of the step's rollout budget on
continuations from intermediate turn boundaries, which makes each prompt's rollouts a tree;
the rewards are turned into per-token advantages (GRPO's group-normalised episode
advantage, or RTMC's per-step one); the rollouts become trajectories with the sampler's
log-probs as `old_logprobs`, and one update runs through the batch API (`harts.rl.api`) in
tree or expanded mode. Both modes see the same samples; in float64 their updates agree to
rounding, so their reward curves are the same. Over many steps two separate runs' weights
drift apart from those rounding differences (AdamW divides by small second moments), so
`RLConfig.lockstep` checks the claim step by step: each step the other mode's update also
runs, from the same weights and optimizer state on the same batch, and the step records
how far the two updates differ (`StepRecord.lockstep`); the run goes on with its own mode's.

Per step the loop records the mean reward, the loss terms, the rollout-vs-training log-prob
gap (mean |training-time log-prob - rollout log-prob| over the trained tokens, both from
the same weights: the training forward runs before the optimizer step), the forest's
compression (expanded tokens / executed rows), the share of prompts with mixed rewards
and timings.

The pluggable parts are one call each: `advantages_for` (grpo | rtmc) and
`allocator_for` (uniform | trace).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from harts.config.models import ModelConfig
from harts.rl.env import EnvConfig, Switchboard, get_env_config, make_env
from harts.rl.sample import (
    Expansion,
    HartsPolicy,
    Prefix,
    Rollout,
    SamplingConfig,
    boundary_prefixes,
    sample_tree_rollouts,
)

ADVANTAGES = ("grpo", "rtmc")
ALLOCATIONS = ("uniform", "trace")
MODES = ("tree", "expanded")


class LoopError(ValueError):
    """A loop config the loop cannot run; the message names the field."""


@dataclass(frozen=True)
class RLConfig:
    env: str = "switchboard"
    steps: int = 30
    mode: str = "tree"
    advantage: str = "grpo"
    allocation: str = "uniform"
    dtype: str = "float32"
    seed: int = 0
    prompts: int = 8  # prompts per step
    roots: int = 4  # root episodes per prompt
    expansions: int = 4  # continuations per prompt from intermediate prefixes (the rest of the budget)
    lr: float = 3e-3
    grad_clip: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    microbatch_tokens: int = 4096
    d_model: int = 32
    num_layers: int = 2
    lockstep: bool = False  # also run the other mode's update each step, from the same state (module docstring)

    def validate(self) -> RLConfig:
        if self.steps < 1:
            raise LoopError(f"steps must be >= 1, got {self.steps}")
        for name, value, known in (("mode", self.mode, MODES), ("advantage", self.advantage, ADVANTAGES),
                                   ("allocation", self.allocation, ALLOCATIONS),
                                   ("dtype", self.dtype, ("float32", "float64"))):
            if value not in known:
                raise LoopError(f"{name}: unknown {value!r}; known: {', '.join(known)}")
        for name in ("prompts", "roots", "microbatch_tokens", "d_model", "num_layers"):
            if getattr(self, name) < 1:
                raise LoopError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.expansions < 0:
            raise LoopError(f"expansions must be >= 0, got {self.expansions}")
        if not self.lr > 0:
            raise LoopError(f"lr must be > 0, got {self.lr}")
        get_env_config(self.env)
        return self

    @property
    def budget(self) -> int:
        """Rollouts per step."""
        return self.prompts * (self.roots + self.expansions)


def toy_model_config(env: EnvConfig, d_model: int = 32, num_layers: int = 2) -> ModelConfig:
    """A tiny HARTS model for a toy environment: the environment's vocabulary, KDA and MLA
    layers in a 1:1 pattern, dense FFNs (no MoE, so no aux loss and nothing that depends
    on the microbatch split)."""
    heads, head = 2, max(8, d_model // 2)
    return ModelConfig(
        name=f"rl-{env.name}", vocab_size=env.vocab_size, d_model=d_model, num_layers=num_layers,
        kda_per_mla=1, kda_num_heads=heads, kda_head_dim=head, kda_head_v_dim=head, conv_window=4,
        chunk_size=16, mla_num_heads=heads, kv_lora_rank=head, q_lora_rank=None, qk_nope_head_dim=head,
        qk_rope_head_dim=8, v_head_dim=head, use_rope=False, num_dense_layers=num_layers,
        dense_ffn_dim=2 * d_model, num_experts=0, top_k=0, expert_ffn_dim=0, num_shared_experts=0,
        aux_loss_coef=0.0,
    ).validate()


# ---- scoring: one call per advantage kind ------------------------------------------------

def grpo_episode_advantages(rollouts: Sequence[Rollout], eps: float = 1e-6) -> list[float]:
    """GRPO: each rollout's reward minus its prompt group's mean, over the group's std."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.prompt, []).append(i)
    adv = [0.0] * len(rollouts)
    for members in groups.values():
        rew = np.array([rollouts[i].reward for i in members])
        std = rew.std()
        for i, x in zip(members, (rew - rew.mean()) / (std + eps), strict=True):
            adv[i] = float(x)
    return adv


def advantages_for(kind: str, rollouts: Sequence[Rollout], trajectories: Sequence) -> list[np.ndarray]:
    """Per-token advantages of every rollout (aligned with its tokens; read where the loss
    mask is set)."""
    if kind == "grpo":
        return [np.full(len(r.tokens), a) for r, a in zip(rollouts, grpo_episode_advantages(rollouts), strict=True)]
    if kind == "rtmc":
        try:
            from harts.rl.rtmc import rtmc_advantages
        except ImportError as err:
            raise LoopError(f"--advantage rtmc needs harts.rl.rtmc ({err})") from None
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rollouts):
            groups.setdefault(r.prompt, []).append(i)
        out: list[np.ndarray | None] = [None] * len(rollouts)
        for members in groups.values():
            adv = rtmc_advantages([trajectories[i] for i in members], [rollouts[i].reward for i in members])
            for i, a in zip(members, adv, strict=True):
                out[i] = np.asarray(a, dtype=np.float64)
        return out  # type: ignore[return-value]
    raise LoopError(f"advantage: unknown {kind!r}; known: {', '.join(ADVANTAGES)}")


# ---- allocation: one call per allocation kind --------------------------------------------

def uniform_counts(candidates: Sequence[Prefix], per_prompt: int) -> list[int]:
    """`per_prompt` continuations per prompt, spread round-robin over its candidate
    prefixes, earliest turn boundaries first (then in the order given)."""
    counts = [0] * len(candidates)
    by_prompt: dict[int, list[int]] = {}
    for i, c in enumerate(candidates):
        by_prompt.setdefault(c.prompt, []).append(i)
    for members in by_prompt.values():
        members = sorted(members, key=lambda i: (candidates[i].turn, i))
        for k in range(per_prompt):
            counts[members[k % len(members)]] += 1
    return counts


def uniform_expansion(env: Switchboard, per_prompt: int) -> Expansion:
    """The uniform tree baseline: every root episode's intermediate turn boundaries are
    candidates, each prompt's continuations spread evenly over its own (`uniform_counts`)."""
    def expand(rollouts: Sequence[Rollout]) -> list[tuple[Prefix, int]]:
        cands = [p for r in rollouts for p in boundary_prefixes(env, r)]
        return list(zip(cands, uniform_counts(cands, per_prompt), strict=True))
    return expand


def _by_prompt(rollouts: Sequence[Rollout]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.prompt, []).append(i)
    return groups


def group_id(step: int, prompt: int) -> str:
    return f"s{step}-p{prompt}"


class UniformAllocator:
    """`roots` episodes per prompt, `expansions` continuations per prompt spread evenly
    over its prefixes."""

    def __init__(self, config: RLConfig, env: Switchboard):
        self.config, self.env = config, env

    def roots(self, step: int, prompts: Sequence[int]) -> list[int]:
        return [self.config.roots] * len(prompts)

    def expansion(self, step: int, prompts: Sequence[int]) -> Expansion | None:
        return uniform_expansion(self.env, self.config.expansions) if self.config.expansions else None

    def observe(self, step: int, rollouts: Sequence[Rollout]) -> None:
        return None


class TraceAllocation:
    """TRACE (`harts.rl.trace.TraceAllocator`): the step's root budget (prompts x roots)
    over prompts, then the continuation budget (prompts x expansions) over the root
    episodes' turn-boundary prefixes, by the predicted chance that a prompt not yet mixed
    ends with mixed rewards (TRACE's group objective); the predictor learns from each
    scored step's trees. Prompt features: the environment's (`Switchboard.prompt_features`:
    the one-hot start state, and the chain length where it varies)."""

    def __init__(self, config: RLConfig, env: Switchboard):
        try:
            from harts.rl.trace import TraceAllocator
        except ImportError as err:
            raise LoopError(f"--allocation trace needs harts.rl.trace ({err})") from None
        self.config, self.env = config, env
        self.tracer = TraceAllocator(len(env.prompt_features(0)), seed=config.seed)

    def _features(self, prompt: int) -> list[float]:
        return self.env.prompt_features(prompt)

    def roots(self, step: int, prompts: Sequence[int]) -> list[int]:
        cands = [self.tracer.root(group_id(step, p), self._features(p)) for p in prompts]
        return [int(c) for c in self.tracer.allocate(cands, len(prompts) * self.config.roots).counts]

    def expansion(self, step: int, prompts: Sequence[int]) -> Expansion | None:
        if not self.config.expansions:
            return None
        budget = len(prompts) * self.config.expansions

        def expand(rollouts: Sequence[Rollout]) -> list[tuple[Prefix, int]]:
            trajs = rollout_batch(rollouts, [np.zeros(len(r.tokens)) for r in rollouts], step).trajectories()
            by_id = {t.id: r for t, r in zip(trajs, rollouts, strict=True)}
            cands, outcomes = [], {}
            for prompt, members in _by_prompt(rollouts).items():
                mine = self.tracer.prefixes([trajs[i] for i in members], [rollouts[i].reward for i in members],
                                            self._features(prompt))
                wins = sum(rollouts[i].reward >= self.tracer.success_threshold for i in members)
                for c in mine:
                    outcomes[c.group] = (int(wins), len(members) - int(wins))
                cands += mine
            if not cands:
                return []
            # the group objective: continuations go where a prompt's rewards are not mixed yet
            alloc = self.tracer.allocate(cands, budget, group_outcomes=outcomes)
            return [(boundary_prefixes(self.env, by_id[c.source])[c.depth - 1], int(n))
                    for c, n in zip(cands, alloc.counts, strict=True) if n]
        return expand

    def observe(self, step: int, rollouts: Sequence[Rollout]) -> None:
        trajs = rollout_batch(rollouts, [np.zeros(len(r.tokens)) for r in rollouts], step).trajectories()
        for prompt, members in _by_prompt(rollouts).items():
            self.tracer.observe([trajs[i] for i in members], [rollouts[i].reward for i in members],
                                self._features(prompt))


def allocator_for(kind: str, config: RLConfig, env: Switchboard) -> UniformAllocator | TraceAllocation:
    """The step's allocation: one call per kind."""
    if kind == "uniform":
        return UniformAllocator(config, env)
    if kind == "trace":
        return TraceAllocation(config, env)
    raise LoopError(f"allocation: unknown {kind!r}; known: {', '.join(ALLOCATIONS)}")

# ---- the loop ------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepRecord:
    step: int
    reward_mean: float
    reward_std: float
    loss: float
    pg_loss: float
    entropy: float
    logprob_gap: float
    compression: float
    mixed_share: float  # share of the step's prompts whose rollouts' rewards are not all equal
    rollouts: int
    tokens: int
    executed_rows: int
    grad_norm: float
    sample_seconds: float
    train_seconds: float
    sample_digest: str  # sha256 of every rollout's tokens, in order: equal digests, equal samples
    # with RLConfig.lockstep: the other mode's update from the same state (`lockstep_difference`)
    lockstep: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunResult:
    config: RLConfig
    model: str
    steps: list[StepRecord] = field(default_factory=list)
    random_reward: float = 0.0
    seconds: float = 0.0


def rollout_batch(rollouts: Sequence[Rollout], advantages: Sequence[np.ndarray], step: int):
    from harts.rl.api import SequenceBatch

    return SequenceBatch.make(
        [r.tokens for r in rollouts], [r.loss_mask for r in rollouts], advantages,
        [r.old_logprobs for r in rollouts], [group_id(step, r.prompt) for r in rollouts],
        ids=[f"{group_id(step, r.prompt)}-{'.'.join(map(str, r.path))}" for r in rollouts],
        turns=[r.turns for r in rollouts])


def _digest(rollouts: Sequence[Rollout]) -> str:
    import hashlib

    h = hashlib.sha256()
    for r in rollouts:
        h.update(r.tokens.astype("<i8").tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def run(config: RLConfig, on_step: Callable[[StepRecord], None] | None = None, *, model=None,
        device: str = "cpu") -> RunResult:
    """Run the loop; `on_step` sees each step's record as it finishes."""
    config = config.validate()
    start = time.perf_counter()
    env, model, policy, sampler, sampling = _parts(config, model, device)
    shadow = _shadow(policy, config) if config.lockstep else None
    allocator = allocator_for(config.allocation, config, env)
    records = []
    for step in range(1, config.steps + 1):
        t0 = time.perf_counter()
        prompts = step_prompts(config, step)
        rollouts = sample_tree_rollouts(sampler, env, prompts, allocator.roots(step, prompts),
                                        allocator.expansion(step, prompts), sampling, step=step)
        t1 = time.perf_counter()
        batch = _scored_batch(config, rollouts, step)
        before = _snapshot(policy) if shadow is not None else None
        result = policy.update(batch)
        check = lockstep_difference(policy, shadow, before, batch, result) if shadow is not None else None
        allocator.observe(step, rollouts)
        gaps = [np.abs(lp[r.loss_mask] - r.old_logprobs[r.loss_mask])
                for lp, r in zip(result.stats.log_probs, rollouts, strict=True)]
        rewards = np.array([r.reward for r in rollouts])
        rec = StepRecord(
            step=step, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
            loss=result.losses["loss"], pg_loss=result.losses["pg_loss"], entropy=result.losses["entropy"],
            logprob_gap=float(np.concatenate(gaps).mean()), compression=result.compression,
            mixed_share=step_mixed_share(prompts, rollouts),
            rollouts=len(rollouts), tokens=result.tokens, executed_rows=result.executed_rows,
            grad_norm=result.grad_norm, sample_seconds=t1 - t0, train_seconds=time.perf_counter() - t1,
            sample_digest=_digest(rollouts), lockstep=check)
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    return RunResult(config, model.config.name, records, env.random_reward(), time.perf_counter() - start)


# ---- tracking -------------------------------------------------------------------------------

RL_EXPERIMENT = "harts-rl"
RL_STUDY = "rl"


def step_prompts(config: RLConfig, step: int) -> list[int]:
    """The step's prompts (episode seeds, fresh each step, fixed by the run's seed)."""
    return [(config.seed * 1_000_003 + step * config.prompts + i) for i in range(config.prompts)]


def step_mixed_share(prompts: Sequence[int], rollouts: Sequence[Rollout]) -> float:
    """Share of the step's prompts whose rollouts' rewards are not all equal; a prompt that
    got no rollouts has no mixed rewards."""
    by_prompt: dict[int, list[float]] = {p: [] for p in prompts}
    for r in rollouts:
        by_prompt[r.prompt].append(r.reward)
    return float(np.mean([len(set(v)) > 1 for v in by_prompt.values()]))


def _parts(config: RLConfig, model, device: str):  # noqa: ANN001, ANN202
    """The environment, the policy's model (built from the config when None), its trainer,
    sampler and sampling config."""
    import torch

    from harts.config.optimizer import OptimizerConfig
    from harts.exec.loss import PolicyLossConfig
    from harts.exec.model import build_model
    from harts.rl.api import RLPolicy

    env = make_env(config.env)
    dtype = {"float32": torch.float32, "float64": torch.float64}[config.dtype]
    if model is None:
        model = build_model(toy_model_config(env.config, config.d_model, config.num_layers), seed=config.seed,
                            dtype=dtype, device=device)
    policy = RLPolicy(model, mode=config.mode,
                      optimizer=OptimizerConfig(lr=config.lr, grad_clip=config.grad_clip if config.grad_clip > 0 else None),
                      loss=PolicyLossConfig(), microbatch_tokens=config.microbatch_tokens)
    sampling = SamplingConfig(config.temperature, config.top_p, config.seed).validate()
    return env, model, policy, HartsPolicy(model), sampling


def _scored_batch(config: RLConfig, rollouts: Sequence[Rollout], step: int):  # noqa: ANN202
    """The rollouts as a batch, scored by `config.advantage`."""
    batch0 = rollout_batch(rollouts, [np.zeros(len(r.tokens)) for r in rollouts], step)
    return rollout_batch(rollouts, advantages_for(config.advantage, rollouts, batch0.trajectories()), step)


def _update(policy, config: RLConfig, rollouts: Sequence[Rollout], step: int):  # noqa: ANN001, ANN202
    """Score the rollouts (`config.advantage`) and run one update on them."""
    return policy.update(_scored_batch(config, rollouts, step))


def _shadow(policy, config: RLConfig):  # noqa: ANN001, ANN202
    """A policy of the other mode on a copy of `policy`'s model, for `RLConfig.lockstep`."""
    import copy

    from harts.rl.api import RLPolicy

    other = "expanded" if config.mode == "tree" else "tree"
    return RLPolicy(copy.deepcopy(policy.model), mode=other, optimizer=policy.trainer.optimizer_config,
                    loss=policy.trainer.loss_config, microbatch_tokens=policy.microbatch_tokens)


def _snapshot(policy):  # noqa: ANN001, ANN202
    """`policy`'s weights (copies) and optimizer state (a deep copy) before an update."""
    import copy

    return ({n: p.detach().clone() for n, p in policy.model.named_parameters()},
            copy.deepcopy(policy.trainer.optimizer.state_dict()))


def _max_abs_diff(a, b) -> float:  # noqa: ANN001
    """max |a - b| over positions both give a value; inf where only one of them does."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    fa, fb = np.isfinite(a), np.isfinite(b)
    if a.shape != b.shape or not np.array_equal(fa, fb):
        return float("inf")
    return float(np.max(np.abs(a[fa] - b[fa]), initial=0.0))


def lockstep_difference(policy, shadow, before, batch, result) -> dict:  # noqa: ANN001
    """Run `shadow`'s update from the state `policy` had `before` its update on `batch` and
    compare the two:

    - `grad_max_rel_diff`: the largest |difference| of the (clipped) gradients over every
      parameter entry, over the largest |gradient|;
    - `update_rel_l2_diff`: ||update - other update|| / ||update|| over all parameters,
      an update being new weights - old weights;
    - `update_max_abs_diff`, `update_max_rel_diff`: the largest |difference| of the two
      updates, absolute and over the largest |update|. AdamW's update of an entry whose
      gradient is near its epsilon moves by up to lr / eps times that gradient's rounding,
      so this per-entry figure carries rounding amplified (3.2e-10 of the largest update
      measured on a small float64 batch); the L2 figure averages it out;
    - the gradient norms' relative difference, the loss's absolute one and the largest
      |difference| of the log-probs."""
    import torch

    weights, opt_state = before
    with torch.no_grad():
        for n, p in shadow.model.named_parameters():
            p.copy_(weights[n])
    shadow.trainer.optimizer.load_state_dict(opt_state)
    other = shadow.update(batch)
    own = dict(policy.model.named_parameters())
    diff = scale = gdiff = gscale = 0.0
    sq_diff = sq_update = 0.0
    with torch.no_grad():
        for n, p in shadow.model.named_parameters():
            w0, q = weights[n], own[n]
            du, dv = q - w0, p - w0
            diff = max(diff, float((du - dv).abs().max()))
            scale = max(scale, float(du.abs().max()))
            sq_diff += float((du - dv).pow(2).sum())
            sq_update += float(du.pow(2).sum())
            if (q.grad is None) != (p.grad is None):
                gdiff = float("inf")
            elif q.grad is not None:
                gdiff = max(gdiff, float((q.grad - p.grad).abs().max()))
                gscale = max(gscale, float(q.grad.abs().max()))
    lp = max((_max_abs_diff(a, b) for a, b in zip(result.stats.log_probs, other.stats.log_probs, strict=True)),
             default=0.0)
    return {"mode": shadow.mode,
            "grad_max_rel_diff": gdiff / gscale if gscale > 0 else gdiff,
            "update_rel_l2_diff": (sq_diff / sq_update) ** 0.5 if sq_update > 0 else sq_diff ** 0.5,
            "update_max_abs_diff": diff, "update_max_rel_diff": diff / scale if scale > 0 else diff,
            "grad_norm_rel_diff": abs(result.grad_norm - other.grad_norm) / max(abs(result.grad_norm), 1e-300),
            "loss_abs_diff": abs(result.losses["loss"] - other.losses["loss"]), "logprob_max_abs_diff": lp}


@dataclass(frozen=True)
class AllocationComparison:
    """`compare_allocations`' result: per allocation, the mixed-prompt share of every step
    (`shares[name][step - 1]`), all drawn from the same weights at each step."""

    config: RLConfig
    train_on: str
    shares: dict[str, list[float]]

    def mean(self, name: str) -> float:
        return float(np.mean(self.shares[name]))


def compare_allocations(config: RLConfig, allocations: Sequence[str] = ALLOCATIONS, *, train_on: str = "uniform",
                        model=None, device: str = "cpu") -> AllocationComparison:  # noqa: ANN001
    """Allocations compared on the same policy: at every step each allocation samples the
    step's prompts from the same weights (with its own state, e.g. TRACE's predictor,
    learnt from its own earlier samples), and its share of prompts with mixed rewards is
    recorded; then the policy is updated on `train_on`'s rollouts only. So the shares
    differ by allocation alone, not by how each run's training went (runs trained on their
    own allocations reach different policies, and a stronger policy leaves fewer prompts
    mixed)."""
    config = config.validate()
    names = list(dict.fromkeys(allocations))
    if train_on not in names:
        raise LoopError(f"train_on: {train_on!r} is not one of the compared allocations {names}")
    env, model, policy, sampler, sampling = _parts(config, model, device)
    allocators = {name: allocator_for(name, config, env) for name in names}
    shares: dict[str, list[float]] = {name: [] for name in names}
    for step in range(1, config.steps + 1):
        prompts = step_prompts(config, step)
        drawn = {}
        for name, alloc in allocators.items():
            rollouts = sample_tree_rollouts(sampler, env, prompts, alloc.roots(step, prompts),
                                            alloc.expansion(step, prompts), sampling, step=step)
            shares[name].append(step_mixed_share(prompts, rollouts))
            alloc.observe(step, rollouts)
            drawn[name] = rollouts
        _update(policy, config, drawn[train_on], step)
    return AllocationComparison(config, train_on, shares)


def reward_change(steps: Sequence[StepRecord], window: int = 5) -> float:
    """Mean reward of the last `window` steps minus that of the first `window`."""
    rw = [s.reward_mean for s in steps]
    w = min(window, len(rw))
    return float(np.mean(rw[-w:]) - np.mean(rw[:w])) if rw else 0.0


def steps_table(result: RunResult) -> dict:
    """The steps as a report table (`harts report`'s table format)."""
    cols = ["step", "reward", "loss", "log-prob gap", "compression", "mixed prompts", "rollouts"]
    cells = [[str(s.step), f"{s.reward_mean:.3f}", f"{s.loss:.4f}", f"{s.logprob_gap:.2e}",
              f"{s.compression:.2f}x", f"{s.mixed_share:.2f}", str(s.rollouts)] for s in result.steps]
    c = result.config
    return {"title": f"online RL on {c.env} ({c.mode} mode, {c.advantage} advantages, {c.allocation} allocation, "
                     f"{c.dtype})",
            "columns": [{"label": x, "kind": "key" if x == "step" else "ours"} for x in cols],
            "cells": cells,
            "note": f"random-policy reward {result.random_reward:.3f}; last-5 minus first-5 mean reward "
                    f"{reward_change(result.steps):+.3f}; {result.seconds:.0f} s"}


def log_run(result: RunResult, tracking_uri: str | None = None) -> str:
    """Log the run as the `rl` study (a report section): per-step metrics with their step
    numbers, the final values, the steps as `rl_steps.json` (which `harts report` plots)
    and as a table. Returns the run id."""
    import json
    import time as _time

    from harts.track.record import RunRecord, client_for, log_record

    c = result.config
    last = result.steps[-1]
    record = RunRecord(
        name=f"rl {c.env} {c.mode} {c.advantage} {c.allocation}",
        params={**asdict(c), "model": result.model},
        metrics={"reward_mean": last.reward_mean, "logprob_gap": last.logprob_gap, "loss": last.loss,
                 "compression": last.compression, "reward_change": reward_change(result.steps),
                 "random_reward": result.random_reward, "study_seconds": result.seconds},
        tags={"harts.kind": "study", "harts.study": RL_STUDY, "harts.config": c.env,
              "harts.title": "online RL on a toy environment: reward and rollout-vs-training log-prob gap"},
        artifacts={"rl_steps.json": json.dumps([s.to_dict() for s in result.steps], indent=1),
                   "tables.json": json.dumps([steps_table(result)], indent=1)},
    )
    run_id = log_record(record, RL_EXPERIMENT, tracking_uri)
    from mlflow.entities import Metric

    now = int(_time.time() * 1000)
    keys = ("reward_mean", "loss", "logprob_gap", "compression", "mixed_share", "entropy", "grad_norm")
    metrics = [Metric(f"step.{k}", float(getattr(s, k)), now, s.step) for s in result.steps for k in keys]
    metrics += [Metric(f"step.lockstep_{k}", float(s.lockstep[k]), now, s.step) for s in result.steps
                if s.lockstep for k in ("update_rel_l2_diff", "grad_max_rel_diff")]
    client = client_for(tracking_uri)
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000])
    return run_id


__all__ = [
    "ADVANTAGES", "ALLOCATIONS", "LoopError", "MODES", "RLConfig", "RunResult", "StepRecord",
    "RL_EXPERIMENT", "RL_STUDY", "advantages_for", "allocator_for", "group_id", "uniform_counts", "log_run", "reward_change", "steps_table", "grpo_episode_advantages", "rollout_batch", "run", "toy_model_config",
    "uniform_expansion",
]
