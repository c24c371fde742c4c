"""Heddle's predicted-tail pools (`tail_pools`): a layout of a tail pool, `m` workers of
the highest usable degree, and a bulk pool of workers of a lower degree (the shape of the
known-lengths reference, `compare.known_lengths_schedule`), the tail pool holding at most K
trajectories (its capacity), the ones predicted to have the most decode tokens left.

Only predicted lengths are read (`TrajState.pred`, re-predicted after every turn and at
the re-prediction points of a running turn). At the step's start the K predicted longest
are planned on the tail pool, the rest on the bulk pool (DP placement in each). A bulk
trajectory enters the tail pool when it ranks among the K predicted longest unfinished
trajectories and the pool holds fewer than K: at its next tool call (its KV moves while
the tool runs: `Migration.rehome`) or at a re-prediction point of its running turn
(`Migration.rehome_running`; on a bulk worker every `POOL_CHECK` tokens at least, not only
at 512, 1024, 2048, ...); a pool trajectory that has fallen below 1.5 K leaves at its
next tool call. A tail worker with free batch slots and an empty queue takes queued bulk
turns ranked among the K longest while the pool has room (`pool_fill`). Stealing,
tool-call and live migration stay inside a pool, so the tail pool admits only
predicted-tail trajectories while the bulk has work; bulk workers that fall idle merge
(dynamic MP) into workers of the tail's degree, which join the tail pool.

The layout (`pool_layout`): with `pool_twin` on the policy, the candidate (one degree
everywhere at the top degree, or `m` in `POOL_WORKERS` tail workers for K = m x
`POOL_SIZES` with the bulk at half or a quarter of the top degree) with the shortest
makespan on the step's twin, each simulated under the policy itself; without it
`pool_rule` (`POOL_RULE` tail workers of `POOL_SIZE` each, the bulk at half the top
degree). `TailPools` is mixed into the simulator (`harts.sim.rollout.engine`), whose
trajectories `tr`, workers `ws`, `policy` and `cfg` it reads.
"""

from __future__ import annotations

import numpy as np

from harts.sim.rollout.state import TrajState, WorkerState

POOL_SIZE = 64  # without the twin: tail-pool trajectories per tail worker, K = m x POOL_SIZE
POOL_SIZES = (32, 64)  # the twin's choices of trajectories per tail worker
POOL_WORKERS = (2, 3)  # the twin's choices of m
POOL_RULE = 3  # m without the twin
POOL_CHECK = 256  # with pools, a bulk sequence's running turn is re-predicted at least every this many tokens
POOL_BULK_HALVINGS = 1  # without the twin: the bulk at the top degree / 2 ** this


def pool_rule(degrees: list[int], gpus: int, m: int | None = None, size: int | None = None) -> tuple[list[int], int]:
    """`m` workers of the highest usable degree for K = m x `size`, the other GPUs as
    workers of half that degree (of the next lower usable degree if half is not usable);
    one degree everywhere (K = 0) if no lower degree is usable."""
    m, size = m or POOL_RULE, size or POOL_SIZE
    top = max(degrees)
    lower = [d for d in degrees if d < top and (gpus - m * top) % d == 0]
    if not lower or gpus - m * top <= 0:
        return [top] * (gpus // top), 0
    want = top >> POOL_BULK_HALVINGS
    db = want if want in lower else max(lower)
    return [top] * m + [db] * ((gpus - m * top) // db), m * size


def pool_layout(cfg, specs, cost, gpus: int, degrees: list[int], simulate, policy) -> tuple[list[int], int]:
    """(layout, K): with the policy's `pool_twin` the candidate with the shortest makespan on the step's
    twin (`workload.twin_trajectories`: predicted turn counts, lengths drawn afresh, no true
    length read), each simulated under `policy` itself (pools and every other mechanism):
    one degree everywhere at the top degree (K = 0: no pools), and `m` in `POOL_WORKERS`
    tail workers with K = m x `POOL_SIZES` and the bulk at half or a quarter of the top
    degree; without the twin, `pool_rule`. Memoised per (workload, GPUs, hints, policy)."""
    top = max(degrees)
    if not policy.pool_twin:
        return pool_rule(degrees, gpus)
    key = (cfg, gpus, tuple(degrees), policy, POOL_WORKERS, POOL_SIZES, tuple(s.hint_turns for s in specs),
           tuple(s.turns[0].input_tokens for s in specs))
    from harts.sim.rollout.layout import fastest_layout, pool_candidates, remembered
    from harts.sim.rollout.workload import twin_trajectories

    if (hit := remembered(key)) is not None:
        return hit
    twin = twin_trajectories(cfg, specs)
    bulk = [d for d in (top // 2, top // 4) if d in degrees]
    cands = [(lay, k) for lay, k in pool_candidates(degrees, gpus, len(specs), POOL_WORKERS, POOL_SIZES, bulk)
             if k or lay[0] == top]
    return fastest_layout(key, cands, lambda lay, k: simulate(
        cfg, policy, gpus, specs=twin, cost=cost, plan=(lay, None, k)).makespan_s)


class TailPools:
    def pool_trajs(self) -> int:
        """Unfinished trajectories planned on the tail pool."""
        return sum(len(w.load) for w in self.ws if not w.retired and self.in_tail(w))

    def pool_room(self) -> bool:
        """Whether a trajectory may enter the tail pool: always without `tail_pools` (tail
        isolation's rule), with it while the pool holds fewer than K."""
        return not self.policy.tail_pools or self.pool_trajs() < self.tail_k

    def tail_cut(self) -> float:
        """The K-th largest predicted remaining length among unfinished trajectories (a
        trajectory predicted above it ranks among the K longest)."""
        x = np.array([t.pred[0] for t in self.tr if not t.done])
        if len(x) <= self.tail_k:
            return 0.0
        return float(np.partition(x, len(x) - self.tail_k)[len(x) - self.tail_k - 1])

    def pool_next_check(self, t: TrajState, w: WorkerState) -> int:
        """The running turn's next re-prediction point: twice this one (live migration), or
        with `tail_pools` on a bulk worker `POOL_CHECK` tokens on, if sooner."""
        nxt = 2 * t.next_check
        if self.policy.tail_pools and POOL_CHECK and self.tail_k and not self.in_tail(w):
            nxt = min(nxt, t.next_check + POOL_CHECK)
        return nxt

    def pool_fill(self, w: WorkerState, now: float) -> None:
        """A tail worker with free batch slots and nothing queued takes queued bulk turns
        ranked among the K predicted longest, longest first, while the pool has room; each
        one's KV (if resident) moves over NVLink / InfiniBand, then it queues here."""
        if not (self.policy.tail_pools and self.tail_k and self.in_tail(w)) or w.retired or w.queue:
            return
        slots = self.cfg.max_batch - len(w.running)
        room = self.tail_k - self.pool_trajs()
        if slots <= 0 or room <= 0:
            return
        cut = self.tail_cut()
        cands = [self.tr[i] for v in self.ws if not v.retired and not self.in_tail(v) for i in v.queue]
        cands = sorted((t for t in cands if t.pred[0] > cut and t.assigned == t.queued_on),
                       key=lambda t: (-t.pred[0], t.spec.tid))
        for t in cands[:min(slots, room)]:
            self.take_queued(t, w, now)  # Migration.take_queued
