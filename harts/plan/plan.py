"""The step plan: one training step's microbatches, placed on data-parallel replicas.

One representation is consumed by the simulator and by the tree executor, so "simulated
vs measured" is a diff of two traces of the same plan. A plan refers to a `RolloutForest`
by node and trajectory ids (it stores none of the tokens); `Plan.validate(forest)` checks
it against the forest it was made for.

Modes
- ``expanded``: the baseline. Every microbatch holds whole trajectories, each executed as
  its own copy (`Microbatch.trajectories`); `pieces` and `context` are empty, except in
  the chain of windows of a trajectory longer than the budget (its copy's path cut into
  pieces, the last one owning it).
- ``tree``: microbatches hold compact rows of the forest. `pieces` are the rows a
  microbatch *computes* (outputs written), as `Piece(node, start, end)`: the rows of node
  `node` at offsets `[start, end)` inside the node, i.e. depths
  `[node_start + start, node_start + end)`. Most pieces are whole nodes
  (`start = 0`, `end = node_length`); planners may cut a long node into pieces.
  A row can be computed by several microbatches (prior-art planners recompute a split
  tree's shared path in every part); `executed_tokens` counts every computation.

Targets. `Microbatch.trajectories` are the trajectories whose targets the microbatch owns:
it computes the loss of every (trajectory, position) target of each of them, so it needs
every row on the trajectory's root path, either computed itself or read from its producer.
Each trajectory is owned by exactly one microbatch, so every expanded target is covered
exactly once.

Sharing windows (tree mode). A *producer* microbatch computes a shared prefix once for
*consumer* microbatches: a consumer names its `producer` and lists as `context` the
producer pieces it reads (KV, KDA boundary states and conv windows of those rows; the
executor computes the loss term of a target on such a row in the producer that computed
it). Producer and consumers run on the same replica: the producer's forward runs first,
each consumer runs forward and backward (accumulating gradients into the producer's
outputs), and the producer's backward runs right after its last consumer's backward. The
window lasts from the producer to its last consumer; windows on a replica do not cross.
A consumer may be a producer itself (a *chain of windows*: a trajectory longer than the
budget cut into pieces, `harts.plan.planners.chains`): its consumers read the rows it
computes and those it reads (the executor takes each from the producer up the chain that
computed it, `harts.exec.stash.ChainStash`), its window nests inside its producer's, and
its backward runs after its own window, before its producer's (`window_last`). A producer runs
before its consumers, so there are no dependency cycles. Other microbatches may run
inside a window; they pay its retained memory too.

Placement. `replica` is the data-parallel rank; `order` the position in the replica's
execution sequence (0, 1, ...); `slot` aligns microbatches across replicas so their
collectives line up: a slot holds at most one non-producer microbatch per replica, slots
never decrease along a replica's order, and a producer carries the slot of the
microbatch that runs right after it (its forward runs at the start of that slot). For
load metrics a producer's cost is split: `forward_fraction` of it lands in its own slot,
the rest in its last consumer's slot (see `harts.plan.metrics`).

Budget. `microbatch_tokens` bounds activation memory in token units:
`executed_tokens + producer_retention * (rows of the innermost open window's producer
that its consumers read)` for every microbatch (0 outside windows; in a chain the outer
producers' stashes are not charged, `memory_tokens`).
`producer_retention` (default 0.35, see `DEFAULT_PRODUCER_RETENTION`) is the memory a
retained producer row costs relative to a row being computed. A producer row no consumer
reads (a producer may own trajectories of its own) keeps no stash, and its saved tensors
wait in host memory with the rest of the producer's (on CUDA, `harts.exec.offload`), so
it is not charged.

Cost. `Microbatch.cost` is the load of the microbatch under `Plan.cost_model` (a
`harts.config.costs` load-model spec): `microbatch_overhead + sum of segment costs of its pieces`
(expanded: one segment `[0, length)` per trajectory copy).

Validation. `Plan.validate(forest, budget=None, cost_model=None)` raises ValueError
naming the first broken invariant: the plan was made for this forest (`Plan.forest`, a
size digest); ids equal positions; replicas, orders and slots as above; every trajectory
owned by exactly one microbatch; every row a microbatch needs (the ancestors of its own
rows and the root paths of its trajectories) computed by it or read as context, every
context piece computed by its producer and actually needed, and every computed row needed
by the microbatch itself or by a consumer; producers on the consumer's replica and
earlier in its order, one level deep, windows disjoint; the stored token counts exact;
the budget; and, given a cost model, the stored costs.

JSON. `Plan.save`/`Plan.load` (and `to_json`/`from_json`) round-trip exactly: floats are
written with `repr`. The file has one line per microbatch so two plans diff line by line.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

from harts.config.plan import DEFAULT_PRODUCER_RETENTION
from harts.plan.plan_checks import chain_roots, check_costs, validate_expanded_chains
from harts.tree.forest import RolloutForest

FORMAT = "harts-plan/1"


class PlanMode(StrEnum):
    EXPANDED = "expanded"
    TREE = "tree"


class Role(StrEnum):
    STANDALONE = "standalone"
    PRODUCER = "producer"
    CONSUMER = "consumer"


class Piece(NamedTuple):
    """Rows of `node` at offsets [start, end) inside the node (tree mode)."""

    node: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Microbatch:
    """One microbatch; `id` equals its index in `Plan.microbatches`."""

    id: int
    replica: int
    slot: int
    order: int
    trajectories: tuple[int, ...]
    pieces: tuple[Piece, ...] = ()
    context: tuple[Piece, ...] = ()
    producer: int | None = None
    executed_tokens: int = 0
    expanded_tokens: int = 0
    cost: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "replica": self.replica,
            "slot": self.slot,
            "order": self.order,
            "producer": self.producer,
            "executed_tokens": self.executed_tokens,
            "expanded_tokens": self.expanded_tokens,
            "cost": self.cost,
            "trajectories": list(self.trajectories),
            "pieces": [list(p) for p in self.pieces],
            "context": [list(p) for p in self.context],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Microbatch:
        return cls(
            id=int(d["id"]),
            replica=int(d["replica"]),
            slot=int(d["slot"]),
            order=int(d["order"]),
            trajectories=tuple(int(t) for t in d["trajectories"]),
            pieces=tuple(Piece(int(a), int(b), int(c)) for a, b, c in d.get("pieces", ())),
            context=tuple(Piece(int(a), int(b), int(c)) for a, b, c in d.get("context", ())),
            producer=None if d.get("producer") is None else int(d["producer"]),
            executed_tokens=int(d["executed_tokens"]),
            expanded_tokens=int(d["expanded_tokens"]),
            cost=float(d["cost"]),
        )


def forest_digest(forest: RolloutForest) -> dict[str, int]:
    """Sizes that identify the forest a plan was made for (checked by `validate`)."""
    return {
        "nodes": forest.num_nodes,
        "trajectories": forest.num_trajectories,
        "expanded_tokens": forest.expanded_tokens,
        "compact_tokens": forest.compact_tokens,
    }


@dataclass(frozen=True)
class Plan:
    """A step plan (see the module docstring). `info` holds planner notes (JSON-able);
    `plan_seconds` is the planner's wall time."""

    mode: PlanMode
    planner: str
    dp: int
    microbatch_tokens: int
    microbatches: tuple[Microbatch, ...]
    producer_retention: float = DEFAULT_PRODUCER_RETENTION
    cost_model: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    plan_seconds: float = 0.0
    chain_retention: float | None = None
    forest: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    # ---- structure --------------------------------------------------------------------

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def num_slots(self) -> int:
        return 1 + max((mb.slot for mb in self.microbatches), default=-1)

    @property
    def executed_tokens(self) -> int:
        return sum(mb.executed_tokens for mb in self.microbatches)

    @property
    def expanded_tokens(self) -> int:
        return sum(mb.expanded_tokens for mb in self.microbatches)

    def consumers(self) -> dict[int, list[int]]:
        """Producer id -> its consumers' ids in execution order."""
        out: dict[int, list[int]] = defaultdict(list)
        for mb in sorted(self.microbatches, key=lambda m: m.order):
            if mb.producer is not None:
                out[mb.producer].append(mb.id)
        return dict(out)

    def role(self, mb_id: int) -> Role:
        mb = self.microbatches[mb_id]
        if mb.producer is not None:
            return Role.CONSUMER
        if any(m.producer == mb_id for m in self.microbatches):
            return Role.PRODUCER
        return Role.STANDALONE

    def replica_sequence(self, replica: int) -> list[Microbatch]:
        """The replica's microbatches in execution order."""
        return sorted((m for m in self.microbatches if m.replica == replica), key=lambda m: m.order)

    def window_last(self) -> dict[int, int]:
        """Producer id -> the order of the last microbatch its window holds: its last
        consumer's, or, for a chain, the last of its consumers' own windows (a producer's
        backward runs after every consumer's, and a consumer that is a producer itself
        runs its backward after its own window)."""
        cons = self.consumers()
        last: dict[int, int] = {}

        def end(p: int) -> int:
            if p not in last:
                last[p] = max(end(c) if c in cons else self.microbatches[c].order for c in cons[p])
            return last[p]

        for p in sorted(cons, key=lambda i: -self.microbatches[i].order):
            end(p)
        return last

    def memory_tokens(self) -> list[float]:
        """Activation memory (token units) each microbatch needs, retained windows included
        (`harts.plan.memory.memory_tokens`)."""
        from harts.plan.memory import memory_tokens

        return memory_tokens(self)

    def read_rows(self, producer: int) -> int:
        """How many of the rows `producer` computes its consumers read as context
        (`harts.plan.memory.read_rows`)."""
        from harts.plan.memory import read_rows

        return read_rows(self, producer)

    # ---- validation -------------------------------------------------------------------

    def validate(self, forest: RolloutForest, budget: int | None = None, cost_model: Any = None) -> None:
        """Raise ValueError naming the first broken invariant (see the module docstring).

        `budget` defaults to the plan's `microbatch_tokens`; `cost_model` (a
        `harts.config.costs.LoadModel`), when given, re-prices every microbatch and checks
        the stored costs."""
        _validate(self, forest, self.microbatch_tokens if budget is None else budget, cost_model)

    # ---- JSON -------------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "mode": self.mode.value,
            "planner": self.planner,
            "dp": self.dp,
            "microbatch_tokens": self.microbatch_tokens,
            "producer_retention": self.producer_retention,
            "chain_retention": self.chain_retention,
            "cost_model": self.cost_model,
            "seed": self.seed,
            "plan_seconds": self.plan_seconds,
            "forest": self.forest,
            "info": self.info,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.header(), "microbatches": [mb.to_dict() for mb in self.microbatches]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a plan file: format {d.get('format')!r}, expected {FORMAT!r}")
        try:
            mode = PlanMode(d["mode"])
        except ValueError:
            raise ValueError(f"plan mode {d['mode']!r}: expected one of {[m.value for m in PlanMode]}") from None
        return cls(
            mode=mode,
            planner=str(d["planner"]),
            dp=int(d["dp"]),
            microbatch_tokens=int(d["microbatch_tokens"]),
            microbatches=tuple(Microbatch.from_dict(m) for m in d["microbatches"]),
            producer_retention=float(d["producer_retention"]),
            chain_retention=None if d.get("chain_retention") is None else float(d["chain_retention"]),
            cost_model=dict(d["cost_model"]),
            seed=int(d["seed"]),
            plan_seconds=float(d["plan_seconds"]),
            forest={k: int(v) for k, v in d["forest"].items()},
            info=dict(d["info"]),
        )

    def to_json(self) -> str:
        """JSON with one line per microbatch (diff-friendly); exact for every float."""
        head = self.header()
        lines = ["{"]
        for k, v in head.items():
            lines.append(f" {json.dumps(k)}: {json.dumps(v, allow_nan=False, sort_keys=True)},")
        lines.append(' "microbatches": [')
        mbs = [json.dumps(mb.to_dict(), allow_nan=False) for mb in self.microbatches]
        lines += [f"  {m}," for m in mbs[:-1]] + [f"  {m}" for m in mbs[-1:]]
        lines += [" ]", "}"]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"plan JSON: {err}") from None
        if not isinstance(d, dict):
            raise ValueError("plan JSON: expected an object")
        try:
            return cls.from_dict(d)
        except (KeyError, TypeError) as err:
            raise ValueError(f"plan JSON: missing or malformed field {err}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())


# ---- validation ---------------------------------------------------------------------------


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    intervals.sort()
    out: list[list[int]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covers(merged: list[tuple[int, int]] | None, lo: int, hi: int) -> bool:
    """Whether the merged intervals cover [lo, hi)."""
    if hi <= lo:
        return True
    if not merged:
        return False
    for a, b in merged:
        if a <= lo < b:
            return hi <= b
    return False


def _validate(plan: Plan, forest: RolloutForest, budget: int, cost_model: Any) -> None:
    def bad(msg: str) -> None:
        raise ValueError(f"plan ({plan.planner}, {plan.mode.value}): {msg}")

    if plan.forest and plan.forest != forest_digest(forest):
        bad(f"made for a different forest {plan.forest}, got {forest_digest(forest)}")
    if plan.dp < 1:
        bad(f"dp must be >= 1, got {plan.dp}")
    if budget < 1:
        bad(f"budget must be >= 1, got {budget}")
    for name in ("producer_retention", "chain_retention"):
        if getattr(plan, name) is not None and not getattr(plan, name) >= 0:
            bad(f"{name} must be >= 0, got {getattr(plan, name)}")
    mbs = plan.microbatches
    n = len(mbs)
    if n == 0:
        bad("no microbatches")
    num_traj = forest.num_trajectories
    traj_len = forest.traj_length.tolist()

    # ids, placement, order
    per_replica: dict[int, list[Microbatch]] = defaultdict(list)
    for i, mb in enumerate(mbs):
        if mb.id != i:
            bad(f"microbatch at index {i} has id {mb.id}; ids must equal positions")
        if not 0 <= mb.replica < plan.dp:
            bad(f"microbatch {i}: replica {mb.replica} outside [0, {plan.dp})")
        if mb.slot < 0:
            bad(f"microbatch {i}: negative slot {mb.slot}")
        per_replica[mb.replica].append(mb)
    is_producer = [False] * n
    consumers: dict[int, list[int]] = defaultdict(list)
    for mb in mbs:
        if mb.producer is not None:
            p = mb.producer
            if not 0 <= p < n or p == mb.id:
                bad(f"microbatch {mb.id}: producer {p} is not another microbatch")
            if mbs[p].replica != mb.replica:
                bad(f"microbatch {mb.id}: producer {p} is on replica {mbs[p].replica}, "
                    f"the consumer on replica {mb.replica}")
            if mbs[p].order >= mb.order:
                bad(f"microbatch {mb.id}: producer {p} is not scheduled before it "
                    f"(orders {mbs[p].order} >= {mb.order})")
            is_producer[p] = True
            consumers[p].append(mb.id)
    for r, seq in per_replica.items():
        seq.sort(key=lambda m: m.order)
        if [m.order for m in seq] != list(range(len(seq))):
            bad(f"replica {r}: orders must be 0..{len(seq) - 1}, got {[m.order for m in seq]}")
        taken: dict[int, int] = {}
        for k, m in enumerate(seq):
            if k and m.slot < seq[k - 1].slot:
                bad(f"replica {r}: slot decreases along the order at microbatch {m.id}")
            if is_producer[m.id]:
                if k + 1 >= len(seq) or seq[k + 1].slot != m.slot:
                    bad(f"producer {m.id} must carry the slot of the microbatch after it")
                continue
            if m.slot in taken:
                bad(f"replica {r}, slot {m.slot}: microbatches {taken[m.slot]} and {m.id} "
                    "(a slot holds one non-producer microbatch per replica)")
            taken[m.slot] = m.id
    window_last = plan.window_last()
    for r in per_replica:
        # windows are disjoint or nested as a chain (a consumer's own window inside its
        # producer's), never crossing
        windows = sorted((mbs[p].order, -window_last[p], p) for p in consumers if mbs[p].replica == r)
        stack: list[tuple[int, int, int]] = []
        for a1, neg_b1, p1 in windows:
            b1 = -neg_b1
            while stack and stack[-1][1] < a1:
                stack.pop()
            if stack and (b1 > stack[-1][1] or mbs[p1].producer is None):
                a0, b0, _ = stack[-1]
                bad(f"replica {r}: sharing windows overlap (orders {a0}..{b0} and {a1}..{b1})")
            stack.append((a1, b1, p1))

    # target coverage
    owner = [-1] * num_traj
    for mb in mbs:
        if not mb.trajectories and not mb.pieces:
            bad(f"microbatch {mb.id} is empty")
        for t in mb.trajectories:
            if not 0 <= t < num_traj:
                bad(f"microbatch {mb.id}: trajectory {t} outside [0, {num_traj})")
            if owner[t] >= 0:
                bad(f"trajectory {t} ({forest.traj_ids[t]!r}) owned by microbatches "
                    f"{owner[t]} and {mb.id}: its targets would be counted twice")
            owner[t] = mb.id
        exp = sum(traj_len[t] for t in mb.trajectories)
        if exp != mb.expanded_tokens:
            bad(f"microbatch {mb.id}: expanded_tokens {mb.expanded_tokens} != {exp}")
    missing = [t for t in range(num_traj) if owner[t] < 0]
    if missing:
        bad(f"{len(missing)} trajectories are owned by no microbatch, e.g. "
            f"{missing[0]} ({forest.traj_ids[missing[0]]!r}): their targets are not covered")

    if plan.mode == PlanMode.EXPANDED:
        chain_of = chain_roots(plan)
        for mb in mbs:
            if mb.id in chain_of:
                continue
            if mb.context:
                bad(f"microbatch {mb.id}: expanded microbatches hold trajectories, not pieces")
            if mb.executed_tokens != mb.expanded_tokens:
                bad(f"microbatch {mb.id}: executed_tokens {mb.executed_tokens} != the "
                    f"{mb.expanded_tokens} tokens of its trajectory copies")
        if chain_of:
            validate_expanded_chains(plan, forest, chain_of, bad)
            _validate_rows(plan, forest, consumers, bad, only=set(chain_of))
    else:
        _validate_rows(plan, forest, consumers, bad)

    mem = plan.memory_tokens()
    for mb in mbs:
        if mem[mb.id] > budget:
            extra = mem[mb.id] - mb.executed_tokens
            bad(f"microbatch {mb.id}: needs {mem[mb.id]:.0f} tokens of memory "
                f"({mb.executed_tokens} executed + {extra:.0f} retained by a producer) "
                f"> budget {budget}")
    if cost_model is not None:
        check_costs(plan, forest, cost_model, bad)


def _validate_rows(plan: Plan, forest: RolloutForest, consumers: dict[int, list[int]], bad,
                   only: set[int] | None = None) -> None:
    mbs = plan.microbatches
    if only is not None:
        mbs = tuple(m for m in mbs if m.id in only)
    num_nodes = forest.num_nodes
    length = forest.node_length.tolist()
    parent = forest.node_parent.tolist()
    traj_node = forest.traj_node.tolist()

    def intervals(mb: Microbatch, pieces: tuple[Piece, ...], what: str) -> dict[int, list[tuple[int, int]]]:
        by_node: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for v, a, b in pieces:
            if not 0 <= v < num_nodes:
                bad(f"microbatch {mb.id}: {what} node {v} outside [0, {num_nodes})")
            if not 0 <= a < b <= length[v]:
                bad(f"microbatch {mb.id}: {what} piece ({v}, {a}, {b}) outside node {v} "
                    f"of length {length[v]}")
            by_node[v].append((a, b))
        for v, iv in by_node.items():
            iv.sort()
            for (_, b0), (a1, _) in zip(iv, iv[1:], strict=False):
                if a1 < b0:
                    bad(f"microbatch {mb.id}: {what} pieces overlap in node {v}")
        return by_node

    own = {mb.id: intervals(mb, mb.pieces, "computed") for mb in mbs}
    for mb in mbs:
        if not mb.pieces:
            bad(f"microbatch {mb.id}: a tree-mode microbatch must compute rows")
        executed = sum(b - a for _, a, b in mb.pieces)
        if executed != mb.executed_tokens:
            bad(f"microbatch {mb.id}: executed_tokens {mb.executed_tokens} != {executed} computed rows")

    # rows each microbatch needs: node -> prefix length [0, need) that must be available
    def needs(mb: Microbatch, pieces: tuple[Piece, ...]) -> dict[int, int]:
        need: dict[int, int] = {}

        def full_up(v: int) -> None:
            while v >= 0 and need.get(v, -1) != length[v]:
                need[v] = length[v]
                v = parent[v]

        for t in mb.trajectories:
            full_up(traj_node[t])
        for v, a, _ in pieces:
            if a > need.get(v, 0):
                need[v] = a
            full_up(parent[v])
        return need

    ctx_of: dict[int, dict[int, list[tuple[int, int]]]] = {
        mb.id: intervals(mb, mb.context, "context") for mb in mbs}
    for mb in mbs:
        ctx = ctx_of[mb.id]
        if mb.context and mb.producer is None:
            bad(f"microbatch {mb.id} reads context but names no producer")
        if mb.producer is not None and not mb.context:
            bad(f"microbatch {mb.id} names producer {mb.producer} but reads no context from it")
        # a consumer reads what its producer computes and, in a chain, what it reads itself
        prod_rows = own[mb.producer] if mb.producer is not None else {}
        prod_ctx = ctx_of[mb.producer] if mb.producer is not None else {}
        for v, iv in ctx.items():
            merged = _merge(list(prod_rows.get(v, [])) + list(prod_ctx.get(v, [])))
            for a, b in iv:
                if not _covers(merged, a, b):
                    bad(f"microbatch {mb.id}: context ({v}, {a}, {b}) is not computed by "
                        f"its producer {mb.producer} (nor read by it)")
                if any(a < b2 and a2 < b for a2, b2 in own[mb.id].get(v, ())):
                    bad(f"microbatch {mb.id}: node {v} rows both computed and read as context")
        need = needs(mb, mb.pieces)
        avail: dict[int, list[tuple[int, int]]] = {}
        for v, p in need.items():
            if v not in avail:
                avail[v] = _merge(list(own[mb.id].get(v, [])) + list(ctx.get(v, [])))
            if not _covers(avail[v], 0, p):
                bad(f"microbatch {mb.id} needs rows [0, {p}) of node {v} (ancestors of its rows or of its "
                    "trajectories' targets) but neither computes them nor reads them from a producer")
        # context must be used
        for v, iv in ctx.items():
            for a, b in iv:
                if b > need.get(v, 0):
                    bad(f"microbatch {mb.id}: context ({v}, {a}, {b}) is read but not needed")
    # computed rows must be needed by the microbatch itself or by one of its consumers
    for mb in mbs:
        self_need = needs(mb, mb.pieces)
        read: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for c in consumers.get(mb.id, ()):
            for v, iv in ctx_of[c].items():
                read[v].extend(iv)
        merged_read = {v: _merge(iv) for v, iv in read.items()}
        for v, a, b in mb.pieces:
            if b <= self_need.get(v, 0):
                continue
            lo = max(a, min(b, self_need.get(v, 0)))
            if not _covers(merged_read.get(v), lo, b):
                bad(f"microbatch {mb.id} computes rows [{lo}, {b}) of node {v} that neither "
                    "its trajectories nor its consumers need")
