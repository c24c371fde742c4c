"""Rollout scheduling policies, one registry keyed by `RolloutPolicyName`.

A policy is data (`RolloutPolicy`): a router for ready turns plus Heddle's four switches.
What each does in `harts.sim.rollout.engine`:

Step-centric baselines (every turn is a request routed on its own; a worker admits its
queue first come first served; all workers have the workload's fixed `baseline_mp`):
- `round-robin`: turns go to workers in rotation. A turn that lands away from the worker
  holding its trajectory's KV prefills its whole context again (the stale copy is freed).
- `least-loaded`: turns go to the worker with the fewest running + queued sequences;
  the same recomputation rule.
- `cache-aware`: a turn goes to the worker holding its KV (prefix-cache pinning); a turn
  whose KV was evicted, and every first turn, goes to the least-loaded worker.

Every policy shares the same engine: continuous batching up to `max_batch`, admission
while the KV fits (least-recently-used cached KV of trajectories waiting on tools is
evicted first, and those trajectories recompute on return), head-of-line blocking, the
same roofline prices. Heddle keeps cache-aware pinning (a trajectory's turns go to its
home worker) and adds, each switchable:
- `priority`: a worker admits the trajectory with the longest predicted remaining length
  first (progressive priority; the predictor is updated after every turn);
- `placement`: homes by presorted dynamic programming over the predicted lengths
  (longest on the fastest workers), instead of least-loaded by count;
- `migration`: when a trajectory starts a tool call, its KV may move to a worker whose
  predicted drain time it lowers, priced as a KV transfer over NVLink / InfiniBand;
- `adaptive_mp`: the cluster's layout of model-parallel degrees (under the GPU budget) is
  chosen by simulated annealing on the predicted drain time, instead of all `baseline_mp`;
- `group_predictor`: the remaining-length predictor learns the per-turn action length of
  a prompt group from its members' finished turns (samples of one prompt share its
  difficulty) and shrinks each trajectory's own mean towards it, instead of using the
  prior until the trajectory's own first turn ends;
- `dynamic_mp`: model parallelism re-decided during the step: two idle workers of one
  degree on an aligned block of GPUs (nothing running, queued, cached or planned on
  either) merge into one worker of twice the degree, if that degree is usable; the
  merged worker takes queued turns (stealing) and running sequences whose own predicted
  finish is sooner there (every worker re-examines its batch at its next iteration
  boundary). The step starts with the throughput layout for the bulk and the long tail
  ends on high-degree workers (the paper's trajectory-adaptive resource manager);
- `makespan_moves`: (none by default) the kinds of move between workers it names
  (`"tool"`: migration at a tool call, `"steal"`: stealing, `"live"`: live migration) are
  each accepted only if it lowers the step's predicted makespan
  (the largest drain estimate over all workers, with and without the move; a live move's
  transfer counted at its destination) or the predicted finish of the worker that holds
  the predicted-longest remaining trajectory; among destinations the lowest such makespan;
- `drain_merge`: (off by default) once the step's tail has formed (at most `DRAIN_TAIL` of
  the trajectories unfinished), each worker and its buddy (the other worker of its degree
  on the aligned block of twice the degree, if twice it is usable) merge at their next
  common iteration boundary, busy or not (the first to reach one waits for the other's):
  their running sequences, queued turns and cached KV are resharded onto the merged worker
  (half of each GPU's KV shard copied to its partner's GPU over NVLink) and resume there
  without a prefill. Unlike `dynamic_mp` it does not wait for both to be idle;
- `live_migration`: a turn is re-predicted while it runs (at 512, 1024, 2048, ... tokens:
  a turn that outlives its expected length is expected to run as long again), and a
  running sequence whose own predicted finish is much sooner on another worker (fewer
  sequences there, or a higher degree) moves there at an iteration boundary, its KV
  copied over NVLink / InfiniBand, and resumes decoding without a prefill.

- `tail_shield`: (off by default) a worker with one of the `SHIELD_K` predicted-longest
  unfinished trajectories planned on it admits short work (predicted under a quarter of
  the least of those trajectories' remaining tokens) only while its batch is below
  max(`SHIELD_BATCH`, its demand - the free batch slots of the workers holding none of
  them), so that the long trajectory decodes in a smaller batch (`harts.sim.rollout.tail`).
- `tail_pools`: (off by default) a tail pool of the highest degree holding at most K of
  the trajectories predicted longest (entering at a tool call or a re-prediction point
  when ranked among the K and the pool has room) and a bulk pool of a lower degree for
  the rest, the layout from a twin of the step run under the policy (`pool_twin`) or a
  fixed rule (`harts.sim.rollout.pools`).

- `posterior`: (off by default) remaining lengths from the workload's own length model
  given the turns seen so far (a prompt group's and the trajectory's), running turns
  counted as censored at their elapsed tokens, and the turn count's posterior given the
  hint (`harts.sim.rollout.posterior`), instead of the hint x the observed per-turn mean.

`heddle-count-homes` combines options for a start where the predictor cannot yet rank
the tail: makespan-decided tool-call migration, homes least-loaded by count in trajectory
order (a prompt's samples are numbered together, so each prompt group is spread over the
workers) instead of DP placement on the start-of-step predictions, and priority without
its preemption.

With every switch off Heddle is `cache-aware`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from harts.config.registry import Registry


class Router(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    CACHE_AWARE = "cache-aware"
    BALANCER = "balancer"  # every turn a fresh request to a least-requests load balancer (prefix cache kept)
    HOME = "home"  # Heddle: the trajectory's planned (or migrated-to) worker


class RolloutPolicyName(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    CACHE_AWARE = "cache-aware"
    VERL = "verl"
    ORACLE_POOLS = "oracle-pools"
    HEDDLE = "heddle"
    HEDDLE_NO_PRIORITY = "heddle-no-priority"
    HEDDLE_NO_PREEMPTION = "heddle-no-preemption"
    HEDDLE_NO_PLACEMENT = "heddle-no-placement"
    HEDDLE_NO_MIGRATION = "heddle-no-migration"
    HEDDLE_NO_ADAPTIVE_MP = "heddle-no-adaptive-mp"
    HEDDLE_ANNEAL_LAYOUT = "heddle-anneal-layout"
    HEDDLE_NO_ISOLATION = "heddle-no-isolation"
    HEDDLE_NO_GROUP_PREDICTOR = "heddle-no-group-predictor"
    HEDDLE_NO_LIVE_MIGRATION = "heddle-no-live-migration"
    HEDDLE_NO_DYNAMIC_MP = "heddle-no-dynamic-mp"
    HEDDLE_MAKESPAN_MOVES = "heddle-makespan-moves"
    HEDDLE_MAKESPAN_TOOL = "heddle-makespan-tool"
    HEDDLE_MAKESPAN_TOOL_STEAL = "heddle-makespan-tool-steal"
    HEDDLE_DRAIN_MERGE = "heddle-drain-merge"
    HEDDLE_MAKESPAN_TOOL_DRAIN = "heddle-makespan-tool-drain"
    HEDDLE_TAIL_SHIELD = "heddle-tail-shield"
    HEDDLE_TAIL_POOLS = "heddle-tail-pools"
    HEDDLE_TAIL_POOLS_RULE = "heddle-tail-pools-rule"
    HEDDLE_POSTERIOR = "heddle-posterior"
    HEDDLE_COUNT_HOMES = "heddle-count-homes"
    HEDDLE_COUNT_HOMES_POSTERIOR = "heddle-count-homes-posterior"


@dataclass(frozen=True)
class RolloutPolicy:
    name: RolloutPolicyName
    router: Router
    priority: bool = False
    placement: bool = False
    migration: bool = False
    adaptive_mp: bool = False
    group_predictor: bool = False
    live_migration: bool = False
    dynamic_mp: bool = False
    description: str = ""
    preempt: bool = False  # priority with preemption of short work for a waiting long one
    oracle: bool = False  # the predictor reads the true remaining lengths: reference schedules only, never Heddle
    twin_layout: bool = False  # adaptive MP: the layout from simulating candidates on a twin of the step
    isolation: bool = False  # a tail pool: the predicted-longest trajectories kept on the highest-degree workers
    # the kinds of move between workers ("tool": KV migration at a tool call, "steal": work
    # stealing, "live": live migration) accepted on the step's predicted makespan (the latest
    # drain estimate over all workers) with and without the move, instead of the pair's
    # larger estimate (tool calls with a 5% margin, stealing) or the moved sequence's own
    # predicted finish (live migration)
    makespan_moves: frozenset[str] = frozenset()
    # as the step's tail forms, an idle worker and its busy buddy (the other half of an
    # aligned block of twice the degree) merge: the buddy's sequences and cached KV are
    # resharded onto the merged worker, and the tail decodes at the higher degree
    drain_merge: bool = False
    # a worker holding one of the predicted-longest trajectories caps its batch for short work
    # while other workers have room for it (`harts.sim.rollout.tail`)
    tail_shield: bool = False
    # a tail pool of the highest degree holding at most K predicted-longest trajectories and
    # a bulk pool of a lower degree (`harts.sim.rollout.pools`)
    tail_pools: bool = False
    pool_twin: bool = True  # the pools' layout from the twin run under this policy (else a fixed rule)
    # remaining lengths from the workload's length model given the turns seen so far, running
    # turns censored at their elapsed tokens (`harts.sim.rollout.posterior`), instead of the
    # hint x the observed per-turn mean
    posterior: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.makespan_moves) - MOVE_KINDS
        if unknown:
            raise ValueError(f"makespan_moves: unknown kinds of move {sorted(unknown)} (known: {sorted(MOVE_KINDS)})")

    @property
    def step_centric(self) -> bool:
        return self.router != Router.HOME

    @property
    def reference(self) -> bool:
        """Reads the true lengths: a known-lengths reference schedule, not a policy."""
        return self.oracle


MOVE_KINDS = frozenset({"tool", "steal", "live"})  # the moves `makespan_moves` may name

POLICIES: Registry[RolloutPolicyName, RolloutPolicy] = Registry(
    "rollout policy", RolloutPolicyName, KeyError, duplicate_error=ValueError)

_HEDDLE = dict(priority=True, placement=True, migration=True, adaptive_mp=True, group_predictor=True,
               live_migration=True, dynamic_mp=True, preempt=True, twin_layout=True, isolation=True)


def _heddle(name: RolloutPolicyName, description: str, **off: bool) -> RolloutPolicy:
    return RolloutPolicy(name, Router.HOME, **(_HEDDLE | off), description=description)


for _p in (
    RolloutPolicy(RolloutPolicyName.ROUND_ROBIN, Router.ROUND_ROBIN, description="turns in rotation"),
    RolloutPolicy(RolloutPolicyName.LEAST_LOADED, Router.LEAST_LOADED, description="turns to the least-loaded worker"),
    RolloutPolicy(RolloutPolicyName.CACHE_AWARE, Router.CACHE_AWARE, description="turns pinned to their KV"),
    RolloutPolicy(RolloutPolicyName.VERL, Router.BALANCER,
                  description="every turn a fresh request to a least-requests balancer, LRU prefix caches"),
    RolloutPolicy(RolloutPolicyName.ORACLE_POOLS, Router.HOME, priority=True, oracle=True,
                  description="ORACLE (true lengths): a given layout and homes, longest remaining first"),
    _heddle(RolloutPolicyName.HEDDLE, "every mechanism"),
    _heddle(RolloutPolicyName.HEDDLE_NO_PRIORITY, "without priority (and its preemption)", priority=False,
            preempt=False),
    _heddle(RolloutPolicyName.HEDDLE_NO_PREEMPTION, "priority without preemption", preempt=False),
    _heddle(RolloutPolicyName.HEDDLE_NO_PLACEMENT, "without DP placement", placement=False),
    _heddle(RolloutPolicyName.HEDDLE_NO_MIGRATION, "without migration at tool calls and work stealing",
            migration=False),
    _heddle(RolloutPolicyName.HEDDLE_NO_ADAPTIVE_MP, "at the baselines' fixed degree", adaptive_mp=False),
    _heddle(RolloutPolicyName.HEDDLE_ANNEAL_LAYOUT, "layout annealed on the drain estimate, not the twin",
            twin_layout=False),
    _heddle(RolloutPolicyName.HEDDLE_NO_ISOLATION, "tail pool layout without keeping the tail apart",
            isolation=False),
    _heddle(RolloutPolicyName.HEDDLE_NO_GROUP_PREDICTOR, "without the prompt-group predictor",
            group_predictor=False),
    _heddle(RolloutPolicyName.HEDDLE_NO_LIVE_MIGRATION, "without in-turn re-prediction and live migration",
            live_migration=False),
    _heddle(RolloutPolicyName.HEDDLE_NO_DYNAMIC_MP, "without merging idle workers during the step",
            dynamic_mp=False),
    _heddle(RolloutPolicyName.HEDDLE_MAKESPAN_MOVES, "every move accepted on the step's predicted makespan",
            makespan_moves=MOVE_KINDS),
    _heddle(RolloutPolicyName.HEDDLE_MAKESPAN_TOOL, "tool-call migration accepted on the step's predicted makespan",
            makespan_moves=frozenset({"tool"})),
    _heddle(RolloutPolicyName.HEDDLE_MAKESPAN_TOOL_STEAL,
            "tool-call migration and stealing accepted on the step's predicted makespan",
            makespan_moves=frozenset({"tool", "steal"})),
    _heddle(RolloutPolicyName.HEDDLE_DRAIN_MERGE, "pairs of workers merge, busy or not, as the tail forms",
            drain_merge=True),
    _heddle(RolloutPolicyName.HEDDLE_MAKESPAN_TOOL_DRAIN, "makespan-decided tool-call migration and drain-and-merge",
            makespan_moves=frozenset({"tool"}), drain_merge=True),
    _heddle(RolloutPolicyName.HEDDLE_TAIL_SHIELD, "small batches around the predicted-longest trajectories",
            tail_shield=True),
    _heddle(RolloutPolicyName.HEDDLE_TAIL_POOLS, "a tail pool for the predicted-longest trajectories, a bulk pool",
            tail_pools=True),
    _heddle(RolloutPolicyName.HEDDLE_TAIL_POOLS_RULE, "tail and bulk pools in a fixed layout (3 top-degree workers of 64, the bulk at half)",
            tail_pools=True, pool_twin=False),
    _heddle(RolloutPolicyName.HEDDLE_POSTERIOR, "the posterior length predictor (censored running turns)",
            posterior=True),
    _heddle(RolloutPolicyName.HEDDLE_COUNT_HOMES,
            "makespan-decided tool-call migration, homes by count, priority without preemption",
            makespan_moves=frozenset({"tool"}), placement=False, preempt=False),
    _heddle(RolloutPolicyName.HEDDLE_COUNT_HOMES_POSTERIOR,
            "heddle-count-homes with the posterior length predictor",
            makespan_moves=frozenset({"tool"}), placement=False, preempt=False, posterior=True),
):
    POLICIES.register(_p.name, _p)
del _p

BASELINES = tuple(n for n, p in POLICIES.items() if p.step_centric)


def get_policy(name: str) -> RolloutPolicy:
    return POLICIES.get(name)


def known_policies(reference: bool = False) -> list[str]:
    """Registered policy names; reference schedules (which read the true lengths) only
    with `reference`."""
    return [n for n in POLICIES.known() if reference or not POLICIES.get(n).reference]
