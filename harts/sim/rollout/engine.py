"""The discrete-event rollout simulator: trajectories x workers under one policy.

Events: a turn becomes ready (step start, or a tool call returns), a worker's batch
reaches its next boundary, a KV migration lands. A worker runs continuous batching in
chunks: it admits queued turns (policy order, while the batch limit and the KV capacity
allow; least-recently-used KV of trajectories waiting on tools is evicted to make room),
prefills what they bring (the tool output, or the whole context where the KV was lost),
then decodes k iterations at the batch's price, k = the fewest tokens any running turn
has left. A turn arriving mid-chunk joins at the next iteration boundary (the chunk is
cut there). Each chunk is priced at its middle context. With live migration a chunk also
ends where a running turn reaches its next re-prediction point, and a running sequence
may leave the batch there: its KV is copied, and it rejoins the other worker's batch
mid-turn, without a prefill. Everything random was drawn into the `TrajectorySpec`s, so a
run is deterministic.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time

import numpy as np

from harts.config.rollout import RolloutWorkload
from harts.sim.rollout.cost import RolloutCost, make_rollout_cost
from harts.sim.rollout.layout import choose_layout
from harts.sim.rollout.memory import KVMemory
from harts.sim.rollout.migration import Migration
from harts.sim.rollout.planning import (
    DecodePrice,
    anneal_layout,
    dp_place,
    estimate_makespan,
    expected_context,
    greedy_place,
    predict_remaining,
    prior_action_mean,
    prior_tool_mean,
)
from harts.sim.rollout.policies import RolloutPolicy, Router, get_policy
from harts.sim.rollout.pools import TailPools, pool_layout
from harts.sim.rollout.posterior import PosteriorPredictor
from harts.sim.rollout.state import (
    FIRST_CHECK,
    NOT_PREEMPTED,
    PREEMPT_SWAP,
    READY,
    STEP_END,
    TrajState,
    WorkerState,
)
from harts.sim.rollout.tail import TailShield
from harts.sim.rollout.types import (
    RolloutResult,
    Segment,
    SegmentKind,
    TrajectorySpec,
    TrajectoryTimeline,
    Worker,
)
from harts.sim.rollout.workload import generate_trajectories

GROUP_PRIOR_TURNS = 2.0  # group predictor: the prior counts as this many observed turns of the group
OWN_PRIOR_TURNS = 1.0  # group predictor: the group's mean counts as this many of the trajectory's own turns


def make_workers(layout: list[int], cost: RolloutCost) -> tuple[Worker, ...]:
    """Workers on contiguous GPUs, highest degree first (so none straddles a node)."""
    out, g = [], 0
    for wid, d in enumerate(sorted(layout, reverse=True)):
        out.append(Worker(wid, d, tuple(range(g, g + d)), cost.kv_capacity(d)))
        g += d
    return tuple(out)


def _valid_degrees(cfg: RolloutWorkload, cost: RolloutCost, degrees) -> list[int]:
    need = cost.kv_bytes(cfg.max_context)
    return [d for d in degrees if d <= cost.gpus_per_node and cost.kv_capacity(d) >= need]


def usable_degrees(cfg: RolloutWorkload, cost: RolloutCost) -> list[int]:
    """The degrees any worker may have (adaptive layouts, merges, the bounds): the
    adaptive ones and the baselines', within a node and holding one longest context."""
    return _valid_degrees(cfg, cost, sorted(set(cfg.mp_degrees) | {cfg.baseline_mp}))


