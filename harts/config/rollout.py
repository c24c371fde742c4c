"""Rollout-phase workloads as data: the shape statistics a step's agentic trajectories are
drawn from and the inference-cluster knobs the rollout simulator (`harts.sim.rollout`)
prices them with (`RolloutWorkload`), plus named presets (`ROLLOUT_PRESETS`).

A trajectory is a prompt followed by turns; a turn is an observation to prefill (the
prompt on the first turn), an action to decode, then a tool call (none after the last
turn). Turn counts, action and observation lengths and tool latencies are lognormal and
clipped, like the training-side generator (`harts.config.workload.WorkloadConfig`), with
one more long-tail source: every trajectory draws its own action-length scale
(`action_traj_sigma`), since a trajectory that reasons long in one turn tends to in the
next. The defaults of the `agentic-longtail` preset (the one the done-when benchmark
uses) and where they come from (assumptions, every one overridable):

- 32 prompts x 8 rollouts = 256 trajectories per step (GRPO group size 8).
- prompt 1-4k tokens (system prompt + task), uniform.
- turns: lognormal median 4, sigma 1.0, clipped to [1, 64]: most trajectories take 1-10
  turns, a tail of a few percent runs past 25 (agentic search / coding agents with tool
  budgets of 32-64 calls).
- action: lognormal median 400 tokens, sigma 0.8, clipped to [16, 8192] (reasoning +
  one tool call), times the trajectory's own scale exp(N(0, 0.6)).
- observation: lognormal median 300, sigma 1.0, clipped to [8, 4096] (tool output).
- tool latency: lognormal median 1.5 s, sigma 1.0, clipped to [0.05, 60] s (sandboxed
  code runs, search calls).
- contexts stop adding turns at 65536 tokens.
- remaining-length predictor: it sees each trajectory's true turn count times
  exp(N(0, 0.5)) (a learned run-length predictor with that error) and the mean action
  length observed so far; it is updated after every turn.

`agentic-longtail-loaded` keeps every trajectory statistic and the group size and takes
128 prompts (1024 trajectories): agentic RL steps batch hundreds of prompts x 8-16
samples, so on 32 GPUs (8 MP4 workers) a worker holds ~128 trajectories, its batch is in
the hundreds for most of the step (the per-token time is the large-batch one, ~7x the
batch-1 one) and the step-centric baselines' FCFS queues delay the long tail's turns;
`agentic-longtail` (256 trajectories) leaves workers nearly idle once the bulk is done.

`agentic-reasoning` is tool-integrated reasoning (a thinking model that calls a code
sandbox or a search tool between long reasoning turns, as in code-interpreter and search
agent RL): 64 prompts x 16 samples (GRPO/DAPO-style group of 16) = 1024 trajectories;
prompt 0.5-2k tokens; turns lognormal median 3, sigma 0.8, in [1, 32]; actions median 1200
tokens, sigma 0.8, in [32, 16384] (a reasoning turn), times a per-trajectory scale
exp(N(0, 0.5)) and a per-prompt scale exp(N(0, 0.6)) shared by the group (a hard prompt
makes all its samples reason long: `action_group_sigma`); observations median 200 tokens;
sandbox latency median 0.8 s, sigma 1.0, in [0.05, 30] s; contexts capped at 64k. Its long
tail is decode, not tool waits (seed 0: 9.5M generated tokens, median 5.0k per trajectory,
p99 60k; the longest spends 6.7 s of its ~137 s critical path in tools), so batch
interference and per-token time, what Heddle acts on, decide it.

Cluster knobs: the model (a `harts.config.models` name; the default `flash` is the
124B-parameter MoE, whose bf16 weights need at least 2 H200s), the hardware profile,
bf16 weights and KV, the usable HBM fraction, the model-parallel efficiency per doubling
of the degree, kernels launched per layer and decode step (CUDA graphs assumed, hence
few), the continuous-batching limit per worker, the baselines' fixed degree and the
degrees an adaptive layout may use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from harts.config.registry import Registry

__all__ = ["ROLLOUT_PRESETS", "RolloutPreset", "RolloutWorkload", "rollout_preset"]


@dataclass(frozen=True)
class RolloutWorkload:
    # trajectories
    num_prompts: int = 32
    rollouts_per_prompt: int = 8
    prompt_tokens: tuple[int, int] = (1000, 4000)
    turns_median: float = 4.0
    turns_sigma: float = 1.0
    turns_range: tuple[int, int] = (1, 64)
    action_median: float = 400.0
    action_sigma: float = 0.8
    action_traj_sigma: float = 0.6  # per-trajectory action-length scale exp(N(0, this))
    action_group_sigma: float = 0.0  # per-prompt action-length scale exp(N(0, this)), shared by the group
    action_range: tuple[int, int] = (16, 8192)
    obs_median: float = 300.0
    obs_sigma: float = 1.0
    obs_range: tuple[int, int] = (8, 4096)
    tool_latency_median_s: float = 1.5
    tool_latency_sigma: float = 1.0
    tool_latency_range_s: tuple[float, float] = (0.05, 60.0)
    tool_task_sigma: float = 0.0  # per-trajectory tool-latency scale exp(N(0, this)): a slow task is slow on every call
    max_context: int = 65536
    predictor_sigma: float = 0.5  # error of the run-length hint, lognormal sigma
    # cluster
    model: str = "flash"
    hardware: str = "h200"
    bytes_per_param: int = 2
    kv_bytes_per_value: int = 2
    state_bytes_per_value: int = 4  # KDA recurrent state (fp32)
    hbm_utilization: float = 0.9  # fraction of HBM usable for weights + KV
    mp_efficiency: float = 0.9  # per-GPU efficiency kept per doubling of the degree
    decode_kernels_per_layer: int = 4
    max_batch: int = 256  # sequences decoded together on one worker
    # KV memory: "paged" allocates a sequence's KV as its tokens are generated (a turn is
    # admitted when its context and input fit) and preempts a running sequence when a
    # worker runs out ("recompute": its KV is dropped and rebuilt by a prefill of its whole
    # context on re-admission; "swap": its KV is copied to host memory over `swap_bytes_per_s`
    # and back); "reserve" reserves the KV of the whole turn at admission (never preempts)
    kv_alloc: str = "paged"
    preemption: str = "recompute"
    swap_bytes_per_s: float = 50e9  # host <-> GPU copy per worker (PCIe 5 x16, assumption)
    kv_watermark: float = 0.01  # paged: admission leaves this fraction of the KV capacity free
    fixed_cost_scale: float = 1.0  # scales the per-iteration fixed costs (launches, all-reduces): sensitivity knob
    baseline_mp: int = 4  # the step-centric baselines' fixed degree
    mp_degrees: tuple[int, ...] = (2, 4, 8)  # degrees an adaptive layout may use
    anneal_iterations: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_trajectories(self) -> int:
        return self.num_prompts * self.rollouts_per_prompt

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"rollout workload: {msg}")

        for name in ("num_prompts", "rollouts_per_prompt", "max_batch", "anneal_iterations",
                     "bytes_per_param", "kv_bytes_per_value", "state_bytes_per_value",
                     "decode_kernels_per_layer"):
            if getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prompt_tokens", "turns_range", "action_range", "obs_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                bad(f"{name} must satisfy 1 <= low <= high, got {(lo, hi)}")
        lo, hi = self.tool_latency_range_s
        if not 0 <= lo <= hi:
            bad(f"tool_latency_range_s must satisfy 0 <= low <= high, got {(lo, hi)}")
        for name in ("turns_median", "action_median", "obs_median", "tool_latency_median_s"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be > 0")
        for name in ("turns_sigma", "action_sigma", "action_traj_sigma", "action_group_sigma", "obs_sigma",
                     "tool_latency_sigma", "tool_task_sigma", "predictor_sigma"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0")
        if self.max_context <= self.prompt_tokens[1] + self.action_range[0]:
            bad("max_context must exceed the largest prompt plus the shortest action")
        if not 0 < self.hbm_utilization <= 1:
            bad("hbm_utilization must be in (0, 1]")
        if not 0 < self.mp_efficiency <= 1:
            bad("mp_efficiency must be in (0, 1]")
        if self.kv_alloc not in ("paged", "reserve"):
            bad(f"kv_alloc must be 'paged' or 'reserve', got {self.kv_alloc!r}")
        if self.preemption not in ("recompute", "swap"):
            bad(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        if self.swap_bytes_per_s <= 0 or not 0 <= self.kv_watermark < 0.5 or self.fixed_cost_scale < 0:
            bad("swap_bytes_per_s must be > 0, kv_watermark in [0, 0.5), fixed_cost_scale >= 0")
        degrees = (self.baseline_mp, *self.mp_degrees)
        if not self.mp_degrees or any(d < 1 or d & (d - 1) for d in degrees):
            bad(f"model-parallel degrees must be powers of two, got baseline {self.baseline_mp}, "
                f"adaptive {self.mp_degrees}")
        if tuple(sorted(set(self.mp_degrees))) != self.mp_degrees:
            bad("mp_degrees must be strictly increasing")


class RolloutPreset(StrEnum):
    TINY = "tiny"
    SMALL = "small"
    AGENTIC_LONGTAIL = "agentic-longtail"
    AGENTIC_LONGTAIL_LOADED = "agentic-longtail-loaded"
    AGENTIC_REASONING = "agentic-reasoning"
    AGENTIC_REASONING_DENSE = "agentic-reasoning-dense"
    SWE_AGENT = "swe-agent"


ROLLOUT_PRESETS: Registry[RolloutPreset, RolloutWorkload] = Registry(
    "rollout workload preset", RolloutPreset, KeyError, duplicate_error=ValueError)
# a handful of short trajectories: tests and quick CLI runs
ROLLOUT_PRESETS.register(RolloutPreset.TINY, RolloutWorkload(
    num_prompts=2, rollouts_per_prompt=4, prompt_tokens=(200, 400), turns_median=3.0,
    turns_range=(1, 8), action_median=60.0, action_range=(8, 400), obs_median=40.0,
    obs_range=(4, 200), tool_latency_median_s=0.5, max_context=8192, anneal_iterations=40))
ROLLOUT_PRESETS.register(RolloutPreset.SMALL, RolloutWorkload(
    num_prompts=8, rollouts_per_prompt=4, turns_range=(1, 32), max_context=32768,
    anneal_iterations=80))
ROLLOUT_PRESETS.register(RolloutPreset.AGENTIC_LONGTAIL, RolloutWorkload())
# the same trajectory statistics with 4x the prompts: 128 x 8 = 1024 trajectories, 128 per
# MP4 worker of 32 GPUs (half the batch limit each before tool waits), so batches stay
# large and turns queue behind each other for most of the step (see the module docstring)
ROLLOUT_PRESETS.register(RolloutPreset.AGENTIC_LONGTAIL_LOADED, RolloutWorkload(num_prompts=128))
# tool-integrated reasoning (a thinking model calling a code sandbox or search): 64 prompts x
# 16 samples, few turns of long reasoning, fast tools, prompt difficulty shared by a group
# (see the module docstring)
ROLLOUT_PRESETS.register(RolloutPreset.AGENTIC_REASONING, RolloutWorkload(
    num_prompts=64, rollouts_per_prompt=16, prompt_tokens=(500, 2000), turns_median=3.0, turns_sigma=0.8,
    turns_range=(1, 32), action_median=1200.0, action_sigma=0.8, action_traj_sigma=0.5, action_group_sigma=0.6,
    action_range=(32, 16384), obs_median=200.0, tool_latency_median_s=0.8, tool_latency_range_s=(0.05, 30.0)))
# the same trajectories served as the dense Qwen3-32B (KV reads dominate decode), which fits
# one H200, so degree 1 is usable too
ROLLOUT_PRESETS.register(RolloutPreset.AGENTIC_REASONING_DENSE, dataclasses.replace(
    ROLLOUT_PRESETS.get(RolloutPreset.AGENTIC_REASONING), model="qwen3-32b", mp_degrees=(1, 2, 4, 8)))
# a SWE agent (repository tasks: read, edit, run tests): 32 prompts x 8 samples, 50-100
# tool calls each, short actions, long observations (file views, test logs), tool calls of
# seconds to minutes with a per-task scale (a repository whose tests are slow is slow on
# every call), contexts up to 128k, served as Qwen3-32B
ROLLOUT_PRESETS.register(RolloutPreset.SWE_AGENT, RolloutWorkload(
    num_prompts=32, rollouts_per_prompt=8, prompt_tokens=(2000, 6000), turns_median=65.0, turns_sigma=0.25,
    turns_range=(50, 100), action_median=220.0, action_sigma=0.8, action_traj_sigma=0.3, action_group_sigma=0.3,
    action_range=(16, 4096), obs_median=350.0, obs_sigma=1.0, obs_range=(8, 8192), tool_latency_median_s=3.0,
    tool_latency_sigma=1.0, tool_latency_range_s=(0.2, 300.0), tool_task_sigma=0.8, max_context=131072,
    model="qwen3-32b", mp_degrees=(1, 2, 4, 8), anneal_iterations=100))


def rollout_preset(name: str, **overrides: Any) -> RolloutWorkload:
    """The registered preset `name` with `overrides` applied (and checked); unknown names
    fail listing the known ones."""
    cfg = ROLLOUT_PRESETS.get(name)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
