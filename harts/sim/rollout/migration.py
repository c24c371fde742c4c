"""Heddle's moves between workers in the rollout simulator: each worker's aggregate of the
predicted work planned on it and its drain estimate, KV migration at a tool call, live
migration of a running sequence at a re-prediction point, and work stealing by a worker
with free slots; with `makespan_moves` the kinds of move it names decided on the step's
predicted makespan; with `drain_merge` an idle worker merging with its busy buddy as the tail forms.

`Migration` is mixed into the simulator (`harts.sim.rollout.engine`), whose state it
reads and changes: the trajectories `tr`, the workers `ws`, their decode `prices`, and
through `set_kv`, `seg`, `push`, `ready`, `start_chunk` and `try_merge`.
"""

from __future__ import annotations

from harts.sim.rollout.planning import DecodePrice, aggregate_estimate, decode_fraction
from harts.sim.rollout.state import MIG_DONE, TrajState, WorkerState
from harts.sim.rollout.types import SegmentKind, Worker

MIGRATION_MARGIN = 0.05  # a migration must cut the pair's drain estimate by this fraction
STEAL_LOOKS = 16  # queued turns a worker with free slots examines per stealing attempt
TAIL_HYSTERESIS = 1.5  # tail isolation: a trajectory leaves the tail pool when its rank falls below 1.5 K
LIVE_MARGIN = 0.25  # live migration: the sequence's own predicted finish must drop by this fraction
MAKESPAN_EPS = 1e-6  # makespan-decided moves: a predicted makespan (or finish) must drop by this fraction
DRAIN_TAIL = 0.1  # drain-and-merge: the tail has formed when at most this share of the trajectories is unfinished