class _Sim(Migration, KVMemory, TailShield, TailPools):
    def __init__(self, cfg: RolloutWorkload, policy: RolloutPolicy, gpus: int, specs, cost: RolloutCost,
                 plan: tuple | None = None):
        self.cfg, self.policy, self.cost = cfg, policy, cost
        self.fixed_plan = plan
        self.tail_k, self.tail_degree = 0, 0  # tail pool: its size K and its workers' degree (0: none)
        self.gpus = gpus
        self.tr = [TrajState(s) for s in specs]
        self.action_prior = prior_action_mean(cfg)
        self.tool_prior = prior_tool_mean(cfg)
        groups = max((s.group for s in specs), default=0) + 1
        self.group_tokens = [0.0] * groups  # action tokens of the group's finished turns (observed)
        self.group_turns = [0] * groups
        self.members: dict[int, list[int]] = {}
        for i, s in enumerate(specs):
            self.members.setdefault(s.group, []).append(i)
        self.post = PosteriorPredictor(cfg, tuple(specs)) if policy.posterior and not policy.oracle else None
        self.group_post: dict[int, tuple[int, tuple[float, float]]] = {}  # group -> (event stamp, posterior of g)
        self.seq = 0
        t0 = time.perf_counter()
        self.workers = self._plan()
        self.plan_seconds = time.perf_counter() - t0
        self.ws = [WorkerState(w) for w in self.workers]
        self.merge_degrees = set(usable_degrees(cfg, cost))
        self.unfinished = len(self.tr)
        self.events: list[tuple] = []
        self.seq = 0
        self.rr = 0
        self.migrations = 0
        self.prefill_tokens = 0
        self.recomputed = 0
        self.preemptions = 0
        self.swapped_bytes = 0.0
        self.admissions = 0
        self.paged = cfg.kv_alloc == "paged"
        self.prices = {d: DecodePrice(cost, d, cfg.max_batch) for d in {w.degree for w in self.workers}}
        for t in self.tr:
            self.repredict(t)

    # ---- planning ---------------------------------------------------------------------

    def _plan(self) -> tuple[Worker, ...]:
        cfg, cost, p = self.cfg, self.cost, self.policy
        base = cfg.baseline_mp
        if base not in _valid_degrees(cfg, cost, [base]):
            raise ValueError(f"baseline model-parallel degree {base} cannot hold the weights and one "
                             f"{cfg.max_context}-token context on {cfg.hardware} (KV capacity "
                             f"{cost.kv_capacity(base) / 1e9:.1f} GB)")
        if self.gpus < base or self.gpus % base:
            raise ValueError(f"gpus ({self.gpus}) must be a positive multiple of baseline_mp ({base})")
        layout = [base] * (self.gpus // base)
        homes = None
        if self.fixed_plan is not None:  # a layout (and homes) given by the caller
            layout, homes = list(self.fixed_plan[0]), self.fixed_plan[1]
            if sum(layout) != self.gpus:
                raise ValueError(f"plan layout {layout} does not use {self.gpus} GPUs")
            if homes is not None:
                for t, a in zip(self.tr, homes, strict=True):
                    t.assigned = a
                return make_workers(layout, cost)
        n = len(self.tr)
        if p.oracle:
            preds = [(float(t.spec.generated_tokens), float(len(t.spec.turns))) for t in self.tr]
        elif self.post is not None:
            g0 = (0.0, cfg.action_group_sigma ** 2)
            preds = [self.post.remaining(t.spec.tid, 0, 0, cfg.max_context - t.spec.turns[0].input_tokens, g0)
                     for t in self.tr]
        else:
            preds = [predict_remaining(t.spec, 0, 0, self.action_prior,
                                       cfg.max_context - t.spec.turns[0].input_tokens, cfg.turns_range[1])
                     for t in self.tr]
        lengths = np.array([x for x, _ in preds], dtype=float)
        tools = np.array([(turns - 1.0) * self.tool_prior for _, turns in preds], dtype=float)
        contexts = np.array([expected_context(0, t.spec.turns[0].input_tokens, x, cfg.max_context)
                             for t, (x, _) in zip(self.tr, preds, strict=True)])
        prices: dict[int, DecodePrice] = {}
        grids: dict[int, np.ndarray] = {}  # DP cost grids per degree, shared by every layout tried

        def place(lay: list[int]) -> tuple[list[int], float]:
            pr = {d: prices.setdefault(d, DecodePrice(cost, d, cfg.max_batch)) for d in set(lay)}
            if p.placement:
                return dp_place(lengths, tools, contexts, lay, pr, cache=grids)
            a = greedy_place(n, lay)
            return a, estimate_makespan(a, lengths, tools, contexts, lay, pr)

        k = self.fixed_plan[2] if self.fixed_plan is not None and len(self.fixed_plan) > 2 else 0
        if p.adaptive_mp and self.fixed_plan is None:
            allowed = usable_degrees(cfg, cost)
            if p.tail_pools:  # a tail pool and a bulk pool (`harts.sim.rollout.pools`)
                layout, k = pool_layout(cfg, tuple(t.spec for t in self.tr), cost, self.gpus, allowed,
                                        simulate_rollout, p)
            elif p.twin_layout:
                layout, k = choose_layout(cfg, tuple(t.spec for t in self.tr), cost, self.gpus, allowed,
                                          simulate_rollout, drain_merge=p.drain_merge)
            else:
                rng = np.random.default_rng([cfg.seed, 7])
                layout = anneal_layout(self.gpus, layout, allowed, lambda lay: place(lay)[1], cfg.anneal_iterations,
                                       rng)
        workers = make_workers(layout, cost)
        if k and (p.isolation or p.tail_pools):  # a tail pool: the highest-degree workers keep the K predicted longest
            self.tail_k, self.tail_degree = k, workers[0].degree
        if p.router == Router.HOME:
            if self.tail_k:
                m = sum(1 for w in workers if w.degree == self.tail_degree)
                order = np.argsort(-lengths, kind="stable")
                assign = [0] * n
                for idx, wids in ((order[:k], list(range(m))), (order[k:], list(range(m, len(workers))))):
                    if not len(idx):  # K at least the step's trajectories: an empty bulk
                        continue
                    lay = [workers[w].degree for w in wids]
                    sub, _ = dp_place(lengths[idx], tools[idx], contexts[idx], lay,
                                      {d: DecodePrice(cost, d, cfg.max_batch) for d in set(lay)})
                    for i, a in zip(idx, sub, strict=True):
                        assign[int(i)] = wids[a]
            else:
                assign, _ = place([w.degree for w in workers])
            for t, a in zip(self.tr, assign, strict=True):
                t.assigned = a
        return workers

    # ---- bookkeeping ------------------------------------------------------------------

    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, a, b))
        self.seq += 1

    def set_kv(self, w: WorkerState, tid: int, nbytes: float, now: float) -> None:
        w.used += nbytes - w.kv.get(tid, 0.0)
        if nbytes > 0:
            w.kv[tid] = nbytes
        else:
            w.kv.pop(tid, None)
            w.lru.pop(tid, None)
        if w.used > w.info.kv_capacity_bytes * (1 + 1e-9) + 1e-3:
            raise AssertionError(f"worker {w.info.wid}: KV {w.used} exceeds capacity {w.info.kv_capacity_bytes}")
        w.peak = max(w.peak, w.used)
        w.samples.append((now, w.used))

    def drop(self, t: TrajState, now: float) -> None:
        """Free a trajectory's cached KV (it is re-routed elsewhere or finished)."""
        if t.home >= 0:
            self.set_kv(self.ws[t.home], t.spec.tid, 0.0, now)
            t.home = -1

    def seg(self, t: TrajState, kind: SegmentKind, start: float, end: float, worker: int, before: int, after: int,
            **kw) -> None:
        if kind == SegmentKind.DECODE and t.segs:
            last = t.segs[-1]
            if last.kind == kind and last.worker == worker and last.turn == t.turn and abs(last.end - start) < 1e-12:
                t.segs[-1] = Segment(kind, last.start, end, worker, t.turn, last.tokens_before, after)
                return
        t.segs.append(Segment(kind, start, end, worker, t.turn, before, after, **kw))

    def group_prior(self, g: int) -> float:
        """The per-turn action length of prompt group `g` as its finished turns show it (the
        prior counting as `GROUP_PRIOR_TURNS` turns)."""
        return (self.group_tokens[g] + GROUP_PRIOR_TURNS * self.action_prior) / (self.group_turns[g] + GROUP_PRIOR_TURNS)

    def predicted(self, t: TrajState) -> tuple[float, float]:
        """(remaining decode tokens, remaining tool seconds) the predictor expects; a running
        turn counts as one of the remaining ones (its length is not known either; with
        live migration its decoded part so far is seen)."""
        if t.done:
            return 0.0, 0.0, 0.0
        p = self.policy
        running = t.remaining > 0
        elapsed = t.generated - t.turn_start_generated if running else 0
        nxt = t.spec.turns[t.turn].input_tokens if t.turn < len(t.spec.turns) and not running else 0
        if p.oracle:  # the truth (an oracle, for reference schedules only)
            rest = t.spec.turns[t.turn:]
            x = max(sum(u.action_tokens for u in rest) - elapsed, 1.0)
            tool = sum(u.tool_latency_s for u in rest)
            return x, tool, expected_context(t.context, nxt, x, self.cfg.max_context)
        if self.post is not None:
            x, turns = self.post.remaining(t.spec.tid, t.turn, elapsed, self.cfg.max_context - t.context - nxt,
                                           self.group_scale(t.spec.group))
            return x, max(turns - 1.0, 0.0) * self.tool_prior, expected_context(t.context, nxt, x, self.cfg.max_context)
        prior = self.group_prior(t.spec.group) if p.group_predictor else self.action_prior
        if p.live_migration:
            x, turns = predict_remaining(t.spec, t.turn, t.turn_start_generated, prior,
                                         self.cfg.max_context - t.context - nxt, self.cfg.turns_range[1],
                                         elapsed=elapsed, prior_weight=OWN_PRIOR_TURNS if p.group_predictor else 0.0)
        else:
            x, turns = predict_remaining(t.spec, t.turn, t.turn_start_generated, prior,
                                         self.cfg.max_context - t.context - nxt + elapsed, self.cfg.turns_range[1],
                                         prior_weight=OWN_PRIOR_TURNS if p.group_predictor else 0.0)
            if running:
                x = max(x - elapsed, 1.0)
        return x, max(turns - 1.0, 0.0) * self.tool_prior, expected_context(t.context, nxt, x, self.cfg.max_context)

    def group_scale(self, g: int) -> tuple[float, float]:
        """The posterior's estimate of group `g`'s log scale (its members' turns), once per event."""
        hit = self.group_post.get(g)
        if hit is None or hit[0] != self.seq:
            running = {j: self.tr[j].generated - self.tr[j].turn_start_generated for j in self.members[g]
                       if not self.tr[j].done and self.tr[j].remaining > 0}
            hit = self.group_post[g] = (self.seq, self.post.group_scale(self.members[g], running))
        return hit[1]

    def repredict(self, t: TrajState) -> None:
        t.pred = self.predicted(t)
        if t.assigned >= 0:
            self.load_set(t)

    # ---- routing ----------------------------------------------------------------------

    def least_loaded(self) -> int:
        return min(range(len(self.ws)),
                   key=lambda i: ((len(self.ws[i].running) + len(self.ws[i].queue)) / self.ws[i].info.degree, i))

    def route(self, t: TrajState) -> int:
        r = self.policy.router
        if r == Router.ROUND_ROBIN:
            w = self.rr % len(self.ws)
            self.rr += 1
            return w
        if r == Router.LEAST_LOADED:
            return self.least_loaded()
        if r == Router.CACHE_AWARE:
            return t.home if t.home >= 0 else self.least_loaded()
        if r == Router.BALANCER:  # a fresh request: least outstanding requests, ties in rotation
            n = len(self.ws)
            self.rr += 1
            return min(range(n), key=lambda i: (len(self.ws[i].running) + len(self.ws[i].queue), (i - self.rr) % n))
        return t.assigned

    # ---- workers ----------------------------------------------------------------------

    def admit_order(self, w: WorkerState) -> list[int]:
        if self.policy.priority:
            return sorted(w.queue, key=lambda i: (-self.tr[i].pred[0], self.tr[i].ready_at, i))
        # first come first served; a preempted sequence goes back to the head of the queue
        return sorted(w.queue, key=lambda i: (not self.tr[i].preempted, self.tr[i].ready_at, i))

    def start_chunk(self, w: WorkerState, now: float) -> None:
        cost, d = self.cost, w.info.degree
        cap = w.info.kv_capacity_bytes
        limit = cap * (1.0 - self.cfg.kv_watermark) if self.paged else cap
        new_tokens, pairs, admitted = 0.0, 0.0, []
        stall = [0.0]  # host <-> GPU copies (swap in / out) before this chunk decodes
        shield = self.batch_cap(w, now)
        for tid in self.admit_order(w):
            t = self.tr[tid]
            if shield < self.cfg.max_batch and len(w.running) >= shield and not t.resume and self.short_work(t):
                continue  # tail shield: the batch stays small around a protected trajectory
            if len(w.running) >= self.cfg.max_batch and not self.preempt_for(w, t, now, stall):
                break
            turn = t.spec.turns[t.turn]
            if t.resume:  # its KV (moved here whole, pinned) holds the turn so far
                need = w.kv[tid]
            elif t.preempted == PREEMPT_SWAP:
                need = t.swapped
            elif self.paged:  # the context and the input now; the action's KV as it is decoded
                need = cost.kv_bytes(t.context + (0 if t.preempted else turn.input_tokens))
            else:  # the whole turn up front
                need = cost.kv_bytes(t.context + turn.input_tokens + turn.action_tokens)
            have = w.kv.get(tid, 0.0)
            if t.home == w.info.wid:
                hit = t.context
            elif w.info.wid in t.stale:  # an older copy in this worker's prefix cache
                hit = w.ctx.get(tid, 0)
            else:
                hit = 0
            if not self.evict_for(w, need - have, limit, now, keep=tid):
                if not (self.preempt_for(w, t, now, stall) and self.evict_for(w, need - have, limit, now, keep=tid)):
                    break  # head of line waits
            t.stale.discard(w.info.wid)
            self.set_kv(w, tid, need, now)
            w.lru.pop(tid, None)
            w.ctx.pop(tid, None)
            t.home = w.info.wid
            w.queue.remove(tid)
            t.queued_on = -1
            if now > t.ready_at:
                self.seg(t, SegmentKind.QUEUE, t.ready_at, now, w.info.wid, t.generated, t.generated)
            w.running.append(tid)
            self.admissions += 1
            t.admitted_at = self.admissions
            if t.resume:
                t.resume = False
                continue
            if t.preempted == PREEMPT_SWAP:  # its KV comes back from host memory
                stall[0] += cost.swap(t.swapped)
                t.swapped, t.preempted = 0.0, NOT_PREEMPTED
                continue
            lost = t.context - hit  # context tokens whose KV is rebuilt here
            fresh = lost + (0 if t.preempted else turn.input_tokens)
            self.recomputed += lost
            new_tokens += fresh
            pairs += fresh * hit + fresh * (fresh + 1) / 2
            admitted.append((tid, lost > 0))
            if t.preempted:  # resumes its turn where it stopped, after rebuilding its KV
                t.preempted = NOT_PREEMPTED
                continue
            t.context += turn.input_tokens
            t.remaining = turn.action_tokens
            t.next_check = FIRST_CHECK
        self.prefill_tokens += int(new_tokens)
        pre = (cost.prefill(new_tokens, pairs, d) if admitted else 0.0)
        if not w.running:
            w.active = False
            return
        k = self.chunk_length(w, now, stall)
        w.k_res = k
        pre += stall[0]
        for tid, rec in admitted:
            t = self.tr[tid]
            if tid in w.running:
                self.seg(t, SegmentKind.PREFILL, now, now + pre, w.info.wid, t.generated, t.generated, recomputed=rec)
        b = len(w.running)
        ctx = sum(self.tr[i].context for i in w.running) + b * k / 2
        w.step = cost.decode_step(b, ctx, d)
        w.k = k
        w.chunk_start = now
        w.decode_start = now + pre
        w.active = True
        w.version += 1
        end = w.decode_start + k * w.step
        if w.busy and abs(w.busy[-1][1] - now) < 1e-12:
            w.busy[-1][1] = end
        else:
            w.busy.append([now, end])
        self.push(end, STEP_END, w.info.wid, w.version)

    def interrupt(self, w: WorkerState, now: float) -> None:
        """A turn arrived at a busy worker: cut the chunk at the next iteration boundary."""
        if not w.active:
            self.start_chunk(w, now)
            return
        done = 1 if now <= w.decode_start else math.ceil((now - w.decode_start) / w.step - 1e-9)
        done = max(1, min(w.k, done))
        if done < w.k:
            w.k = done
            w.version += 1
            end = w.decode_start + done * w.step
            w.busy[-1][1] = end
            self.push(end, STEP_END, w.info.wid, w.version)

    def step_end(self, w: WorkerState, now: float) -> None:
        k = w.k
        still = []
        if self.paged and w.k_res > k:  # the chunk was cut short: release the KV reserved beyond it
            over = (w.k_res - k) * self.cost.kv_bytes_per_token
            for tid in w.running:
                w.kv[tid] -= over
            w.used -= over * len(w.running)
        for tid in w.running:
            t = self.tr[tid]
            before = t.generated
            t.generated += k
            t.context += k
            t.remaining -= k
            self.seg(t, SegmentKind.DECODE, w.decode_start, now, w.info.wid, before, t.generated)
            if t.remaining > 0:
                check = self.policy.live_migration and t.generated - t.turn_start_generated >= t.next_check
                if check:
                    t.next_check = self.pool_next_check(t, w)
                    self.repredict(t)
                if check and self.tail_k and self.rehome_running(t, w, now):
                    continue
                if (check or w.reconsider) and self.maybe_move_running(t, w, now):
                    continue
                still.append(tid)
                continue
            turn = t.spec.turns[t.turn]
            g = t.spec.group
            self.group_tokens[g] += t.generated - t.turn_start_generated
            if self.post is not None:
                self.post.observe(tid, t.generated - t.turn_start_generated)
                self.group_post.pop(g, None)
            self.group_turns[g] += 1
            t.turn += 1
            t.turn_start_generated = t.generated
            if t.turn == len(t.spec.turns):
                t.done, t.finish = True, now
                self.unfinished -= 1
                self.drop(t, now)
                self.drop_stale(t, now)
                if t.assigned >= 0:
                    self.load_drop(t, self.ws[t.assigned])
                continue
            self.repredict(t)  # progressive: re-predicted after every turn
            if self.policy.group_predictor or self.post is not None:  # and so is every waiting member of its group
                for o in self.members[g]:
                    m = self.tr[o]
                    if o != tid and not m.done and (not m.remaining or self.post is not None):
                        self.repredict(m)
            w.lru[tid] = now
            self.seg(t, SegmentKind.TOOL, now, now + turn.tool_latency_s, w.info.wid, t.generated, t.generated)
            self.push(now + turn.tool_latency_s, READY, tid)
            if self.tail_k and self.rehome(t, now):
                continue
            if self.policy.migration:
                self.maybe_migrate(t, now)
        w.running = still
        w.active = False
        w.reconsider = False
        if self.drain_merge(w, now):
            return
        self.start_chunk(w, now)
        if self.policy.migration and not w.queue and len(w.running) < self.cfg.max_batch:
            self.steal(w, now)
        self.pool_fill(w, now)
        self.try_merge(w, now)

    # ---- dynamic model parallelism ------------------------------------------------------

    def idle(self, w: WorkerState) -> bool:
        """Nothing running, queued, cached or planned on `w` (and it still serves)."""
        return not (w.retired or w.active or w.running or w.queue or w.kv or w.load)

    def try_merge(self, w: WorkerState, now: float) -> None:
        """Dynamic MP: while `w` is idle and so is the other half of the aligned block of
        twice its degree (one worker of the same degree on those GPUs), merge the two (a
        usable degree only), then offer the merged worker queued turns and running
        sequences elsewhere."""
        if not self.policy.dynamic_mp or not self.unfinished:
            return
        merged = None
        while self.idle(w) and 2 * w.info.degree in self.merge_degrees:
            d = w.info.degree
            block = w.info.gpus[0] // (2 * d)
            buddy = next((v for v in self.ws if v is not w and v.info.degree == d and self.idle(v)
                          and v.info.gpus[0] // (2 * d) == block), None)
            if buddy is None:
                break
            for v in (w, buddy):
                v.retired, v.end = True, now
            info = Worker(len(self.ws), 2 * d, tuple(sorted(w.info.gpus + buddy.info.gpus)),
                          self.cost.kv_capacity(2 * d), start_s=now)
            self.prices.setdefault(2 * d, DecodePrice(self.cost, 2 * d, self.cfg.max_batch))
            w = merged = WorkerState(info)
            self.ws.append(w)
        if merged is None:
            return
        for v in self.ws:
            if v.running and not v.retired:
                v.reconsider = True  # its running sequences may move at its next iteration boundary
                self.interrupt(v, now)
        if self.policy.migration:
            self.steal(merged, now)

    # ---- main loop --------------------------------------------------------------------

    def ready(self, t: TrajState, now: float) -> None:
        if t.migrating:
            t.pending_ready = True
            return
        w = self.route(t)
        if t.home >= 0 and t.home != w:
            if self.policy.router == Router.BALANCER:  # the old copy stays in that worker's prefix cache
                h = self.ws[t.home]
                h.ctx[t.spec.tid] = t.context
                t.stale.add(t.home)
                t.home = -1
            else:
                self.drop(t, now)
        t.ready_at = now
        t.queued_on = w
        self.ws[w].queue.append(t.spec.tid)
        self.interrupt(self.ws[w], now)

    def run(self) -> RolloutResult:
        for t in self.tr:
            self.push(0.0, READY, t.spec.tid)
        while self.events:
            now, _, kind, a, b = heapq.heappop(self.events)
            if kind == READY:
                self.ready(self.tr[a], now)
            elif kind == STEP_END:
                w = self.ws[a]
                if b == w.version and w.active:
                    self.step_end(w, now)
            else:
                self.mig_done(self.tr[a], b, now)
        lost = [t.spec.tid for t in self.tr if not t.done]
        if lost:
            raise RuntimeError(f"rollout simulation stalled with trajectories {lost[:10]} unfinished")
        makespan = max((t.finish for t in self.tr), default=0.0)
        return RolloutResult(
            policy=self.policy.name.value,
            gpus=self.gpus,
            workers=tuple(dataclasses.replace(w.info, end_s=w.end) if w.retired else w.info for w in self.ws),
            makespan_s=makespan,
            generated_tokens=sum(t.generated for t in self.tr),
            prefill_tokens=self.prefill_tokens,
            recomputed_tokens=self.recomputed,
            migrations=self.migrations,
            preemptions=self.preemptions,
            swapped_bytes=self.swapped_bytes,
            timelines=tuple(TrajectoryTimeline(t.spec.tid, tuple(t.segs), t.finish, t.generated) for t in self.tr),
            busy=tuple(tuple((s, e) for s, e in w.busy) for w in self.ws),
            kv_peak_bytes=tuple(w.peak for w in self.ws),
            kv_samples=tuple(tuple(w.samples) for w in self.ws),
            plan_seconds=self.plan_seconds,
        )


def simulate_rollout(cfg: RolloutWorkload, policy: str | RolloutPolicy, gpus: int,
                     specs: tuple[TrajectorySpec, ...] | None = None,
                     cost: RolloutCost | None = None,
                     plan: tuple | None = None) -> RolloutResult:
    """One rollout phase: the step's trajectories (drawn from `cfg` unless given) on `gpus`
    GPUs under `policy` (a registered name or a `RolloutPolicy`). `plan` fixes the layout
    of degrees and (for a policy routing to planned homes) each trajectory's worker; a
    third element K, with homes None, gives a tail-pool policy its pool's size."""
    pol = get_policy(policy) if isinstance(policy, str) else policy
    cost = cost or make_rollout_cost(cfg)
    specs = generate_trajectories(cfg) if specs is None else specs
    if not specs:
        raise ValueError("rollout: no trajectories")
    return _Sim(cfg, pol, gpus, specs, cost, plan).run()
