"""Configurations as data (no torch), the bottom layer the simulator, the planners and the
executor share: it imports nothing from `harts.tree`, `plan`, `sim` or `exec`.

- `models`: `ModelConfig` and the registered model configs (`ModelName`).
- `plan`: `PlanConfig`, what every step planner reads, and the planning defaults.
- `costs`: the planners' load models (`LoadModelName`) and the simulator's cost-model names
  (`CostModelName`; the models themselves live in `harts.sim.costs`).
- `parallel`: `ParallelConfig` (DP x PP, EP inside DP) and `ParallelizeConfig`.
- `workload`: `WorkloadConfig` and the workload presets (`WorkloadPreset`).
- `optimizer`: `OptimizerConfig`.
- `loss`: `PolicyLossConfig`, the policy loss's settings.
- `train`: `TrainConfig`, one training run as data (TOML in and out), what `harts.train` runs.
- `kernels`: `KernelConfig`, which GPU path each op family runs (recorded with results).
- `env`: the one module that reads the environment (`KernelConfig.from_env`, mlflow's
  variables).
- `registry`: the one `Registry` mechanism (StrEnum keys; unknown and duplicate names fail
  loudly).

Every config checks its fields when built and names the bad field in its ValueError.
"""

from harts.config.kernels import BaselineAttention, ConvKernel, Impl, KernelConfig, TreeAttention

__all__ = ["BaselineAttention", "ConvKernel", "Impl", "KernelConfig", "TreeAttention"]
