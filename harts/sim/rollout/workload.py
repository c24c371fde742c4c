"""Drawing a step's trajectories from a `RolloutWorkload` (seeded: the same config and
seed give the same specs, whatever policy or cluster later runs them)."""

from __future__ import annotations

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.types import TrajectorySpec, TurnSpec


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: float, hi: float) -> float:
    return float(np.clip(median * np.exp(sigma * rng.standard_normal()), lo, hi))


def _draw_turns(rng: np.random.Generator, cfg: RolloutWorkload, want: int, prompt: int, scale: float,
                tool_scale: float) -> list[TurnSpec]:
    """Up to `want` turns after a `prompt`-token prompt: per turn an action (median scaled by
    `scale`), an observation and a tool latency (median scaled by `tool_scale`), drawn in
    that order; the context cap ends the trajectory early; the last turn calls no tool.
    Empty when the prompt leaves no room for a first action."""
    turns: list[TurnSpec] = []
    context, inp = 0, prompt
    for k in range(want):
        action = int(round(_lognormal(rng, cfg.action_median * scale, cfg.action_sigma, *cfg.action_range)))
        obs = int(round(_lognormal(rng, cfg.obs_median, cfg.obs_sigma, *cfg.obs_range)))
        tool = _lognormal(rng, cfg.tool_latency_median_s * tool_scale, cfg.tool_latency_sigma,
                          *cfg.tool_latency_range_s)
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
    if turns and turns[-1].tool_latency_s:
        turns[-1] = TurnSpec(turns[-1].input_tokens, turns[-1].action_tokens, 0.0)
    return turns


def generate_trajectories(cfg: RolloutWorkload) -> tuple[TrajectorySpec, ...]:
    rng = np.random.default_rng([cfg.seed, 22])
    # the prompts' difficulty (shared action-length scale of a group) from a stream of its
    # own, so that workloads without it draw exactly what they drew before it existed
    group_scale = np.exp(cfg.action_group_sigma * np.random.default_rng([cfg.seed, 23]).standard_normal(cfg.num_prompts))
    # per-task tool slowness, likewise from its own stream (one draw per trajectory)
    task_tool = np.exp(cfg.tool_task_sigma * np.random.default_rng([cfg.seed, 24]).standard_normal(cfg.num_trajectories))
    out = []
    for g in range(cfg.num_prompts):
        prompt = int(rng.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1))
        for _ in range(cfg.rollouts_per_prompt):
            tid = len(out)
            want = int(round(_lognormal(rng, cfg.turns_median, cfg.turns_sigma, *cfg.turns_range)))
            scale = float(np.exp(cfg.action_traj_sigma * rng.standard_normal())) * float(group_scale[g])
            turns = _draw_turns(rng, cfg, want, prompt, scale, float(task_tool[tid]))
            noise = float(np.exp(cfg.predictor_sigma * rng.standard_normal()))
            out.append(TrajectorySpec(tid, g, tuple(turns), hint_turns=len(turns) * noise))
    return tuple(out)


def twin_trajectories(cfg: RolloutWorkload, specs: tuple[TrajectorySpec, ...], draw: int = 0) -> tuple[TrajectorySpec, ...]:
    """A stand-in for a step as a scheduler can know it before it runs: every trajectory
    keeps its prompt (visible) and takes its predicted turn count (the run-length hint,
    rounded, in the tool-call budget), and its lengths and tool latencies are drawn afresh
    from the workload's distributions (per-prompt, per-trajectory and per-task scales
    included) on a stream of their own. It reads no true length: what a layout is chosen
    on (`harts.sim.rollout.engine`)."""
    rng = np.random.default_rng([cfg.seed, 31, draw])
    group_scale = np.exp(cfg.action_group_sigma * rng.standard_normal(max((s.group for s in specs), default=0) + 1))
    out = []
    for s in specs:
        want = int(min(max(round(s.hint_turns), cfg.turns_range[0]), cfg.turns_range[1]))
        scale = float(np.exp(cfg.action_traj_sigma * rng.standard_normal())) * float(group_scale[s.group])
        task = float(np.exp(cfg.tool_task_sigma * rng.standard_normal()))
        turns = _draw_turns(rng, cfg, want, s.turns[0].input_tokens, scale, task) or [
            TurnSpec(s.turns[0].input_tokens, 1, 0.0)]
        out.append(TrajectorySpec(s.tid, s.group, tuple(turns), hint_turns=s.hint_turns))
    return tuple(out)
