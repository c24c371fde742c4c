"""What every step planner reads (`PlanConfig`) and the planning defaults it starts from."""

from __future__ import annotations

from dataclasses import dataclass, field

from harts.config.costs import LoadModel, default_load_model

# Every trajectory of the SWE workloads must fit one microbatch (contexts reach 131072
# tokens), and with full activation recomputation the Tiny model keeps ~75 KB of layer
# inputs per token plus one layer's working set (~0.1-0.15 MB per token), ~30 GB at 128k
# tokens: comfortable on a 141 GB H200 next to its sharded weights and optimizer state.
DEFAULT_MICROBATCH_TOKENS = 131_072

# What a producer row keeps alive during its window, relative to the per-token budget
# above: under full recomputation it holds its layer inputs (24 x 1536 bf16, ~74 KB)
# and the MLA latents consumers attend to (6 x 576 bf16, ~7 KB), ~81 KB, against ~230 KB
# per computed token (those inputs plus one layer's activations and gradients). 1.0 is
# the conservative bound (every activation kept).
DEFAULT_PRODUCER_RETENTION = 0.35

# What a chain piece (a trajectory longer than the budget, cut inside a node) holds per row
# of its context beside its own rows, in the same units: the stashes of the pieces above it
# (their attention keys/values, conv tails and KDA states, 0.053 of a row's activations per
# row on tiny-h200, benchmarks/results/chains/2026-12-06-fc6da58-chain64k-h100.json) and the
# transient of reading them (about 0.02 more, single131k's activation peak against an
# ordinary 32k step's). A chain piece pays the smaller of this x its context rows and the
# producer charge above (`harts.plan.memory.chain_charge`); None: the producer charge alone.
# Simulated over the long families and single trajectories it takes the step 3-4% closer to
# the unsplit one at 16k (benchmarks/results/sim/2026-12-07-717e380-chain-retention-h100.json);
# measured on the 64k chain at 16k, 5 pieces instead of 6, 1.7% faster at a 1.9% lower peak
# (benchmarks/results/chains/2026-12-08-c1ab792-chain64k-chain-retention-ab-h100.json).
DEFAULT_CHAIN_RETENTION: float | None = 0.076

# Pipeline fill. With pp stages a 1F1B pipeline runs pp warm-up forwards on its first stage
# before the first backward, so a replica needs at least pp microbatches for every stage to
# be busy at once; with m microbatches the fill and drain leave (pp - 1) / (m + pp - 1) of
# the step idle (GPipe, Huang et al. 2019; Megatron-LM, Narayanan et al. 2021: m >> pp).
# m = pp (1 per stage) only just fills the pipeline and still idles (pp - 1) / (2 pp - 1),
# nearly half the step; m = 2 pp is the smallest count at which the first stage has as many
# steady-state 1F1B iterations as warm-up forwards, and bounds the bubble by 1/3 for any pp.
# GPipe's rule of thumb for a negligible bubble (m >= 4 pp) is not forced: for a tree step
# every extra microbatch is another sharing window or a smaller pass (a producer forward
# and backward, per-pass weight reads and launches). Above the floor the planners search
# as they do without a pipeline, and l1l2 scores its candidates (and L1's plan) by the
# pipelined critical path (`pipelined_critical_path`).
DEFAULT_MIN_MICROBATCHES_PER_STAGE = 2


