"""Lowering a step (work + schedule + cost model) to an engine program, and the result.

Lanes: every (replica, stage) rank has a compute stream (passes, optimizer) and a
communication stream (pipeline sends, gradient sync), so sends overlap compute as NCCL's
stream does. Dependencies come from the plan, not the schedule:
- F(m, s) needs m's hidden rows from stage s-1 (the send after F(m, s-1)) and, for a
  consumer, its producer's forward on stage s (KV, boundary states, conv rows);
- a backward pass needs its forwards on the stage, the gradient from stage s+1, and, for
  a producer, every consumer's backward on the stage (their gradients accumulate into the
  producer's outputs) unless that consumer runs in the same fused pass;
- the gradient sync of a stage is one collective over its replicas (a gang); the
  optimizer follows it.
EP lockstep (the default, `ep_lockstep=True`): with expert parallelism every MoE layer
of a pass is an all-to-all over the stage's EP group, so the k-th passes of the group's
ranks run together and last as long as the slowest (a gang). On one stage (the executor's
case: it runs EP without a pipeline) the passes are the executor's own, its EP groups'
joint events (`lockstep_schedule`, `harts.plan.lockstep`): producers that share a forward
event share their backward event, a peer without a pass in an event runs a zero-token
shadow; chains of windows included. With a pipeline the ranks' F/B patterns must line up:
where a replica has fewer microbatches in a window than its EP peers, `pad_ep_groups`
gives it zero-token passes (a real run must join its peers' collectives too). Where the
window sequences differ in kind, or the dependencies deadlock, the passes run
unsynchronised and the result says so (`ep_lockstep` false). With `ep_lockstep=False` (free-running
replicas) the all-to-all is priced as bandwidth inside each pass and replicas wait for
each other only at the gradient sync: optimistic for EP across replicas, kept for
comparison.
Memory per rank: static (weights, gradients, optimizer shard) + activations allocated at a
forward's start and freed at the end of its backward + the producer's gradient
accumulators (held from PF to PB) + per-pass workspace.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from harts.config.models import ModelConfig
from harts.config.parallel import ParallelConfig
from harts.plan.lockstep import joint_events
from harts.plan.schedule import PassOp, Schedule, build_schedule
from harts.plan.work import MicrobatchWork, StepWork
from harts.sim.costs import CostModel, make_cost_model
from harts.sim.engine import Action, DeadlockError, Lane, Program, Trace, execute, lower_bound
from harts.sim.hardware import HardwareProfile
from harts.sim.ops import Phase

__all__ = ["SimResult", "lockstep_schedule", "lower", "pad_ep_groups", "simulate", "simulate_step"]


def lower(step: StepWork, schedule: Schedule, cost: CostModel, ep_lockstep: bool = False) -> Program:
    P = schedule.num_stages
    if P != cost.parallel.pp:
        raise ValueError(f"schedule has {P} stages, the cost model {cost.parallel.pp}")
    if step.num_replicas != cost.parallel.dp:
        raise ValueError(f"step has {step.num_replicas} replicas, the layout DP{cost.parallel.dp}")
    producers = step.producers
    # phase 1: identities and indices
    specs: list[dict[str, Any]] = []
    lane_order: dict[Lane, list[int]] = {}
    pass_of: dict[tuple[int, str, int], int] = {}  # (stage, F|B, mb) -> idx
    send_of: dict[tuple[int, str, int], int] = {}  # (stage, F|B, mb) -> idx of the send
    rank_passes: dict[tuple[int, int], list[int]] = {}

    def new(name: str, kind: str, lane: Lane, **kw: Any) -> int:
        idx = len(specs)
        specs.append(dict(idx=idx, name=name, kind=kind, lane=lane, **kw))
        lane_order.setdefault(lane, []).append(idx)
        return idx

    for (r, s), ops in schedule.ranks:
        comp: Lane = (r, s, "compute")
        comm: Lane = (r, s, "comm")
        lane_order.setdefault(comp, [])
        lane_order.setdefault(comm, [])
        for op in ops:
            i = new(f"r{r}s{s}:{op.text()}", _kind(op, producers), comp, op=op)
            rank_passes.setdefault((r, s), []).append(i)
            for m in op.mbs:
                pass_of[(s, op.kind, m)] = i
            if op.kind == "F" and s < P - 1:
                j = new(f"r{r}s{s}:send-{op.text()}", "SEND_F", comm, op=op)
                send_of[(s, "F", op.mbs[0])] = j
            if op.kind == "B" and s > 0:
                j = new(f"r{r}s{s}:send-{op.text()}", "SEND_B", comm, op=op)
                for m in op.mbs:
                    send_of[(s, "B", m)] = j
        sync = new(f"r{r}s{s}:grad-sync", "SYNC", comm)
        new(f"r{r}s{s}:optimizer", "OPT", comp, sync=sync)

    # gangs: EP lockstep of passes, and the gradient sync of each stage
    gang_of: dict[int, str] = {}
    par = cost.parallel
    lockstep = ep_lockstep and par.ep > 1
    if lockstep:
        for s in range(P):
            for g in range(par.dp // par.ep):
                members = [rank_passes.get((r, s), []) for r in range(g * par.ep, (g + 1) * par.ep)]
                patterns = {tuple(specs[i]["op"].kind for i in lst) for lst in members}
                if len(patterns) != 1:
                    lockstep = False
                    break
                for k in range(len(members[0])):
                    for lst in members:
                        gang_of[lst[k]] = f"ep:s{s}:g{g}:{k}"
            if not lockstep:
                gang_of.clear()
                break
    if par.dp > 1:
        for sp in specs:
            if sp["kind"] == "SYNC":
                gang_of[sp["idx"]] = f"sync:s{sp['lane'][1]}"

    # phase 2: durations, dependencies, memory
    actions: list[Action] = []
    for sp in specs:
        r, s, _ = sp["lane"]
        kind = sp["kind"]
        deps: list[int] = []
        alloc: tuple[tuple[str, float], ...] = ()
        free: tuple[str, ...] = ()
        transient = 0.0
        host = 0.0
        mbs: tuple[int, ...] = ()
        if kind in ("SYNC", "OPT"):
            if kind == "SYNC":
                passes = rank_passes.get((r, s), [])
                deps = passes[-1:]
                duration = cost.grad_sync(s)
            else:
                deps = [sp["sync"]]
                duration = cost.optimizer(s)
        elif kind in ("SEND_F", "SEND_B"):
            op: PassOp = sp["op"]
            mbs = op.mbs
            deps = [pass_of[(s, op.kind, op.mbs[0])]]
            phase = Phase.FWD if kind == "SEND_F" else Phase.BWD
            duration = sum(cost.send(phase, s, step[m]) for m in op.mbs)
        else:
            op = sp["op"]
            mbs = op.mbs
            works = [step[m] for m in op.mbs]
            if op.kind == "F":
                m = op.mbs[0]
                w = works[0]
                if s > 0:
                    deps.append(send_of[(s - 1, "F", m)])
                if w.producer is not None:
                    deps.append(pass_of[(s, "F", w.producer)])
                priced = cost.forward(s, works)
                duration, host = priced.seconds, priced.host
                transient = cost.transient_bytes(s, works, Phase.FWD)
                held = (cost.producer_held_bytes(s, w, len(step.consumers_of(m))) if m in producers
                        else cost.activation_bytes(s, w))
                alloc = ((f"act{m}", held),)
            else:
                for m in op.mbs:
                    deps.append(pass_of[(s, "F", m)])
                    if s < P - 1:
                        deps.append(send_of[(s + 1, "B", m)])
                    if m in producers:
                        deps += [pass_of[(s, "B", c)] for c in step.consumers_of(m) if c not in op.mbs]
                priced = cost.backward(s, works)
                duration, host = priced.seconds, priced.host
                transient = cost.transient_bytes(s, works, Phase.BWD)
                free = tuple(f"act{m}" for m in op.mbs)
        own = sp["idx"]
        actions.append(
            Action(
                idx=own, name=sp["name"], kind=kind, lane=sp["lane"], duration=float(duration),
                deps=tuple(sorted({d for d in deps if d != own})), gang=gang_of.get(own), mbs=mbs,
                alloc=alloc, free=free, transient=float(transient), host=float(host),
            )
        )
    static = {(r, s): cost.static_bytes(s) for (r, s), _ in schedule.ranks}
    return Program(tuple(actions), {k: tuple(v) for k, v in lane_order.items()}, static)


def _kind(op: PassOp, producers: frozenset[int]) -> str:
    if op.fused:
        return "B+PB"
    is_p = op.mbs[0] in producers
    return ("PF" if is_p else "F") if op.kind == "F" else ("PB" if is_p else "B")


@dataclass(frozen=True)
class SimResult:
    throughput: float  # expanded tokens / s
    step_seconds: float
    bubble_fraction: float
    peak_memory_bytes: float
    peak_memory_per_stage: tuple[float, ...]
    hbm_capacity_bytes: float
    critical_path_seconds: float
    busiest_lane_seconds: float
    expanded_tokens: int
    computed_tokens: int
    num_microbatches: int
    schedule: Schedule
    program: Program
    trace: Trace
    parallel: ParallelConfig
    cost_model: str
    ep_lockstep: bool
    busy_by_kind: dict[str, float] = field(default_factory=dict)
    # zero-row passes an EP group's replicas ran in their lockstep (shadows, padding)
    ep_shadows: int = 0

    @property
    def fits_memory(self) -> bool:
        return self.peak_memory_bytes <= self.hbm_capacity_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "throughput": self.throughput,
            "step_seconds": self.step_seconds,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_per_stage_bytes": list(self.peak_memory_per_stage),
            "hbm_capacity_bytes": self.hbm_capacity_bytes,
            "fits_memory": self.fits_memory,
            "critical_path_seconds": self.critical_path_seconds,
            "busiest_lane_seconds": self.busiest_lane_seconds,
            "expanded_tokens": self.expanded_tokens,
            "computed_tokens": self.computed_tokens,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule.name,
            "parallel": self.parallel.describe(),
            "cost_model": self.cost_model,
            "ep_lockstep": self.ep_lockstep,
            "ep_shadow_microbatches": self.ep_shadows,
            "busy_seconds_by_kind": self.busy_by_kind,
        }


def _no_rows(mb: int, replica: int, slot: int, order: int, producer: int | None = None) -> MicrobatchWork:
    """A pass over no rows in an EP group's collectives (padding, a shadow)."""
    return MicrobatchWork(mb=mb, replica=replica, tokens=0, kda_rounds=(), attn_pairs_causal=0,
                          producer=producer, slot=slot, order=order)


