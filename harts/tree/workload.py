"""Synthetic agentic-RL steps shaped like SWE-bench agent rollouts.

A *group* is one prompt (system prompt + issue). Its rollouts are chains of turns; a turn is
an action (policy tokens, trained) followed by an observation (tool output, not trained).
Two sampling schemes turn rollouts into training sequences:

- ``stepwise``: rollouts are independent; every turn k of a rollout becomes a sequence whose
  context is the history so far (prompt, a1, o1, ..., a_k). The sequences of one rollout are
  nested prefixes; each trains only its last action.
- ``treestep``: a rollout branches at turn boundaries into several continuations (TRACE-like
  tree sampling); each root-to-leaf path is a sequence that trains all its actions.

Defaults and where they come from (approximate public statistics of SWE-agent and
OpenHands trajectories on SWE-bench; they are assumptions, every one can be overridden):
- system prompt + issue: 3-8k tokens (SWE-agent's system/instance templates plus the
  issue text), uniform.
- turns per rollout: lognormal, median 35, sigma 0.45 -> about 15-65 for most rollouts, a
  heavy tail past 100, capped at 150 (SWE-agent's step limits are 100-250).
- action: lognormal median 160, sigma 0.5, clipped to [30, 800] (thought + one command,
  ~50-500 tokens).
- observation: lognormal median 400, sigma 1.1, clipped to [10, 8000] (file views and test
  output, heavy-tailed, truncated by the agent's output limit).
- final contexts then land mostly in 25k-130k tokens; a rollout stops adding turns at the
  context cap (131072; 32768 for the Flash-sized 32- and 64-GPU presets, see `_swe`).
- each preset names the microbatch budget it is planned with (`microbatch_tokens`:
  131072, 32768 for the Flash-sized presets); callers that name a budget override it.
- 8 rollouts (stepwise) or 8 leaves (treestep, branching factor 2) per prompt, the usual
  GRPO group size for SWE tasks.
- treestep branch points: a chain branches after U(0.4, 0.9) of the turns it has left.
  No public statistic fixes this; it is our assumption, chosen so a prompt's tree shares
  about as much as the paper's Tree-Step trees (Table 3: 3.91x in-microbatch on Tiny/8).
- `last_turn_branching` (default off): off, every continuation after a fork runs at least
  two turns of its own (action, observation, action), so no fork resamples only the final
  action; on, a continuation may be one action (the generator before the knob).
- `allow_duplicates` (default off): leaves that reach the context cap together would end
  as identical sequences; off, the generator emits each distinct sequence once (such a
  group has fewer leaves than `rollouts_per_group`); on, it emits every copy.

Large presets are generated as *structure only*: segments with lengths, never token ids,
so a 64-GPU step of hundreds of millions of expanded tokens costs seconds. Small presets
materialise tokens (siblings' first action tokens are made distinct so the token-level
tree equals the segment-level one) for execution and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harts.config.workload import (  # noqa: F401  (importers of harts.tree.workload)
    FLASH_CONTEXT,
    FLASH_GPUS,
    PRESETS,
    Scheme,
    WorkloadConfig,
    WorkloadPreset,
    preset,
)
from harts.tree.build import build_structure
from harts.tree.forest import RolloutForest
from harts.tree.trajectory import Trajectory

# ---- segment-level generation ---------------------------------------------------------

PROMPT, ACTION, OBSERVATION = 0, 1, 2


@dataclass
class Workload:
    """Segments (symbols) with lengths and kinds, and the sequences built from them."""

    config: WorkloadConfig
    seg_length: list[int] = field(default_factory=list)
    seg_kind: list[int] = field(default_factory=list)
    seg_sibling: list[int] = field(default_factory=list)  # index among siblings (actions)
    seq_symbols: list[np.ndarray] = field(default_factory=list)
    seq_group: list[str] = field(default_factory=list)
    seq_id: list[str] = field(default_factory=list)
    seq_trained: list[np.ndarray] = field(default_factory=list)  # symbols whose tokens train

    def _segment(self, length: int, kind: int, sibling: int = 0) -> int:
        self.seg_length.append(int(length))
        self.seg_kind.append(kind)
        self.seg_sibling.append(sibling)
        return len(self.seg_length) - 1

    def forest(self) -> RolloutForest:
        """The structure-only forest (no token ids): what planners and the simulator use."""
        return build_structure(
            self.seq_symbols, self.seq_group, self.seq_id, np.asarray(self.seg_length, np.int64)
        )

    @property
    def expanded_tokens(self) -> int:
        lengths = np.asarray(self.seg_length, dtype=np.int64)
        return int(sum(lengths[s].sum() for s in self.seq_symbols))

    def trajectories(self, max_expanded_tokens: int = 20_000_000) -> list[Trajectory]:
        """Materialise token ids, loss masks, advantages and log-probs (seeded)."""
        if self.expanded_tokens > max_expanded_tokens:
            raise ValueError(
                f"workload has {self.expanded_tokens:,} expanded tokens; materialising more than "
                f"{max_expanded_tokens:,} is refused (use the structure-only forest)"
            )
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 1])
        seg_tokens = []
        for length, kind, sib in zip(self.seg_length, self.seg_kind, self.seg_sibling, strict=True):
            toks = rng.integers(0, cfg.vocab_size, size=length, dtype=np.int64)
            if kind == ACTION:
                # siblings start with distinct tokens, so a token-level fork sits exactly at
                # the segment-level one
                toks[0] = sib % cfg.vocab_size
            seg_tokens.append(toks)
        group_adv: dict[str, float] = {}
        out = []
        for symbols, group, sid, trained in zip(
            self.seq_symbols, self.seq_group, self.seq_id, self.seq_trained, strict=True
        ):
            tokens = np.concatenate([seg_tokens[s] for s in symbols])
            mask = np.concatenate([np.full(self.seg_length[s], s in trained) for s in symbols])
            mask[0] = False
            adv = float(np.round(rng.normal(), 6))
            group_adv.setdefault(group, adv)
            old = np.where(mask, -rng.exponential(1.0, size=tokens.size), 0.0)
            ref = None
            if cfg.with_ref_logprobs:
                ref = np.where(mask, old + rng.normal(0.0, 0.05, size=tokens.size), 0.0)
            out.append(Trajectory.make(sid, group, tokens, mask, adv, old, ref))
        return out


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, rng_range: tuple[int, int]) -> int:
    lo, hi = rng_range
    return int(np.clip(round(median * np.exp(sigma * rng.normal())), lo, hi))


def generate(cfg: WorkloadConfig) -> Workload:
    cfg.validate()
    rng = np.random.default_rng(cfg.seed)
    wl = Workload(cfg)
    for g in range(cfg.num_groups):
        group = f"g{g}"
        prompt = wl._segment(rng.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1), PROMPT)
        if cfg.scheme == Scheme.STEPWISE:
            for r in range(cfg.rollouts_per_group):
                turns = _rollout_turns(wl, rng, prompt, sibling=r)
                history = [prompt]
                for k, (act, obs) in enumerate(turns):
                    history.append(act)
                    wl.seq_symbols.append(np.asarray(history, dtype=np.int64))
                    wl.seq_group.append(group)
                    wl.seq_id.append(f"{group}/r{r}/t{k}")
                    wl.seq_trained.append(np.asarray([act], dtype=np.int64))
                    if obs is not None:
                        history.append(obs)
        else:
            _tree_rollouts(wl, rng, group, prompt)
    return wl


def _turn(wl: Workload, rng: np.random.Generator, context: int, sibling: int) -> tuple[int, int | None, int]:
    cfg = wl.config
    a = _lognormal_int(rng, cfg.action_median, cfg.action_sigma, cfg.action_range)
    o = _lognormal_int(rng, cfg.obs_median, cfg.obs_sigma, cfg.obs_range)
    act = wl._segment(a, ACTION, sibling)
    obs = wl._segment(o, OBSERVATION)
    return act, obs, context + a + o


def _rollout_turns(wl: Workload, rng: np.random.Generator, prompt: int, sibling: int) -> list[tuple[int, int | None]]:
    cfg = wl.config
    n = _lognormal_int(rng, cfg.turns_median, cfg.turns_sigma, cfg.turns_range)
    context = wl.seg_length[prompt]
    turns: list[tuple[int, int | None]] = []
    for k in range(n):
        act, obs, nxt = _turn(wl, rng, context, sibling if k == 0 else 0)
        if nxt > cfg.max_context and turns:
            break
        turns.append((act, obs))
        context = nxt
    # the last action ends the rollout: its observation is never part of a sequence
    return turns


def _tree_rollouts(wl: Workload, rng: np.random.Generator, group: str, prompt: int) -> None:
    cfg = wl.config
    leaf_counter = [0]
    emitted: set[tuple[str, bytes]] = set()
    # turns a continuation runs after a fork, at least (one: it may resample only the last action)
    min_after = 1 if cfg.last_turn_branching else 2

    def grow(path: list[int], context: int, leaves: int, turns_left: int, sibling: int, root: bool) -> None:
        # a chain of turns; while more than one leaf remains it branches after a random
        # fraction of the turns it has left, splitting the leaves among the continuations
        if leaves > 1:
            frac = rng.uniform(*cfg.branch_window)
            # at least one turn before each branch point (except the first chain's, right
            # after the prompt), so a fork never stacks on another at the same depth (with
            # last_turn_branching, as before the knob: any chain that starts at the prompt)
            least = 0 if len(path) == 1 and (root or cfg.last_turn_branching) else 1
            run = int(np.clip(round(turns_left * frac), least, max(turns_left - min_after, least)))
        else:
            run = turns_left
        path = list(path)
        capped = False
        for k in range(run):
            act, obs, nxt = _turn(wl, rng, context, sibling if k == 0 else 0)
            if nxt > cfg.max_context and len(path) > 1:
                capped = True
                break
            path += [act, obs]
            context = nxt
        if leaves <= 1 or capped:
            # drop the trailing observation: a sequence ends with the action it trains.
            # Leaves cut short by the context cap end here together (identical sequences,
            # emitted once unless allow_duplicates); a chain capped before its first own turn
            # ends where a sibling's did.
            symbols = np.asarray(path[:-1], dtype=np.int64)
            trained = symbols[np.asarray([wl.seg_kind[s] == ACTION for s in symbols])]
            key = (group, symbols.tobytes())
            if not cfg.allow_duplicates:
                if key in emitted:
                    return
                leaves = 1  # leaves cut short together by the cap: one sequence, not copies
            emitted.add(key)
            for _ in range(leaves):
                wl.seq_symbols.append(symbols)
                wl.seq_group.append(group)
                wl.seq_id.append(f"{group}/l{leaf_counter[0]}")
                wl.seq_trained.append(trained)
                leaf_counter[0] += 1
            return
        remaining = max(turns_left - run, min_after)
        k = min(cfg.branching, leaves)
        shares = [leaves // k + (1 if i < leaves % k else 0) for i in range(k)]
        for i, share in enumerate(shares):
            # each continuation draws its own remaining length around what is left
            own = max(min_after, int(round(remaining * np.exp(0.25 * rng.normal()))))
            grow(path, context, share, own, sibling=i, root=False)

    total = _lognormal_int(rng, cfg.turns_median, cfg.turns_sigma, cfg.turns_range)
    grow([prompt], wl.seg_length[prompt], cfg.rollouts_per_group, total, sibling=0, root=True)


def generate_trajectories(name: str, seed: int | None = None, **overrides: Any) -> list[Trajectory]:
    """Materialised trajectories of a (small) preset; `seed` overrides the preset's seed."""
    if seed is not None:
        overrides["seed"] = seed
    return generate(preset(name, **overrides)).trajectories()