@dataclass(frozen=True)
class PlanConfig:
    """What every planner reads. `time_limit` is only used by search-based planners.

    `pp` is the number of pipeline stages the step will run on (1: no pipeline). With
    pp > 1 the planners aim for at least `min_microbatches_per_stage * pp` microbatches per
    DP replica (see `target_microbatches`) where the step's work allows it, and l1l2 scores
    its candidate plans by the pipelined critical path; with pp = 1 neither applies.

    `search_evaluations` (l1l2, pp = 1): evaluations of a seeded (`seed`) search that
    re-forms the final plan's windows (`l1l2._search_windows`); 0 (default) skips it.

    `microbatch_floor`, `consumer_floor` (l1l2, pp = 1; token equivalents of the cost
    model): the least a microbatch costs whatever its rows (a host-bound executor issues
    the same kernel launches for a small microbatch as for a large one) and what a window
    consumer adds to it (its stash assembly and state handoff); `consumer_row_cost`: what a
    consumer's load grows by per row of its producer (gathering and accumulating the
    stash). l1l2 prices its windowed plan and L1's recomputing plan with them (each
    microbatch at max(its load, its floor)) and keeps the cheaper, so windows are chosen
    only where they pay. `harts.sim.executor.window_floors` derives all three from a model
    and a hardware profile; 0 (default) leaves every plan priced by its rows alone.

    `split_trees` (tree-mode planners, dp > 1): a tree holding more than a replica's share
    of the step may be split over the replicas, its trajectories in groups that each run
    as a window tree of their own, where the step load is lower
    (`harts.plan.planners.tree_split`); False keeps every tree on one replica.

    `sink_leaves` (tree-mode planners, dp = pp = 1): in a chain of windows, a leaf the host
    paces (its rows under `microbatch_floor + consumer_floor`) may move into another leaf
    under the same producer or one below it, where the finished plan is shorter and
    lighter (`harts.plan.planners.leaves.sink_leaves`); False keeps every leaf where it was
    built.

    `chain_retention`: with a number c, a chain piece cut inside a node pays the smaller of
    the producer charge and c x its context rows (`harts.plan.memory.chain_charge`), so a
    long chain's first pieces are longer than `piece_tokens` (default 0.076,
    `DEFAULT_CHAIN_RETENTION`); None charges the producer's rows alone.

    `ep` (dp > 1, pp = 1): expert parallelism over groups of `ep` replicas. Their passes
    run in lockstep (`harts.plan.lockstep`), so where the planners compare finished plans
    (`common.step_load`: split and nested trees) a group's step is its joint events,
    each as long as its longest pass; 1 (default) prices each replica alone."""

    dp: int = 1
    microbatch_tokens: int = DEFAULT_MICROBATCH_TOKENS
    cost_model: LoadModel = field(default_factory=default_load_model)
    producer_retention: float = DEFAULT_PRODUCER_RETENTION
    seed: int = 0
    time_limit: float = 2.0
    chunk_size: int = 64
    pp: int = 1
    min_microbatches_per_stage: int = DEFAULT_MIN_MICROBATCHES_PER_STAGE
    search_evaluations: int = 0
    microbatch_floor: float = 0.0
    consumer_floor: float = 0.0
    consumer_row_cost: float = 0.0
    split_trees: bool = True
    ep: int = 1
    sink_leaves: bool = True
    chain_retention: float | None = DEFAULT_CHAIN_RETENTION

    @property
    def target_microbatches(self) -> int:
        """Microbatches per DP replica the pipeline wants: `min_microbatches_per_stage * pp`
        with a pipeline, 1 (no floor) without one."""
        return self.min_microbatches_per_stage * self.pp if self.pp > 1 else 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dp < 1:
            raise ValueError(f"PlanConfig.dp must be >= 1, got {self.dp}")
        if self.pp < 1:
            raise ValueError(f"PlanConfig.pp must be >= 1, got {self.pp}")
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"PlanConfig.ep must be >= 1 and divide dp={self.dp}, got {self.ep}")
        if self.min_microbatches_per_stage < 1:
            raise ValueError(f"PlanConfig.min_microbatches_per_stage must be >= 1, got {self.min_microbatches_per_stage}")
        if self.microbatch_tokens < 1:
            raise ValueError(f"PlanConfig.microbatch_tokens must be >= 1, got {self.microbatch_tokens}")
        if not self.producer_retention >= 0:
            raise ValueError(f"PlanConfig.producer_retention must be >= 0, got {self.producer_retention}")
        if self.chain_retention is not None and not self.chain_retention >= 0:
            raise ValueError(f"PlanConfig.chain_retention must be >= 0 or None, got {self.chain_retention}")
        if not self.time_limit > 0:
            raise ValueError(f"PlanConfig.time_limit must be > 0, got {self.time_limit}")
        if self.chunk_size < 1:
            raise ValueError(f"PlanConfig.chunk_size must be >= 1, got {self.chunk_size}")
        if self.search_evaluations < 0:
            raise ValueError(f"PlanConfig.search_evaluations must be >= 0, got {self.search_evaluations}")
        for name in ("microbatch_floor", "consumer_floor", "consumer_row_cost"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PlanConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.cost_model, LoadModel):
            raise ValueError(f"PlanConfig.cost_model must be a load model, got {self.cost_model!r}")
