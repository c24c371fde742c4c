"""What flows through the rollout simulator: trajectory specs in, a result with
per-trajectory timelines and per-worker busy intervals out (typed, frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


@dataclass(frozen=True)
class TurnSpec:
    input_tokens: int  # prefilled at the turn's start: the prompt (turn 0) or the last tool output
    action_tokens: int  # decoded
    tool_latency_s: float  # the tool call after the action (0 after the last turn)


@dataclass(frozen=True)
class TrajectorySpec:
    tid: int
    group: int  # prompt group
    turns: tuple[TurnSpec, ...]
    hint_turns: float  # the run-length predictor's view of the turn count (true x noise)

    @property
    def generated_tokens(self) -> int:
        return sum(t.action_tokens for t in self.turns)

    @property
    def total_tokens(self) -> int:
        return sum(t.input_tokens + t.action_tokens for t in self.turns)


@dataclass(frozen=True)
class Worker:
    """One inference instance: `degree` GPUs (tensor parallel inside one node), serving
    from `start_s` until `end_s` (None: the step's end). Workers that start later are
    merges of two idle ones (Heddle's dynamic model parallelism); those end at the merge."""

    wid: int
    degree: int
    gpus: tuple[int, ...]
    kv_capacity_bytes: float  # HBM for KV after the weights' share
    start_s: float = 0.0
    end_s: float | None = None


class SegmentKind(StrEnum):
    QUEUE = "queue"  # ready, waiting for admission on `worker`
    PREFILL = "prefill"
    DECODE = "decode"
    TOOL = "tool"
    MIGRATE = "migrate"  # KV moving from `worker` to `to_worker`


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    start: float
    end: float
    worker: int
    turn: int
    tokens_before: int  # tokens generated (decoded) by the trajectory when the segment starts
    tokens_after: int
    to_worker: int = -1
    recomputed: bool = False  # prefill that rebuilt a KV cache lost to eviction or re-routing


@dataclass(frozen=True)
class TrajectoryTimeline:
    tid: int
    segments: tuple[Segment, ...]
    finish_s: float
    generated_tokens: int


@dataclass(frozen=True)
class RolloutResult:
    policy: str
    gpus: int
    workers: tuple[Worker, ...]  # every worker of the step: the initial layout, then merged ones
    makespan_s: float
    generated_tokens: int
    prefill_tokens: int  # including recomputation
    recomputed_tokens: int
    migrations: int
    timelines: tuple[TrajectoryTimeline, ...]
    busy: tuple[tuple[tuple[float, float], ...], ...]  # per worker: merged busy intervals
    kv_peak_bytes: tuple[float, ...]  # per worker
    kv_samples: tuple[tuple[tuple[float, float], ...], ...] = field(repr=False, default=())  # per worker (t, used)
    plan_seconds: float = 0.0
    preemptions: int = 0  # running sequences taken off a full worker mid-turn (paged KV)
    swapped_bytes: float = 0.0  # KV copied to host memory by preemptions (preemption="swap")

    @property
    def merges(self) -> int:
        """Pairs of idle workers merged into one of twice the degree during the step (a
        merge happens at a chunk's end or a KV copy's, so its worker starts after 0)."""
        return sum(1 for w in self.workers if w.start_s > 0.0)

    @property
    def initial_degrees(self) -> tuple[int, ...]:
        """The layout the step starts with (degrees of the workers serving at time 0)."""
        return tuple(w.degree for w in self.workers if w.start_s == 0.0)

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.generated_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def gpu_utilization(self) -> float:
        """Busy GPU-seconds over the GPUs x makespan."""
        if self.makespan_s <= 0:
            return 0.0
        used = sum(w.degree * sum(e - s for s, e in iv) for w, iv in zip(self.workers, self.busy, strict=True))
        return used / (self.gpus * self.makespan_s)

    @property
    def p50_finish_s(self) -> float:
        f = sorted(t.finish_s for t in self.timelines)
        return f[len(f) // 2] if f else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
            "makespan_s": self.makespan_s,
            "gpus": self.gpus,
            "trajectories": len(self.timelines),
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.prefill_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "migrations": self.migrations,
            "preemptions": self.preemptions,
            "gpu_utilization": self.gpu_utilization,
            "p50_finish_s": self.p50_finish_s,
            "worker_degrees": list(self.initial_degrees),
            "merges": self.merges,
            "kv_peak_fraction": max((p / w.kv_capacity_bytes for p, w in zip(self.kv_peak_bytes, self.workers,
                                                                                strict=True)), default=0.0),
            "plan_seconds": self.plan_seconds,
        }