class Migration:
    def load_set(self, t: TrajState) -> None:
        """(Re)enter `t`'s predicted remaining work in its planned worker's aggregate."""
        w = self.ws[t.assigned]
        self.load_drop(t, w)
        if t.done:
            return
        x, tool, c = t.pred
        a = float(decode_fraction(x, tool, c, self.prices[w.info.degree]))
        w.load[t.spec.tid] = (x, tool, c, a)
        w.sum_x += x
        w.sum_a += a
        w.sum_ac += a * c
        w.est = -1.0
        w.top = None

    def load_drop(self, t: TrajState, w: WorkerState) -> None:
        old = w.load.pop(t.spec.tid, None)
        if old is not None:
            w.sum_x -= old[0]
            w.sum_a -= old[3]
            w.sum_ac -= old[3] * old[2]
            w.est = -1.0
            w.top = None
            if not w.load:
                w.sum_x = w.sum_a = w.sum_ac = 0.0

    def estimate(self, w: WorkerState, add: tuple[float, float, float] | None = None, remove: int = -1) -> float:
        """Predicted drain time of `w`'s planned trajectories (`planning.worker_estimate`
        from the worker's aggregate), optionally with one more (`add`: its predicted tokens,
        tool seconds and context) or one fewer (`remove`)."""
        if add is None and remove < 0:
            if w.est < 0:
                w.est = self._agg(w, None, -1)
            return w.est
        return self._agg(w, add, remove)

    def _agg(self, w: WorkerState, add, remove: int) -> float:
        price = self.prices[w.info.degree]
        sx, sa, sac = w.sum_x, w.sum_a, w.sum_ac
        none = (0.0, 0.0, 0.0, 0.0)
        if w.top is None:
            w.top = max(w.load.values(), default=none)
        top = w.top
        if remove >= 0:
            gone = w.load[remove]
            sx, sa, sac = sx - gone[0], sa - gone[3], sac - gone[3] * gone[2]
            if gone == top:
                top = max((v for k, v in w.load.items() if k != remove), default=none)
        if add is not None:
            x, tool, c = add
            a = float(decode_fraction(x, tool, c, price))
            sx, sa, sac = sx + x, sa + a, sac + a * c
            if x > top[0]:
                top = (x, tool, c, a)
        if sx <= 0 and top[0] <= 0:
            return 0.0
        return aggregate_estimate(sx, sa, sac, top[:3], price)

    def gain(self, t: TrajState, src: WorkerState, dst: WorkerState, margin: float = MIGRATION_MARGIN) -> float:
        """How much moving `t` from `src` to `dst` lowers the larger of the two estimates
        (0 unless it lowers it by more than `margin` of it)."""
        before = max(self.estimate(src), self.estimate(dst))
        after = max(self.estimate(src, remove=t.spec.tid), self.estimate(dst, add=t.pred))
        return before - after if before - after > margin * before else 0.0

    def longest_holder(self) -> int:
        """The worker planned to hold the step's predicted-longest remaining trajectory (-1
        none)."""
        best, holder = 0.0, -1
        for w in self.ws:
            if w.retired or not w.load:
                continue
            if w.top is None:
                w.top = max(w.load.values())
            if w.top[0] > best:
                best, holder = w.top[0], w.info.wid
        return holder

    def makespan_move(self, t: TrajState, src: WorkerState, dests, extra=None) -> int:
        """Makespan-decided moves: the worker among `dests` to move `t` (planned on `src`) to,
        or -1. The step's predicted makespan is the largest drain estimate over all workers
        (predicted lengths only); with the move, `src` loses `t` and the destination gains it
        (plus `extra(wid)` seconds: a live move's copy). A move qualifies if it lowers that
        makespan, or leaves it no higher and lowers the predicted finish of the worker that
        holds the step's predicted-longest remaining trajectory (after the move: the
        destination, if `t` is that trajectory). Among qualifying moves the lowest makespan
        after it wins, then the lower of the pair's larger estimate."""
        if not dests:
            return -1
        s = src.info.wid
        est = {w.info.wid: self.estimate(w) for w in self.ws if not w.retired}
        before = max(est.values())
        ranked = sorted(((v, k) for k, v in est.items() if k != s), reverse=True)[:2]
        holder = self.longest_holder()
        longest = holder == s and src.top is not None and t.pred[0] >= src.top[0]
        src_after = self.estimate(src, remove=t.spec.tid) if t.spec.tid in src.load else est[s]
        best, best_key = -1, None
        for w in dests:
            o = w.info.wid
            dst_after = self.estimate(w, add=t.pred) + (extra(o) if extra else 0.0)
            rest = next((v for v, k in ranked if k != o), 0.0)
            after = max(rest, src_after, dst_after)
            if longest:
                hold = (est[s], dst_after)
            elif holder == s:
                hold = (est[s], src_after)
            elif holder == o:
                hold = (est[o], dst_after)
            else:
                hold = (0.0, 0.0)
            ok = after < before * (1 - MAKESPAN_EPS) or (
                after <= before * (1 + MAKESPAN_EPS) and hold[1] < hold[0] * (1 - MAKESPAN_EPS))
            key = (after, max(src_after, dst_after), o)
            if ok and (best_key is None or key < best_key):
                best, best_key = o, key
        return best

    def move_plan(self, t: TrajState, dst: int) -> None:
        self.load_drop(t, self.ws[t.assigned])
        t.assigned = dst
        self.load_set(t)

    def maybe_migrate(self, t: TrajState, now: float) -> None:
        """At a tool-call start: move the KV to the worker whose predicted drain time the
        move lowers most (by at least `MIGRATION_MARGIN`), if the transfer fits in the
        mean tool latency."""
        src = t.home
        tid = t.spec.tid
        if src < 0 or t.assigned != src:
            return
        size = self.ws[src].kv[tid]
        best, best_gain = -1, 0.0
        dests = []
        for w in self.ws:
            o = w.info.wid
            if o == src or w.retired or w.info.kv_capacity_bytes - w.used < size:
                continue
            if self.tail_k and self.in_tail(w) != self.in_tail(self.ws[src]):  # isolation: pools apart
                continue
            if "tool" in self.policy.makespan_moves:
                dests.append(w)
                continue
            g = self.gain(t, self.ws[src], w)
            if g > best_gain:
                best, best_gain = o, g
        if "tool" in self.policy.makespan_moves:
            best = self.makespan_move(t, self.ws[src], dests)
        if best < 0:
            return
        dur = self.cost.transfer(size, self.same_node(src, best))
        if dur > self.tool_prior:
            return
        self.start_move(t, src, best, size, dur, now)

    def own_finish(self, t: TrajState, w: WorkerState, joins: bool) -> float:
        """When `t` would finish its predicted remaining decode on `w` at the per-token time of
        the sequences there now (running, queued and moving in, plus `t` if it `joins`) over
        their contexts."""
        moving_in = [i for i in w.kv if self.tr[i].migrating and self.tr[i].assigned == w.info.wid]
        there = w.running + w.queue + moving_in + ([t.spec.tid] if joins else [])
        ctx = sum(self.tr[i].context for i in there)
        return t.pred[0] * float(self.prices[w.info.degree].per_token(len(there), ctx))

    def maybe_move_running(self, t: TrajState, src: WorkerState, now: float) -> bool:
        """Live migration at a re-prediction point: move the running sequence to the worker
        where its own predicted finish (transfer included) is soonest, if that is at least
        `LIVE_MARGIN` sooner than staying. (Also asking that the move not raise the pair's
        larger drain estimate, as tool-call migration does, blocked nearly every move of a
        long turn towards the high-degree workers, whose planned trajectories set the
        bottleneck.) Returns whether it moved (then it is out of `src`'s batch)."""
        tid = t.spec.tid
        if t.assigned != src.info.wid or t.home != src.info.wid:
            return False
        size = src.kv[tid]
        stay = self.own_finish(t, src, joins=False)
        best, best_t = -1, stay * (1 - LIVE_MARGIN)
        dests = []
        for w in self.ws:
            o = w.info.wid
            if o == src.info.wid or w.retired or w.info.kv_capacity_bytes - w.used < size:
                continue
            if self.tail_k and self.in_tail(w) != self.in_tail(src):  # isolation: moves stay in their pool
                continue
            if "live" in self.policy.makespan_moves:
                dests.append(w)
                continue
            go = self.own_finish(t, w, joins=True) + self.cost.transfer(size, self.same_node(src.info.wid, o))
            if go < best_t:
                best, best_t = o, go
        if "live" in self.policy.makespan_moves:  # the copy stalls the sequence: counted at its destination
            best = self.makespan_move(t, src, dests, lambda o: self.cost.transfer(size, self.same_node(src.info.wid, o)))
        if best < 0:
            return False
        t.resume = True
        t.pending_ready = True
        self.start_move(t, src.info.wid, best, size, self.cost.transfer(size, self.same_node(src.info.wid, best)), now)
        return True

    def in_tail(self, w: WorkerState) -> bool:
        return w.info.degree == self.tail_degree

    def rehome(self, t: TrajState, now: float) -> bool:
        """Tail isolation at a tool-call start: a trajectory now predicted among the K
        longest remaining moves its KV into the tail pool (the highest-degree workers), one
        that has dropped below 1.5 K moves out, each to the pool's worker whose drain
        estimate it raises least. Returns whether it moved."""
        src = t.home
        if src < 0 or t.assigned != src or t.migrating:
            return False
        x = t.pred[0]
        rank = sum(1 for o in self.tr if not o.done and o.pred[0] > x)
        inside = self.in_tail(self.ws[src])
        if rank < self.tail_k and not inside and self.pool_room():
            pool = [w for w in self.ws if not w.retired and self.in_tail(w)]
        elif rank >= TAIL_HYSTERESIS * self.tail_k and inside:
            pool = [w for w in self.ws if not w.retired and not self.in_tail(w)]
        else:
            return False
        tid = t.spec.tid
        size = self.ws[src].kv[tid]
        pool = [w for w in pool if w.info.kv_capacity_bytes - w.used >= size]
        if not pool:
            return False
        dst = min(pool, key=lambda w: (self.estimate(w, add=t.pred), w.info.wid))
        self.start_move(t, src, dst.info.wid, size, self.cost.transfer(size, self.same_node(src, dst.info.wid)), now)
        return True

    def rehome_running(self, t: TrajState, src: WorkerState, now: float) -> bool:
        """Tail isolation at a re-prediction point: a running sequence outside the tail pool
        that is now predicted among the K longest remaining moves into it at this iteration
        boundary (its KV copied, no prefill). Returns whether it moved."""
        tid = t.spec.tid
        if t.assigned != src.info.wid or t.home != src.info.wid or self.in_tail(src):
            return False
        x = t.pred[0]
        if sum(1 for o in self.tr if not o.done and o.pred[0] > x) >= self.tail_k or not self.pool_room():
            return False
        size = src.kv[tid]
        pool = [w for w in self.ws if not w.retired and self.in_tail(w) and w.info.kv_capacity_bytes - w.used >= size]
        if not pool:
            return False
        dst = min(pool, key=lambda w: (self.estimate(w, add=t.pred), w.info.wid))
        t.resume = True
        t.pending_ready = True
        self.start_move(t, src.info.wid, dst.info.wid, size,
                        self.cost.transfer(size, self.same_node(src.info.wid, dst.info.wid)), now)
        return True

    def same_node(self, a: int, b: int) -> bool:
        per = self.cost.gpus_per_node
        return self.ws[a].info.gpus[0] // per == self.ws[b].info.gpus[0] // per

    def start_move(self, t: TrajState, src: int, dst: int, size: float, dur: float, now: float,
                   count: bool = True) -> None:
        tid = t.spec.tid
        self.ws[src].lru.pop(tid, None)  # pinned while it moves
        self.set_kv(self.ws[dst], tid, size, now)
        t.migrating = True
        self.move_plan(t, dst)
        self.migrations += count
        self.seg(t, SegmentKind.MIGRATE, now, now + dur, src, t.generated, t.generated, to_worker=dst)
        self.push(now + dur, MIG_DONE, tid, src)

    def steal(self, w: WorkerState, now: float) -> None:
        """Work stealing: `w` has free batch slots and nothing queued, so it takes queued
        turns from other workers (longest predicted remaining first, from the worker with
        the largest estimate first) while each move lowers the pair's larger estimate at
        all: a queued turn's alternative is to keep waiting, and one turn of hundreds on a
        loaded worker moves its estimate by far less than `MIGRATION_MARGIN`. A stolen turn's KV moves over NVLink / InfiniBand (it waits
        for the copy, then queues here); one without a resident KV just re-queues here."""
        slots = self.cfg.max_batch - len(w.running)
        victims = sorted((v for v in self.ws if v is not w and v.queue
                          and not (self.tail_k and self.in_tail(v) != self.in_tail(w))),
                         key=lambda v: (-self.estimate(v), v.info.wid))
        looked = 0
        for v in victims:
            for tid in sorted(v.queue, key=lambda i: (-self.tr[i].pred[0], self.tr[i].ready_at, i)):
                looked += 1
                if slots <= 0 or looked > STEAL_LOOKS:
                    return
                t = self.tr[tid]
                if t.assigned != v.info.wid:
                    continue
                if "steal" in self.policy.makespan_moves:
                    if self.makespan_move(t, v, [w]) < 0:
                        continue
                elif self.gain(t, v, w, margin=0.0) <= 0:
                    continue
                if self.take_queued(t, w, now):
                    slots -= 1

    def take_queued(self, t: TrajState, w: WorkerState, now: float) -> bool:
        """Move queued turn `t` from the worker it waits on to `w`: its KV (if resident
        elsewhere) over NVLink / InfiniBand, after which it queues on `w`, else straight
        onto `w`'s queue. False (nothing moved) where `w` has no room for the KV."""
        v = self.ws[t.queued_on]
        tid = t.spec.tid
        size = self.ws[t.home].kv.get(tid, 0.0) if t.home >= 0 else 0.0
        if size and w.info.kv_capacity_bytes - w.used < size:
            return False
        v.queue.remove(tid)
        t.queued_on = -1
        if now > t.ready_at:
            self.seg(t, SegmentKind.QUEUE, t.ready_at, now, v.info.wid, t.generated, t.generated)
        if size:
            t.pending_ready = True
            self.start_move(t, t.home, w.info.wid, size, self.cost.transfer(size, self.same_node(t.home, w.info.wid)), now)
        else:
            self.move_plan(t, w.info.wid)
            self.ready(t, now)
        return True

    def mig_done(self, t: TrajState, src: int, now: float) -> None:
        tid = t.spec.tid
        self.set_kv(self.ws[src], tid, 0.0, now)
        t.home = t.assigned
        if not t.resume:  # a running sequence's KV stays pinned until it is re-admitted
            self.ws[t.home].lru[tid] = now
        t.migrating = False
        if t.pending_ready:
            t.pending_ready = False
            self.ready(t, now)
        w = self.ws[src]
        if not w.active and w.queue:
            self.start_chunk(w, now)
        self.try_merge(w, now)

    # ---- drain-and-merge (dynamic MP as the tail forms) ---------------------------------

    def buddy(self, w: WorkerState) -> WorkerState | None:
        """The other serving worker of `w`'s degree on the aligned block of twice that
        degree, if twice it is a usable degree (None otherwise)."""
        d = w.info.degree
        if w.retired or 2 * d not in self.merge_degrees:
            return None
        block = w.info.gpus[0] // (2 * d)
        return next((v for v in self.ws if v is not w and not v.retired and v.info.degree == d
                     and v.info.gpus[0] // (2 * d) == block), None)

    def tail_formed(self) -> bool:
        return 0 < self.unfinished <= DRAIN_TAIL * len(self.tr)

    def drain_merge(self, w: WorkerState, now: float) -> bool:
        """Drain-and-merge at `w`'s iteration boundary (no chunk in flight), once the tail
        has formed: `w` and its buddy become one worker of twice the degree on their GPUs,
        busy or not. A buddy mid-chunk is cut at its next iteration boundary while `w`
        waits (it merges there; `w` restarts if it cannot). Every sequence, queued turn and
        cached KV on the two is resharded onto the merged worker (each GPU copies half of
        its KV shard to its partner in the block, all GPUs at once over NVLink: the larger
        of the two workers' KV / (2 x degree) per GPU); running sequences resume their turn
        there without a prefill. Not while any KV on either is moving. Returns whether `w`
        is done with this boundary (merged, or waiting for its buddy)."""
        if not (self.policy.drain_merge and self.tail_formed()) or w.active or w.retired:
            return False
        u = self.buddy(w)
        if u is None:
            return False
        if u.active:
            self.interrupt(u, now)
            return bool(w.running or w.queue)  # waits (a turn arriving meanwhile restarts it)
        if any(self.tr[i].migrating for v in (w, u) for i in v.kv):
            if u.running or u.queue:
                self.start_chunk(u, now)  # it may have waited for `w`
            return False
        d = w.info.degree
        for v in (w, u):
            v.retired, v.end = True, now
        info = Worker(len(self.ws), 2 * d, tuple(sorted(w.info.gpus + u.info.gpus)), self.cost.kv_capacity(2 * d),
                      start_s=now)
        self.prices.setdefault(2 * d, DecodePrice(self.cost, 2 * d, self.cfg.max_batch))
        m = WorkerState(info)
        self.ws.append(m)
        dst = info.wid
        dur = self.cost.transfer(max(w.used, u.used) / (2 * d), True)
        for v in (w, u):
            src = v.info.wid
            for tid in v.running:  # mid-turn: resumes on the merged worker once resharded
                t = self.tr[tid]
                t.resume = t.pending_ready = True
                self.start_move(t, src, dst, v.kv[tid], dur, now, count=False)
            v.running = []
            for tid in list(v.queue):
                t = self.tr[tid]
                v.queue.remove(tid)
                t.queued_on = -1
                if now > t.ready_at:
                    self.seg(t, SegmentKind.QUEUE, t.ready_at, now, src, t.generated, t.generated)
                if t.home == src and tid in v.kv:
                    t.pending_ready = True
                    self.start_move(t, src, dst, v.kv[tid], dur, now, count=False)
                else:
                    self.move_plan(t, dst)
                    self.ready(t, now)
            for tid in list(v.kv):  # cached KV of trajectories in tool calls
                t = self.tr[tid]
                if not t.migrating:
                    self.start_move(t, src, dst, v.kv[tid], dur, now, count=False)
            for tid in list(v.load):  # planned here with nothing resident
                self.move_plan(self.tr[tid], dst)
        for v in self.ws:
            if v.running and not v.retired:
                v.reconsider = True  # its running sequences may move to the merged worker
                self.interrupt(v, now)
        if self.policy.migration:
            self.steal(m, now)
        return True