def pad_ep_groups(step: StepWork, ep: int) -> StepWork | None:
    """The step with zero-token microbatches added so that the replicas of every EP group
    have the same window shapes, or None when their window sequences differ in kind.

    With expert parallelism every MoE layer is an all-to-all over the EP group, so a
    replica with fewer microbatches in a window than its peers still takes part in the
    peers' extra passes with no tokens (what a real run must do to keep its collectives
    matched): here, a dummy consumer of that window's producer (or a dummy plain
    microbatch), placed after the window's last member. It costs the per-pass fixed work
    (weight reads, launches) and adds no expanded tokens. Steps whose groups already line
    up are returned unchanged."""
    added: list[MicrobatchWork] = []
    next_id = max((m.mb for m in step.microbatches), default=-1) + 1
    by_id = {m.mb: m for m in step.microbatches}
    for g in range(step.num_replicas // ep):
        reps = list(range(g * ep, (g + 1) * ep))
        shapes = {r: step.replica_windows(r) for r in reps}
        kinds = {tuple(w.producer is None for w in ws) for ws in shapes.values()}
        if len(kinds) != 1:
            return None
        for i in range(len(shapes[reps[0]])):
            want = max(len(shapes[r][i].consumers) for r in reps)
            for r in reps:
                w = shapes[r][i]
                last = by_id[w.consumers[-1]] if w.consumers else by_id[w.producer]
                for _ in range(want - len(w.consumers)):
                    added.append(_no_rows(next_id, r, last.slot, last.order, w.producer))
                    next_id += 1
    if not added:
        return step
    return replace(step, microbatches=step.microbatches + tuple(added))


def lockstep_schedule(step: StepWork, ep: int, name: str) -> tuple[StepWork, Schedule] | None:
    """One stage's step as the executor runs it under expert parallelism: the passes of
    its EP groups' joint events (`harts.plan.lockstep`) in their order, each replica's
    own microbatches where it is a member and a zero-token microbatch (a shadow) where it
    is not, so that the k-th passes of a group are one event's and run as a gang (`lower`).
    A peer's shadow of a producer's forward is kept to that producer's backward; a
    chain's backwards follow its last piece, nearest first. The step comes back with the
    shadows added (no tokens), or None where a replica's windows do not nest."""
    next_id = max((m.mb for m in step.microbatches), default=-1) + 1
    added: list[MicrobatchWork] = []
    ranks: list[tuple[tuple[int, int], tuple[PassOp, ...]]] = []

    def shadow(r: int, ev_slot: int) -> int:
        nonlocal next_id
        added.append(_no_rows(next_id, r, ev_slot, len(step.microbatches) + len(added)))
        next_id += 1
        return next_id - 1

    for g in range(step.num_replicas // ep):
        reps = list(range(g * ep, (g + 1) * ep))
        try:
            events = joint_events(step.microbatches, reps, ident=lambda m: m.mb, rows=lambda m: m.tokens)
        except ValueError:
            return None
        ops: dict[int, list[PassOp]] = {r: [] for r in reps}
        held: dict[int, dict[int, int]] = {r: {} for r in reps}  # a replica's open shadows by event key
        for ev in events:
            slot = step[next(iter(ev.members.values()))].slot
            for r in reps:
                mine = ev.members.get(r)
                if ev.kind == "F":
                    if mine is None:
                        mine = held[r][ev.key] = shadow(r, slot)
                    ops[r].append(PassOp("F", (mine,)))
                elif ev.kind == "FB":
                    m = mine if mine is not None else shadow(r, slot)
                    ops[r] += [PassOp("F", (m,)), PassOp("B", (m,))]
                else:
                    ops[r].append(PassOp("B", (mine if mine is not None else held[r].pop(ev.key),)))
        ranks += [((r, 0), tuple(ops[r])) for r in reps]
    padded = replace(step, microbatches=step.microbatches + tuple(added)) if added else step
    sched = Schedule(name, 1, step.num_replicas, tuple(sorted(ranks)))
    sched.validate(padded)
    return padded, sched


def _from_builder(schedule: Schedule, step: StepWork) -> bool:
    try:
        return build_schedule(schedule.name, step, schedule.num_stages) == schedule
    except (KeyError, ValueError):
        return False


def simulate_step(step: StepWork, schedule: Schedule, cost: CostModel, ep_lockstep: bool = True) -> SimResult:
    par = cost.parallel
    real = len(step.microbatches)
    grouped = ep_lockstep and par.ep > 1 and step.num_replicas % par.ep == 0
    # one stage: the executor's events (a schedule given as text, not its builder's, is
    # simulated as given); with a pipeline, or where they cannot be built: padding
    lockstepped = lockstep_schedule(step, par.ep, schedule.name) \
        if grouped and schedule.num_stages == 1 and _from_builder(schedule, step) else None
    if lockstepped is not None:
        step, schedule = lockstepped
    elif grouped:
        padded = pad_ep_groups(step, par.ep)
        if padded is not None and padded is not step:
            # the padded step's schedule comes from the same builder (a schedule given as
            # text, with no builder of its name, is simulated as given)
            try:
                schedule, step = build_schedule(schedule.name, padded, schedule.num_stages), padded
            except (KeyError, ValueError):
                pass
    cost.bind(step)
    program = lower(step, schedule, cost, ep_lockstep)
    lockstep = any(a.gang and a.gang.startswith("ep:") for a in program.actions)
    try:
        trace = execute(program)
    except DeadlockError:
        if not lockstep:
            raise
        # the ranks' patterns line up but their dependencies do not: run unsynchronised
        program = lower(step, schedule, cost, ep_lockstep=False)
        lockstep = False
        trace = execute(program)
    cp, lane = lower_bound(program)
    busy = trace.busy("compute")
    n_ranks = max(1, len(busy))
    makespan = trace.makespan
    bubble = 1.0 - sum(busy.values()) / (n_ranks * makespan) if makespan > 0 else 0.0
    per_stage = [0.0] * schedule.num_stages
    for (_r, s), v in trace.peak_memory.items():
        per_stage[s] = max(per_stage[s], v)
    by_kind: dict[str, float] = {}
    for e in trace.events:
        by_kind[e.kind] = by_kind.get(e.kind, 0.0) + (e.end - e.start)
    return SimResult(
        throughput=step.expanded_tokens / makespan if makespan > 0 else 0.0,
        step_seconds=makespan,
        bubble_fraction=bubble,
        peak_memory_bytes=max(per_stage) if per_stage else 0.0,
        peak_memory_per_stage=tuple(per_stage),
        hbm_capacity_bytes=float(cost.hardware.hbm_capacity_bytes),
        critical_path_seconds=cp,
        busiest_lane_seconds=lane,
        expanded_tokens=step.expanded_tokens,
        computed_tokens=step.total_tokens(),
        num_microbatches=real,
        schedule=schedule,
        program=program,
        trace=trace,
        parallel=cost.parallel,
        cost_model=cost.name,
        ep_lockstep=lockstep,
        busy_by_kind=dict(sorted(by_kind.items())),
        ep_shadows=len(step.microbatches) - real,
    )


def simulate(
    step: StepWork,
    schedule: str,
    model: ModelConfig,
    parallel: ParallelConfig,
    hardware: HardwareProfile,
    cost_model: str = "roofline",
    ep_lockstep: bool = True,
    **cost_kwargs: Any,
) -> SimResult:
    cost = make_cost_model(cost_model, model, parallel, hardware, **cost_kwargs)
    sched = build_schedule(schedule, step, parallel.pp)
    return simulate_step(step, sched, cost, ep_lockstep)
