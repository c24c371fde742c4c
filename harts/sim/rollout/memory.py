"""Paged KV memory in the rollout simulator: prefix-cache copies and their LRU eviction,
each chunk's KV growth, and preemption of a running sequence when a worker runs out
(recompute or swap), including Heddle's priority preemption.

`KVMemory` is mixed into the simulator (`harts.sim.rollout.engine`), whose state it reads
and changes: the trajectories `tr`, the workers `ws`, the policy, the prices `cost` and,
through `set_kv`, the KV accounting.
"""

from __future__ import annotations

from harts.sim.rollout.state import PREEMPT_RECOMPUTE, PREEMPT_SWAP, TrajState, WorkerState

PREEMPT_RATIO = 4.0  # priority preemption: a waiting sequence displaces one predicted to need under 1/4 of its work


class KVMemory:
    def drop_stale(self, t: TrajState, now: float) -> None:
        """Free the older copies a prefix cache still holds of a finished trajectory."""
        for o in t.stale:
            self.set_kv(self.ws[o], t.spec.tid, 0.0, now)
        t.stale.clear()

    def evict(self, w: WorkerState, v: int, now: float) -> None:
        """Evict the cached (not running) KV entry of trajectory `v` from `w`."""
        self.set_kv(w, v, 0.0, now)
        w.ctx.pop(v, None)
        t = self.tr[v]
        if t.home == w.info.wid:
            t.home = -1
        t.stale.discard(w.info.wid)

    def evict_for(self, w: WorkerState, extra: float, limit: float, now: float, keep: int = -1) -> bool:
        """Evict least-recently-used cached entries of `w` (not `keep`) until `extra` more
        bytes fit under `limit`; False (nothing evicted) if even evicting all would not do."""
        if w.used + extra <= limit:
            return True
        evictable = sorted((ts, v) for v, ts in w.lru.items() if v != keep)
        if w.used + extra - sum(w.kv[v] for _, v in evictable) > limit:
            return False
        for _, v in evictable:
            if w.used + extra <= limit:
                break
            self.evict(w, v, now)
        return True

    def chunk_length(self, w: WorkerState, now: float, stall: list[float]) -> int:
        """Iterations of the next chunk: until the first running turn ends (or reaches a
        re-prediction point); with paged KV also while the batch's growing KV fits, after
        evicting cached entries, else a running sequence is preempted. Reserves the chunk's
        KV growth."""
        while True:
            k = min(self.tr[i].remaining for i in w.running)
            if self.policy.live_migration:  # stop at the next re-prediction point of a running turn
                k = min(k, min(self.tr[i].next_check - (self.tr[i].generated - self.tr[i].turn_start_generated)
                               for i in w.running))
            if not self.paged:
                return k
            per_it = len(w.running) * self.cost.kv_bytes_per_token
            cap = w.info.kv_capacity_bytes
            if per_it <= 0:
                return k
            if w.used + k * per_it > cap:
                self.evict_upto(w, w.used + k * per_it - cap, now)
            fit = int((cap - w.used) / per_it * (1 + 1e-12))
            if fit >= 1 or len(w.running) == 1:
                k = max(1, min(k, fit))
                for i in w.running:
                    w.kv[i] += k * self.cost.kv_bytes_per_token
                w.used += k * per_it
                self.set_kv(w, w.running[0], w.kv[w.running[0]], now)  # checks the capacity, samples
                return k
            self.preempt(w, self.victim(w), now, stall)

    def evict_upto(self, w: WorkerState, extra: float, now: float) -> None:
        """Evict least-recently-used cached entries of `w` until `extra` bytes are freed or
        none is left."""
        freed = 0.0
        for _, v in sorted((ts, v) for v, ts in w.lru.items()):
            if freed >= extra:
                break
            freed += w.kv[v]
            self.evict(w, v, now)

    def victim(self, w: WorkerState) -> int:
        """The running sequence a full worker preempts: the last admitted (first come, first
        served engines), or with priority the one predicted to finish soonest."""
        if self.policy.priority:
            return min(w.running, key=lambda i: (self.tr[i].pred[0], -self.tr[i].admitted_at))
        return max(w.running, key=lambda i: self.tr[i].admitted_at)

    def preempt(self, w: WorkerState, tid: int, now: float, stall: list[float]) -> None:
        """Take a running sequence off `w` mid-turn: its KV is dropped (rebuilt by a prefill
        of its whole context on re-admission) or swapped to host memory (copied back); it
        waits at the head of `w`'s queue and resumes its turn where it stopped."""
        t = self.tr[tid]
        w.running.remove(tid)
        size = w.kv[tid]
        self.preemptions += 1
        if self.cfg.preemption == "swap":
            t.preempted, t.swapped = PREEMPT_SWAP, size
            self.swapped_bytes += size
            stall[0] += self.cost.swap(size)
        else:
            t.preempted = PREEMPT_RECOMPUTE
        self.set_kv(w, tid, 0.0, now)
        t.home = -1
        t.ready_at = now
        t.queued_on = w.info.wid
        w.queue.append(tid)

    def preempt_for(self, w: WorkerState, t: TrajState, now: float, stall: list[float]) -> bool:
        """Heddle's priority with preemption: `t`, waiting for room on a full worker, takes the
        place of the running sequence predicted to finish soonest if that one's predicted
        remaining work is under `PREEMPT_RATIO` of `t`'s. Returns whether it preempted."""
        if not self.policy.preempt or not w.running or t.preempted or t.resume:
            return False
        v = min(w.running, key=lambda i: (self.tr[i].pred[0], -self.tr[i].admitted_at))
        if self.tr[v].pred[0] * PREEMPT_RATIO > t.pred[0] or self.tr[v].resume:
            return False
        self.preempt(w, v, now, stall)
        return True
