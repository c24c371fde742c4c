"""Layouts: how a step's trajectories become the microbatches `harts.exec.step.StepRunner` runs.

Each layout partitions the step's trajectories into microbatches and builds each one (its
rows, its `MixingContext`, its targets); the runner runs them all the same way.

- `PackedLayout` (`packed.py`): trajectories packed as independent causal sequences, a
  `PackedContext` per microbatch (the expanded baseline);
- `PrefixMergedLayout` (`prefix.py`): packed hosts, a sequence that is a prefix of another
  reading its host's rows;
- `TreeLayout` (`tree.py`): whole rollout trees, a `TreeContext` per microbatch;
- `PlanLayout` (`plan.py`): any step `Plan`, sharing windows included; its producers'
  stashes, consumers' reads and producers' backwards are the layout's own bookkeeping,
  done while the runner iterates its microbatches.
"""

from harts.exec.layouts.base import LayoutBase
from harts.exec.layouts.packed import PackedLayout, trajectory_targets
from harts.exec.layouts.plan import PlanLayout, WindowStats, order_from_schedule, piece_rows
from harts.exec.layouts.prefix import PrefixMergedLayout
from harts.exec.layouts.tree import TreeLayout, target_table

__all__ = ["LayoutBase", "PackedLayout", "PlanLayout", "PrefixMergedLayout", "TreeLayout", "WindowStats",
           "order_from_schedule", "piece_rows", "target_table", "trajectory_targets"]
