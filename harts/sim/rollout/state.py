"""The rollout simulator's mutable state: one record per trajectory and per worker, and
the kinds of events (`harts.sim.rollout.engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harts.sim.rollout.types import Segment, TrajectorySpec, Worker

READY, STEP_END, MIG_DONE = 0, 1, 2
NOT_PREEMPTED, PREEMPT_RECOMPUTE, PREEMPT_SWAP = 0, 1, 2
FIRST_CHECK = 512  # live migration: a running turn is re-predicted at 512, 1024, 2048, ... tokens


@dataclass
class TrajState:
    spec: TrajectorySpec
    turn: int = 0
    context: int = 0  # tokens of the trajectory so far (what its KV holds when resident)
    generated: int = 0
    turn_start_generated: int = 0  # generated when the current turn began
    remaining: int = 0  # action tokens left in the running turn
    home: int = -1  # worker holding its KV, -1 none
    assigned: int = -1  # Heddle's planned worker
    ready_at: float = 0.0
    queued_on: int = -1
    migrating: bool = False
    pending_ready: bool = False
    resume: bool = False  # moved while running: re-admitted without a prefill, mid-turn
    next_check: int = FIRST_CHECK  # live migration: tokens of the running turn at the next re-prediction
    done: bool = False
    finish: float = 0.0
    pred: tuple[float, float, float] = (0.0, 0.0, 0.0)  # predicted (tokens, tool s, mean context) left
    preempted: int = 0  # NOT_PREEMPTED, or how its KV was given up mid-turn (PREEMPT_RECOMPUTE / PREEMPT_SWAP)
    swapped: float = 0.0  # KV bytes held in host memory while swapped out
    admitted_at: int = 0  # admission counter value when it last joined a batch (LIFO preemption)
    stale: set[int] = field(default_factory=set)  # prefix cache: workers holding an older copy of its KV
    tool_seen: float = 0.0  # seconds of tool calls observed so far
    tool_calls: int = 0
    segs: list[Segment] = field(default_factory=list)


@dataclass
class WorkerState:
    info: Worker
    kv: dict[int, float] = field(default_factory=dict)
    ctx: dict[int, int] = field(default_factory=dict)  # context tokens a cached entry covers (prefix cache)
    used: float = 0.0
    lru: dict[int, float] = field(default_factory=dict)  # evictable cached entries
    running: list[int] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)
    version: int = 0
    active: bool = False
    decode_start: float = 0.0
    step: float = 0.0
    k: int = 0
    k_res: int = 0  # iterations whose KV growth the chunk reserved (paged KV)
    chunk_start: float = 0.0
    busy: list[list[float]] = field(default_factory=list)
    samples: list[tuple[float, float]] = field(default_factory=list)
    peak: float = 0.0
    # Heddle's view of the trajectories planned here: tid -> (tokens, tool s, mean context, decode fraction)
    load: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)
    sum_x: float = 0.0
    sum_a: float = 0.0
    sum_ac: float = 0.0
    est: float = -1.0  # cached aggregate estimate, -1 stale
    top: tuple[float, float, float, float] | None = None  # cached largest load entry, None stale
    retired: bool = False  # merged into a worker of twice the degree (dynamic MP)
    end: float | None = None  # when it was retired
    reconsider: bool = False  # a worker appeared: offer it the running batch at the next boundary
