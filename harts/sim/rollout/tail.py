"""Heddle's tail shield (`tail_shield`): a worker holding one of the step's
predicted-longest remaining trajectories keeps its batch small while other workers have
room for the short work it turns away, so that the long trajectory decodes nearer its own
speed than a crowd's.

Only predicted lengths are read (`TrajState.pred`). The protected set is the `SHIELD_K`
unfinished trajectories predicted to have the most decode tokens left, recomputed at most
every `SHIELD_REFRESH_S` simulated seconds. "Short work" is a sequence predicted to need
under 1 / `SHIELD_RATIO` of the least of the protected ones' remaining tokens: a worker
with a protected trajectory planned on it admits short work only while its batch is below
its cap, max(`SHIELD_BATCH`, its running + queued sequences - the free batch slots of the
workers holding no protected trajectory); what it turns away waits in its queue, where
work stealing and migration at tool calls can take it elsewhere. Long work (protected or
not) is admitted as without the shield. `TailShield` is mixed into the simulator
(`harts.sim.rollout.engine`), whose trajectories `tr`, workers `ws`, `policy` and `cfg`
it reads.
"""

from __future__ import annotations

import numpy as np

from harts.sim.rollout.state import TrajState, WorkerState

SHIELD_K = 8  # the predicted-longest unfinished trajectories the shield protects
SHIELD_BATCH = 24  # a shielded worker's cap on its batch for short work (at least)
SHIELD_RATIO = 4.0  # short work: predicted under 1/4 of the least protected trajectory's remaining tokens
SHIELD_REFRESH_S = 1.0  # the protected set is recomputed at most this often (simulated seconds)


class TailShield:
    _shield_at = -1.0
    _shielded: frozenset[int] = frozenset()
    _shield_cut = 0.0

    def shield_refresh(self, now: float) -> None:
        """Recompute the protected set (at most every `SHIELD_REFRESH_S`)."""
        if now < self._shield_at:
            return
        self._shield_at = now + SHIELD_REFRESH_S
        live = [t for t in self.tr if not t.done]
        if len(live) > SHIELD_K:
            x = np.array([t.pred[0] for t in live])
            top = np.argsort(-x, kind="stable")[:SHIELD_K]
            live = [live[int(i)] for i in top]
        self._shielded = frozenset(t.spec.tid for t in live)
        self._shield_cut = min((t.pred[0] for t in live), default=0.0)

    def short_work(self, t: TrajState) -> bool:
        """Whether the shield may turn `t` away: not protected and predicted under
        1 / `SHIELD_RATIO` of the least protected trajectory's remaining tokens."""
        return t.spec.tid not in self._shielded and t.pred[0] * SHIELD_RATIO < self._shield_cut

    def holds_protected(self, w: WorkerState) -> bool:
        return any(tid in self._shielded for tid in w.load)

    def batch_cap(self, w: WorkerState, now: float) -> int:
        """The batch up to which `w` admits short work: the batch limit, or with the shield
        on and a protected trajectory planned on `w`, max(`SHIELD_BATCH`, its demand - the
        free slots elsewhere)."""
        if not self.policy.tail_shield:
            return self.cfg.max_batch
        self.shield_refresh(now)
        if not self.holds_protected(w):
            return self.cfg.max_batch
        spare = sum(max(self.cfg.max_batch - len(v.running) - len(v.queue), 0)
                    for v in self.ws if v is not w and not v.retired and not self.holds_protected(v))
        return min(max(SHIELD_BATCH, len(w.running) + len(w.queue) - spare), self.cfg.max_batch)
