"""The structure of a step as the simulator prices it and the pipeline executor schedules it:
per-microbatch work, sharing windows, DP placement. Independent of how a planner
represents its plan (`harts.plan.step` converts one).

A microbatch's work is counted once, in the units the cost model prices:
- `tokens`: compact rows it computes (outputs written) through every token-wise layer;
- `kda_rounds`: its sequential packed KDA calls, each with the tokens it runs (own rows plus
  replayed ancestor rows, state only) and the chunk count of its longest sequence;
- `attn_pairs_causal` / `attn_pairs_tree`: (query, key) pairs of full attention, split by the
  kernel that computes them (a chain is plain causal, even when it reads a producer's or an
  ancestor's KV; anything with a fork inside needs the ancestor mask);
- `producer`: the microbatch whose shared-prefix outputs it reads (a consumer), or None.

`expanded_tokens` is credited to the step's update throughput (tokens of the trajectories
whose loss the microbatch completes); it does not change any cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "KDARound",
    "MicrobatchWork",
    "StepWork",
    "Window",
    "chain_pairs",
    "segment_pairs",
]


@dataclass(frozen=True)
class KDARound:
    tokens: int  # rows run in the call, replay included
    max_chunks: int  # chunks of the longest sequence in the call (sequential steps)
    sequences: int = 1


@dataclass(frozen=True)
class MicrobatchWork:
    mb: int
    replica: int
    tokens: int
    kda_rounds: tuple[KDARound, ...]
    attn_pairs_causal: int
    attn_pairs_tree: int = 0
    producer: int | None = None
    slot: int = 0
    order: int = 0
    expanded_tokens: int = 0
    logit_rows: int | None = None  # rows through the LM head; None = tokens
    read_rows: int | None = None  # a producer: its rows its consumers read; None = tokens
    context_rows: int = 0  # a consumer: the rows it reads from its producers' stashes
    # a chain's outer stashes past the rows kept on the device (`outer_stashes_on_host`): a
    # producer whose stash moves to host memory; a reader's context rows read from there
    stash_on_host: bool = False
    host_context_rows: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.attn_pairs_causal < 0 or self.attn_pairs_tree < 0 or self.context_rows < 0:
            raise ValueError(f"microbatch {self.mb}: negative work")
        if self.producer == self.mb:
            raise ValueError(f"microbatch {self.mb} cannot be its own producer")

    @property
    def rows_out(self) -> int:
        return self.tokens if self.logit_rows is None else self.logit_rows

    @property
    def kda_tokens(self) -> int:
        return sum(r.tokens for r in self.kda_rounds)

    @property
    def attn_pairs(self) -> int:
        return self.attn_pairs_causal + self.attn_pairs_tree


@dataclass(frozen=True)
class Window:
    """A sharing window on one replica: the producer (or None for plain microbatches) and its
    consumers in execution order."""

    producer: int | None
    consumers: tuple[int, ...]
    # a chain of windows: `producer` heads a window tree whose consumers include producers
    # of their own; `consumers` then lists every microbatch under it in execution order,
    # `chain` each one's producer as (microbatch, producer) pairs, and each runs its
    # forward, its consumers' windows, then its backward (`schedule.chain_passes`)
    chain: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class StepWork:
    """All microbatches of one step, with the DP replica and order each runs in."""

    microbatches: tuple[MicrobatchWork, ...]
    num_replicas: int
    expanded_tokens: int  # the whole step's expanded tokens (the throughput numerator)
    label: str = ""
    _by_id: dict[int, MicrobatchWork] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_id: dict[int, MicrobatchWork] = {}
        for m in self.microbatches:
            if m.mb in by_id:
                raise ValueError(f"duplicate microbatch id {m.mb}")
            if not 0 <= m.replica < self.num_replicas:
                raise ValueError(f"microbatch {m.mb}: replica {m.replica} not in [0, {self.num_replicas})")
            by_id[m.mb] = m
        for m in self.microbatches:
            if m.producer is not None:
                p = by_id.get(m.producer)
                if p is None:
                    raise ValueError(f"microbatch {m.mb}: unknown producer {m.producer}")
                if p.replica != m.replica:
                    raise ValueError(
                        f"microbatch {m.mb}: producer {p.mb} is on replica {p.replica}, not {m.replica}"
                    )
        object.__setattr__(self, "_by_id", by_id)

    def __getitem__(self, mb: int) -> MicrobatchWork:
        return self._by_id[mb]

    @property
    def producers(self) -> frozenset[int]:
        return frozenset(m.producer for m in self.microbatches if m.producer is not None)

    def consumers_of(self, producer: int) -> tuple[int, ...]:
        return tuple(m.mb for m in self._ordered(producer_filter=producer))

    def _ordered(self, producer_filter: int | None = None) -> list[MicrobatchWork]:
        ms = [m for m in self.microbatches if producer_filter is None or m.producer == producer_filter]
        return sorted(ms, key=lambda m: (m.slot, m.order, m.mb))

    def replica_windows(self, replica: int) -> list[Window]:
        """The replica's microbatches grouped into sharing windows, in execution order.

        A window starts where its first member (producer or consumer) falls in (slot, order)
        order; consecutive plain microbatches share one window (there is nothing to
        separate them).
        """
        ms = [m for m in self._ordered() if m.replica == replica]
        producers = self.producers
        key = {m.mb: (m.slot, m.order, m.mb) for m in ms}
        groups: dict[int | None, list[int]] = {}
        first: dict[int | None, tuple] = {}
        plain_runs: list[tuple[tuple, list[int]]] = []
        def head(m: MicrobatchWork) -> int:  # the first producer of its chain
            while m.producer is not None:
                m = self._by_id[m.producer]
            return m.mb

        chained: set[int] = set()
        for m in ms:
            if m.mb in producers and m.producer is None:
                first[m.mb] = min(first.get(m.mb, key[m.mb]), key[m.mb])
                groups.setdefault(m.mb, [])
            elif m.producer is not None:
                h = head(m)
                if m.mb in producers:
                    chained.add(h)
                groups.setdefault(h, []).append(m.mb)
                first[h] = min(first.get(h, key[m.mb]), key[m.mb])
        items: list[tuple[tuple, Window]] = [
            (first[p], Window(p, tuple(cs), chain=tuple((c, self._by_id[c].producer) for c in cs)
                              if p in chained else ()))
            for p, cs in groups.items() if p is not None
        ]
        # plain microbatches: runs between windows
        for m in ms:
            if m.mb in producers or m.producer is not None:
                continue
            plain_runs.append((key[m.mb], [m.mb]))
        items += [(k, Window(None, tuple(v))) for k, v in plain_runs]
        items.sort(key=lambda kv: kv[0])
        merged: list[Window] = []
        for _, w in items:
            if w.producer is None and merged and merged[-1].producer is None:
                merged[-1] = Window(None, merged[-1].consumers + w.consumers)
            else:
                merged.append(w)
        return merged

    def total_tokens(self) -> int:
        return sum(m.tokens for m in self.microbatches)


def segment_pairs(start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray | int:
    """Ancestor-or-self (query, key) pairs of rows at depths [start, end): sum of (p + 1)."""
    s = np.asarray(start, dtype=np.int64)
    e = np.asarray(end, dtype=np.int64)
    out = (e * (e + 1) - s * (s + 1)) // 2
    return int(out) if out.ndim == 0 else out


def chain_pairs(lengths: Iterable[int]) -> int:
    """Causal pairs of independent sequences of the given lengths."""
    arr = np.asarray(list(lengths), dtype=np.int64)
    return int((arr * (arr + 1) // 2).sum())


def expanded_microbatch(
    mb: int,
    replica: int,
    lengths: Sequence[int],
    chunk_size: int = 64,
    slot: int = 0,
    order: int = 0,
) -> MicrobatchWork:
    """A baseline microbatch: whole trajectories packed as independent causal sequences."""
    arr = np.asarray(lengths, dtype=np.int64)
    total = int(arr.sum())
    chunks = int(-(-arr.max() // chunk_size)) if arr.size else 0
    return MicrobatchWork(
        mb=mb,
        replica=replica,
        tokens=total,
        kda_rounds=(KDARound(total, chunks, int(arr.size)),) if arr.size else (),
        attn_pairs_causal=chain_pairs(arr),
        slot=slot,
        order=order,
        expanded_tokens=total,
    )
