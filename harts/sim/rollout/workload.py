"""Drawing a step's trajectories from a `RolloutWorkload` (seeded: the same config and
seed give the same specs, whatever policy or cluster later runs them)."""

from __future__ import annotations

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.types import TrajectorySpec, TurnSpec


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: float, hi: float) -> float:
    return float(np.clip(median * np.exp(sigma * rng.standard_normal()), lo, hi))


def generate_trajectories(cfg: RolloutWorkload) -> tuple[TrajectorySpec, ...]:
    rng = np.random.default_rng([cfg.seed, 22])
    # the prompts' difficulty (shared action-length scale of a group) from a stream of its
    # own, so that workloads without it draw exactly what they drew before it existed
    group_scale = np.exp(cfg.action_group_sigma * np.random.default_rng([cfg.seed, 23]).standard_normal(cfg.num_prompts))
    out = []
    for g in range(cfg.num_prompts):
        prompt = int(rng.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1))
        for _ in range(cfg.rollouts_per_prompt):
            tid = len(out)
            want = int(round(_lognormal(rng, cfg.turns_median, cfg.turns_sigma, *cfg.turns_range)))
            scale = float(np.exp(cfg.action_traj_sigma * rng.standard_normal())) * float(group_scale[g])
            turns: list[TurnSpec] = []
            context, inp = 0, prompt
            for k in range(want):
                action = int(round(_lognormal(rng, cfg.action_median * scale, cfg.action_sigma, *cfg.action_range)))
                obs = int(round(_lognormal(rng, cfg.obs_median, cfg.obs_sigma, *cfg.obs_range)))
                tool = _lognormal(rng, cfg.tool_latency_median_s, cfg.tool_latency_sigma, *cfg.tool_latency_range_s)
                if context + inp + action > cfg.max_context:
                    action = cfg.max_context - context - inp
                    if action < 1:
                        break
                    want = k + 1
                last = k == want - 1
                turns.append(TurnSpec(inp, action, 0.0 if last else tool))
                context += inp + action
                inp = obs
                if last:
                    break
            if turns[-1].tool_latency_s:
                turns[-1] = TurnSpec(turns[-1].input_tokens, turns[-1].action_tokens, 0.0)
            noise = float(np.exp(cfg.predictor_sigma * rng.standard_normal()))
            out.append(TrajectorySpec(tid, g, tuple(turns), hint_turns=len(turns) * noise))
    return tuple(out)
