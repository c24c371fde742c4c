"""Pipeline schedules as data: per-rank ordered lists of forward/backward passes.

A `Schedule` says, for every (DP replica, PP stage) rank, the order in which it runs the
passes of its microbatches; that is all the simulator and the executor need from a policy.
Dependencies are not part of the schedule: they follow from the plan (a forward needs the
previous stage's forward and its producer's forward on this stage; a producer's backward
needs all its consumers' backwards), so one schedule text runs the same anywhere.

Text form (round-trips exactly)::

    # harts-schedule v1
    name consumer-1f1b
    stages 2
    replicas 1
    r0 s0: F0 F1 F2 B1 F3 B2+B0 B3
    r0 s1: F0 F1 B1 F2 B2+B0 F3 B3

`F<m>` is microbatch m's forward (a producer's forward is its PF), `B<m>` its backward,
`B<c>+B<p>` consumer c's backward running its producer p's backward in the same pass.

Builders (registry `SCHEDULES`, keyed by `ScheduleName`):
- `non-overlap`: sharing windows one after another; inside a window, PF, the consumers in
  1F1B, then PB after the last consumer backward. The next window starts on a rank only
  after this window's PB there, which drains the pipeline at every window.
- `overlap-bwd-first`: one 1F1B stream of consumer passes across window boundaries (the next
  window's PF and forwards run while this one's backwards drain); PB is its own backward,
  issued right after the window's last consumer backward, before any further forward.
- `consumer-1f1b`: the same stream, with PB run inside the window's last consumer backward.
In the overlapped builders a PF does not count toward the 1F1B warm-up depth: it is a
forward with no backward soon after it, and counting it would drain the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from harts.config.registry import Registry
from harts.plan.work import StepWork, Window

__all__ = [
    "SCHEDULES",
    "PassOp",
    "Schedule",
    "ScheduleName",
    "build_schedule",
    "known_schedules",
    "register_schedule",
]

HEADER = "# harts-schedule v1"


@dataclass(frozen=True, order=True)
class PassOp:
    """A forward (`kind` F, one microbatch) or backward (B, one microbatch or a fused
    consumer + producer pair, consumer first)."""

    kind: str
    mbs: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"pass kind must be F or B, got {self.kind!r}")
        if not self.mbs or (self.kind == "F" and len(self.mbs) != 1) or len(self.mbs) > 2:
            raise ValueError(f"bad pass {self.kind}{self.mbs}")

    @property
    def fused(self) -> bool:
        return len(self.mbs) == 2

    def text(self) -> str:
        return "+".join(f"{self.kind}{m}" for m in self.mbs)

    @staticmethod
    def parse(token: str) -> PassOp:
        parts = token.split("+")
        kinds = {p[:1] for p in parts}
        if len(kinds) != 1 or not all(p[1:].isdigit() for p in parts):
            raise ValueError(f"bad schedule token {token!r}")
        return PassOp(kinds.pop(), tuple(int(p[1:]) for p in parts))


Rank = tuple[int, int]  # (replica, stage)


@dataclass(frozen=True)
class Schedule:
    name: str
    num_stages: int
    num_replicas: int
    ranks: tuple[tuple[Rank, tuple[PassOp, ...]], ...]  # sorted by rank

    def ops(self, replica: int, stage: int) -> tuple[PassOp, ...]:
        for rank, ops in self.ranks:
            if rank == (replica, stage):
                return ops
        return ()

    def to_text(self) -> str:
        lines = [HEADER, f"name {self.name}", f"stages {self.num_stages}", f"replicas {self.num_replicas}"]
        for (r, s), ops in self.ranks:
            lines.append(f"r{r} s{s}: " + " ".join(op.text() for op in ops))
        return "\n".join(lines) + "\n"

    @staticmethod
    def from_text(text: str) -> Schedule:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if not lines or lines[0] != HEADER:
            raise ValueError(f"schedule text must start with {HEADER!r}")
        meta: dict[str, str] = {}
        ranks: list[tuple[Rank, tuple[PassOp, ...]]] = []
        for ln in lines[1:]:
            if ln.startswith("r") and ":" in ln:
                head, _, body = ln.partition(":")
                rs = head.split()
                if len(rs) != 2 or not rs[0][1:].isdigit() or not rs[1][1:].isdigit() or rs[1][0] != "s":
                    raise ValueError(f"bad rank line {ln!r}")
                ranks.append(((int(rs[0][1:]), int(rs[1][1:])), tuple(PassOp.parse(t) for t in body.split())))
            else:
                key, _, value = ln.partition(" ")
                meta[key] = value.strip()
        try:
            return Schedule(meta["name"], int(meta["stages"]), int(meta["replicas"]), tuple(sorted(ranks)))
        except KeyError as err:
            raise ValueError(f"schedule text lacks {err.args[0]!r}") from err

    def validate(self, step: StepWork) -> None:
        """Every microbatch runs F then B exactly once on each stage of its replica; a fused
        backward pairs a consumer with its own producer and is that window's last consumer
        backward on the rank."""
        expected: dict[Rank, set[int]] = {}
        for m in step.microbatches:
            for s in range(self.num_stages):
                expected.setdefault((m.replica, s), set()).add(m.mb)
        seen_ranks = {rank for rank, _ in self.ranks}
        for rank in expected:
            if rank not in seen_ranks:
                raise ValueError(f"schedule has no list for rank r{rank[0]} s{rank[1]}")
        for rank, ops in self.ranks:
            fwd: list[int] = []
            bwd: list[int] = []
            for op in ops:
                if op.kind == "F":
                    fwd.append(op.mbs[0])
                    continue
                for m in op.mbs:
                    if m not in fwd:
                        raise ValueError(f"r{rank[0]} s{rank[1]}: B{m} before F{m}")
                    bwd.append(m)
                if op.fused:
                    c, p = op.mbs
                    if step[c].producer != p:
                        raise ValueError(f"r{rank[0]} s{rank[1]}: fused B{c}+B{p} but {p} is not {c}'s producer")
                    for other in step.consumers_of(p):
                        if other != c and other not in bwd:
                            raise ValueError(f"r{rank[0]} s{rank[1]}: B{c}+B{p} before consumer B{other}")
            want = expected.get(rank, set())
            for name, got in (("F", fwd), ("B", bwd)):
                if sorted(got) != sorted(want):
                    raise ValueError(
                        f"r{rank[0]} s{rank[1]}: {name} passes {sorted(got)} != microbatches {sorted(want)}"
                    )


# ---- builders -------------------------------------------------------------------------


def _one_f_one_b(consumers: list[int], stages: int, stage: int) -> list[PassOp]:
    """Stage `stage` runs min(stages - stage, n) forwards, then alternates B, F, then drains."""
    warm = min(stages - stage, len(consumers))
    out = [PassOp("F", (m,)) for m in consumers[:warm]]
    for i, m in enumerate(consumers):
        out.append(PassOp("B", (m,)))
        if warm + i < len(consumers):
            out.append(PassOp("F", (consumers[warm + i],)))
    return out


def chain_passes(w: Window) -> list[PassOp]:
    """A chain of windows run depth-first: each microbatch's forward, its consumers'
    windows, then its backward (a producer's backward after its last consumer's). The same
    list on every stage: no 1F1B inside a chain, whose pieces depend on each other."""
    kids: dict[int, list[int]] = {}
    for c, p in w.chain:
        kids.setdefault(p, []).append(c)
    out: list[PassOp] = []

    def visit(m: int) -> None:
        out.append(PassOp("F", (m,)))
        for c in kids.get(m, ()):
            visit(c)
        out.append(PassOp("B", (m,)))

    visit(w.producer)
    return out


def _non_overlap(windows: list[Window], stages: int, stage: int) -> list[PassOp]:
    out: list[PassOp] = []
    for w in windows:
        if w.chain:
            out += chain_passes(w)
            continue
        if w.producer is not None:
            out.append(PassOp("F", (w.producer,)))
        out += _one_f_one_b(list(w.consumers), stages, stage)
        if w.producer is not None:
            out.append(PassOp("B", (w.producer,)))
    return out


def _overlapped(windows: list[Window], stages: int, stage: int, fuse: bool) -> list[PassOp]:
    # a chain of windows drains the stream before it and runs depth-first (`chain_passes`)
    out: list[PassOp] = []
    run: list[Window] = []
    for w in windows:
        if w.chain:
            out += _overlapped_run(run, stages, stage, fuse) + chain_passes(w)
            run = []
        else:
            run.append(w)
    return out + _overlapped_run(run, stages, stage, fuse)


def _overlapped_run(windows: list[Window], stages: int, stage: int, fuse: bool) -> list[PassOp]:
    # forward stream of (is_consumer, pass); backward stream with PB separate or fused
    fwd: list[tuple[bool, PassOp]] = []
    bwd: list[PassOp] = []
    pb: set[PassOp] = set()
    for w in windows:
        cs = list(w.consumers)
        if w.producer is not None:
            fwd.append((False, PassOp("F", (w.producer,))))
        fwd += [(True, PassOp("F", (c,))) for c in cs]
        if w.producer is None:
            bwd += [PassOp("B", (c,)) for c in cs]
        elif fuse and cs:
            bwd += [PassOp("B", (c,)) for c in cs[:-1]] + [PassOp("B", (cs[-1], w.producer))]
        else:
            bwd += [PassOp("B", (c,)) for c in cs] + [PassOp("B", (w.producer,))]
            pb.add(bwd[-1])
    out: list[PassOp] = []
    done_f: set[int] = set()
    fi = bi = 0

    def forward_unit() -> None:
        # the PFs up to and including the next consumer forward
        nonlocal fi
        while fi < len(fwd):
            is_consumer, op = fwd[fi]
            fi += 1
            out.append(op)
            done_f.add(op.mbs[0])
            if is_consumer:
                return

    def ready(op: PassOp) -> bool:
        return all(m in done_f for m in op.mbs)

    for _ in range(min(stages - stage, sum(1 for c, _ in fwd if c))):
        forward_unit()
    while bi < len(bwd):
        if ready(bwd[bi]):
            out.append(bwd[bi])
            bi += 1
            # backward-first: a separate PB goes right after its window's last consumer
            if bi < len(bwd) and bwd[bi] in pb and ready(bwd[bi]):
                out.append(bwd[bi])
                bi += 1
        elif fi >= len(fwd):
            raise AssertionError("schedule builder: a backward whose forward never runs")
        forward_unit()
    while fi < len(fwd):
        forward_unit()
    return out


class ScheduleName(StrEnum):
    NON_OVERLAP = "non-overlap"
    OVERLAP_BWD_FIRST = "overlap-bwd-first"
    CONSUMER_1F1B = "consumer-1f1b"


ScheduleBuilder = Callable[[list[Window], int, int], list[PassOp]]
SCHEDULES: Registry[ScheduleName, ScheduleBuilder] = Registry(
    "schedule", ScheduleName, KeyError, duplicate_error=ValueError)


def register_schedule(name: ScheduleName, builder: ScheduleBuilder) -> None:
    SCHEDULES.register(name, builder)


register_schedule(ScheduleName.NON_OVERLAP, _non_overlap)
register_schedule(ScheduleName.OVERLAP_BWD_FIRST, lambda w, p, s: _overlapped(w, p, s, fuse=False))
register_schedule(ScheduleName.CONSUMER_1F1B, lambda w, p, s: _overlapped(w, p, s, fuse=True))


def known_schedules() -> list[str]:
    return SCHEDULES.known()


def build_schedule(name: str, step: StepWork, num_stages: int) -> Schedule:
    builder = SCHEDULES.get(name)
    ranks: list[tuple[Rank, tuple[PassOp, ...]]] = []
    for r in range(step.num_replicas):
        windows = step.replica_windows(r)
        for s in range(num_stages):
            ranks.append(((r, s), tuple(builder(windows, num_stages, s))))
    sched = Schedule(ScheduleName(name).value, num_stages, step.num_replicas, tuple(ranks))
    sched.validate(step)
    return sched


