"""Reinforcement learning around the trainer: rollouts from the policy, their scoring and
the allocation of the rollout budget.

`signatures` (state-action signatures of multi-turn steps), `rtmc` (Rollout-Tree Monte
Carlo per-step advantages, and GRPO's) and `trace` (TRACE rollout allocation over prompt
roots and prefixes) are numpy only, importable without torch. The environment, sampler
and loop modules build on them and on harts.exec. Nothing is imported here, so importing a
numpy module of the package never loads torch.
"""
