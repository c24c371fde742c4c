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

Large presets are generated as *structure only*: segments with lengths, never token ids,
so a 64-GPU step of hundreds of millions of expanded tokens costs seconds. Small presets
materialise tokens (siblings' first action tokens are made distinct so the token-level
tree equals the segment-level one) for execution and tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from harts.tree.build import build_structure
from harts.tree.forest import RolloutForest
from harts.tree.trajectory import Trajectory


class Scheme(StrEnum):
    STEPWISE = "stepwise"
    TREESTEP = "treestep"


@dataclass(frozen=True)
class WorkloadConfig:
    scheme: Scheme = Scheme.TREESTEP
    num_groups: int = 8
    rollouts_per_group: int = 8  # stepwise: independent rollouts; treestep: leaves
    branching: int = 2  # treestep: continuations at each branch point
    prompt_tokens: tuple[int, int] = (3000, 8000)
    turns_median: float = 35.0
    turns_sigma: float = 0.45
    turns_range: tuple[int, int] = (3, 150)
    action_median: float = 160.0
    action_sigma: float = 0.5
    action_range: tuple[int, int] = (30, 800)
    obs_median: float = 400.0
    obs_sigma: float = 1.1
    obs_range: tuple[int, int] = (10, 8000)
    max_context: int = 131072
    # the microbatch token budget this step is planned with unless a caller names one
    # (planners, the simulator, `harts plan`); every trajectory must fit it
    microbatch_tokens: int = 131072
    # treestep: a chain branches after this fraction (uniform) of the turns it has left
    branch_window: tuple[float, float] = (0.4, 0.9)
    vocab_size: int = 151_936
    with_ref_logprobs: bool = True
    seed: int = 0

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"workload config: {msg}")

        if self.num_groups < 1 or self.rollouts_per_group < 1:
            bad("num_groups and rollouts_per_group must be >= 1")
        if self.branching < 2:
            bad("branching must be >= 2")
        for name in ("prompt_tokens", "turns_range", "action_range", "obs_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                bad(f"{name} must satisfy 1 <= low <= high, got {(lo, hi)}")
        if self.max_context <= self.prompt_tokens[1]:
            bad("max_context must exceed the largest prompt")
        if self.microbatch_tokens < 1:
            bad("microbatch_tokens must be >= 1")
        if self.vocab_size < max(self.branching, 4):
            bad("vocab_size too small")
        lo, hi = self.branch_window
        if not 0 < lo <= hi <= 1:
            bad("branch_window must satisfy 0 < low <= high <= 1")


def _tiny(scheme: Scheme, **kw: Any) -> WorkloadConfig:
    base = dict(
        scheme=scheme,
        num_groups=2,
        rollouts_per_group=3 if scheme == Scheme.STEPWISE else 4,
        prompt_tokens=(20, 40),
        turns_median=3.0,
        turns_sigma=0.3,
        turns_range=(2, 5),
        action_median=8.0,
        action_sigma=0.4,
        action_range=(3, 16),
        obs_median=10.0,
        obs_sigma=0.6,
        obs_range=(2, 30),
        max_context=400,
        vocab_size=512,
    )
    base.update(kw)
    return WorkloadConfig(**base)


def _small(scheme: Scheme, **kw: Any) -> WorkloadConfig:
    base = dict(
        scheme=scheme,
        num_groups=4,
        rollouts_per_group=4,
        prompt_tokens=(300, 800),
        turns_median=8.0,
        turns_range=(3, 20),
        action_median=40.0,
        action_range=(10, 120),
        obs_median=80.0,
        obs_range=(5, 800),
        max_context=8192,
        vocab_size=512,
    )
    base.update(kw)
    return WorkloadConfig(**base)


def _swe(scheme: Scheme, gpus: int) -> WorkloadConfig:
    # one prompt group of 8 rollouts per GPU: the step grows with the cluster, as in the
    # paper's 8/32/64-GPU runs. The paper runs 32 and 64 GPUs with Flash (Table 3); those
    # presets cap contexts at 32k and plan 32k-token microbatches, which puts their
    # tree-step compression where Table 3's Flash rows are (6.24x / 6.90x as forests
    # against 6.65x / 6.56x; with the 131k cap 5.07x / 5.06x) and makes nearly every tree
    # larger than a microbatch, as Table 5's ~1200 microbatches per step imply. The
    # smaller presets keep the Tiny calibration (131k contexts and budget; Tiny/8 3.91x).
    if gpus in FLASH_GPUS:
        return WorkloadConfig(scheme=scheme, num_groups=gpus, seed=gpus, max_context=FLASH_CONTEXT,
                              microbatch_tokens=FLASH_CONTEXT)
    return WorkloadConfig(scheme=scheme, num_groups=gpus, seed=gpus)


FLASH_GPUS = (32, 64)
FLASH_CONTEXT = 32768


PRESETS: dict[str, WorkloadConfig] = {
    "tiny-stepwise": _tiny(Scheme.STEPWISE),
    "tiny-treestep": _tiny(Scheme.TREESTEP),
    "small-stepwise": _small(Scheme.STEPWISE),
    "small-treestep": _small(Scheme.TREESTEP),
    **{f"swe-{s.value}-{n}": _swe(s, n) for s in Scheme for n in (1, 8, 16, 32, 64)},
}


def preset(name: str, **overrides: Any) -> WorkloadConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown workload preset {name!r}; known: {', '.join(PRESETS)}")
    cfg = dataclasses.replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
    cfg.validate()
    return cfg


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

    def grow(path: list[int], context: int, leaves: int, turns_left: int, sibling: int) -> None:
        # a chain of turns; while more than one leaf remains it branches after a random
        # fraction of the turns it has left, splitting the leaves among the continuations
        if leaves > 1:
            frac = rng.uniform(*cfg.branch_window)
            # at least one turn before each branch point (except right after the prompt), so
            # a fork never stacks on another at the same depth
            least = 0 if len(path) == 1 else 1
            run = int(np.clip(round(turns_left * frac), least, max(turns_left - 1, least)))
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
            # Leaves cut short by the context cap end here together (identical sequences).
            symbols = np.asarray(path[:-1], dtype=np.int64)
            trained = symbols[np.asarray([wl.seg_kind[s] == ACTION for s in symbols])]
            for _ in range(leaves):
                wl.seq_symbols.append(symbols)
                wl.seq_group.append(group)
                wl.seq_id.append(f"{group}/l{leaf_counter[0]}")
                wl.seq_trained.append(trained)
                leaf_counter[0] += 1
            return
        remaining = max(turns_left - run, 1)
        k = min(cfg.branching, leaves)
        shares = [leaves // k + (1 if i < leaves % k else 0) for i in range(k)]
        for i, share in enumerate(shares):
            # each continuation draws its own remaining length around what is left
            own = max(1, int(round(remaining * np.exp(0.25 * rng.normal()))))
            grow(path, context, share, own, sibling=i)

    total = _lognormal_int(rng, cfg.turns_median, cfg.turns_sigma, cfg.turns_range)
    grow([prompt], wl.seg_length[prompt], cfg.rollouts_per_group, total, sibling=0)


def generate_trajectories(name: str, seed: int | None = None, **overrides: Any) -> list[Trajectory]:
    """Materialised trajectories of a (small) preset; `seed` overrides the preset's seed."""
    if seed is not None:
        overrides["seed"] = seed
    return generate(preset(name, **overrides)).trajectories()
